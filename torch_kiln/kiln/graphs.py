"""Kiln graphs: capture a kiln stream's work once, replay it with one launch.

The API and semantics are ``torch.cuda``'s CUDA Graphs
(``torch/cuda/graphs.py``): :class:`KilnGraph` mirrors
``torch.cuda.CUDAGraph``, :class:`graph` mirrors ``torch.cuda.graph``,
:func:`graph_pool_handle` and :func:`is_current_stream_capturing` their CUDA
namesakes, and :func:`make_graphed_callables` (in ``_graphed_callables.py``)
``torch.cuda``'s (forward and backward graphs of a module or function).

What kiln guarantees (Note [Kiln graphs] in ``torch_kiln/csrc/core/KilnGraph.cc``):

* Capture does not run the work: the ops launched on the capturing stream are
  recorded; tensors they allocate come from the graph's private memory pool,
  so every replay reads and writes the same addresses. Refill static inputs
  with ``copy_`` before :meth:`KilnGraph.replay`; results land in the tensors
  the capture returned.
* Replay is one launch on the current stream (ordered after earlier work on
  it), with no per-op work on the Python thread; it may run on any stream of
  the capture's device, the default stream included.
* Random ops (dropout, ``randn``...) draw new numbers at every replay; a
  sequence of replays draws exactly what running the captured ops eagerly in
  the same order would draw from the same generator state (so
  ``torch.manual_seed`` before the first replay makes replays deterministic).
* Side streams join a capture as on CUDA: ``side.wait_stream(capturing)``
  brings ``side`` in (its work is recorded into the same graph and allocates
  from the graph's pool), and ``capturing.wait_stream(side)`` joins it back;
  a capture that ends with a side stream not joined back raises CUDA's
  "capturing stream has unjoined work". A replay runs every stream's captured
  work in capture order on the replay stream. An event recorded during the
  capture marks a point in the graph: ``query()``, ``synchronize()`` and
  ``elapsed_time`` of it raise until it is recorded again outside a capture.
* Refused during capture, with ``RuntimeError: ... operation not permitted
  when stream is capturing`` naming the op, and the capture is then
  invalidated (``capture_end`` raises; nothing is kept): host reads of device
  values (``item()``, printing, ``nonzero``...), host copies other than
  ``non_blocking=True`` ones with dense pinned tensors (those are captured,
  and each replay copies anew), ``torch.kiln.synchronize()``, ``synchronize()``/``query()`` of a
  stream of the capture, waits for pending work of streams outside the
  capture, the default stream joining the capture, and an op's first call
  with a new layout class (kiln's meta-kernel check): warm up by running the
  captured code once before capture, as CUDA requires. Streams outside the
  capture keep working normally, whatever ``capture_error_mode``.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any, Callable, Optional

import torch

from torch_kiln import _C
from torch_kiln.kiln._graphed_callables import make_graphed_callables

# torch.accelerator.Graph creates a KilnGraph on kiln.
_C._register_accelerator_graph()

__all__ = [
    "KilnGraph",
    "graph",
    "graph_pool_handle",
    "is_current_stream_capturing",
    "make_graphed_callables",
]


def is_current_stream_capturing() -> bool:
    """True if a kiln graph capture is underway on the current kiln stream."""
    from torch_kiln.kiln import _lazy_init

    _lazy_init()
    return _C._is_current_stream_capturing()


def graph_pool_handle() -> tuple[int, int]:
    """An opaque token naming a graph memory pool that several captures may share
    (pass it as ``pool=`` to :class:`graph` or :meth:`KilnGraph.capture_begin`)."""
    return _C._graph_pool_handle()


class KilnGraph(_C._KilnGraph):
    """A captured kiln graph (``torch.cuda.CUDAGraph`` on kiln).

    Capture with ``with torch.kiln.graph(g): ...`` (or ``capture_begin()`` /
    ``capture_end()`` on a non-default stream), then call :meth:`replay`.
    """

    def __init__(self, keep_graph: bool = False) -> None:
        # keep_graph is accepted for CUDA compatibility; kiln graphs need no
        # separate instantiation step, so it changes nothing.
        super().__init__()
        self._keep_graph = keep_graph

    def capture_begin(self, pool: Optional[tuple[int, int]] = None,
                      capture_error_mode: str = "global") -> None:
        """Begins capturing the current kiln stream (it must not be the default stream).

        ``pool``: share the memory pool of another graph (``other.pool()``) or of
        :func:`graph_pool_handle`. ``capture_error_mode``: "global",
        "thread_local" or "relaxed" (accepted; kiln applies one rule, see the module docs).
        Raises RuntimeError on the default stream, a stream already capturing, or a
        graph that already holds a capture (call :meth:`reset` first).
        """
        if pool is not None and not (isinstance(pool, (tuple, list)) and len(pool) == 2 and
                                     all(isinstance(p, int) and not isinstance(p, bool)
                                         for p in pool)):
            raise TypeError("kiln graph capture: pool must be None or a pool token (a tuple of "
                            "two ints from torch.kiln.graph_pool_handle() or "
                            f"other_graph.pool()), got {type(pool).__name__} {pool!r}")
        super().capture_begin(pool=(0, 0) if pool is None else tuple(pool),
                              capture_error_mode=capture_error_mode)

    def capture_end(self) -> None:
        """Ends the capture. Raises RuntimeError if an operation invalidated it; warns
        (as CUDA does) if nothing was captured."""
        self._capture_end_quietly()
        if super().num_nodes() == 0:
            warnings.warn(
                "The kiln graph is empty. This usually means that the graph was attempted to be "
                "captured on the wrong device or stream.", stacklevel=2)

    def _capture_end_quietly(self) -> None:
        """capture_end without the empty-graph warning (for a capture whose body
        raised: its error, not an empty graph, is the news)."""
        super().capture_end()

    def instantiate(self) -> None:
        """No-op (kiln graphs are launchable when captured); kept for CUDA compatibility."""

    def replay(self) -> None:
        """Launches the captured work on the current stream of the capture's device."""
        super().replay()

    def reset(self) -> None:
        """Drops the captured graph and its use of the memory pool. Memory of tensors the
        capture returned is freed when those tensors are; ``torch.kiln.empty_cache()``
        then returns it to the device."""
        super().reset()

    def pool(self) -> tuple[int, int]:
        """The id of this graph's memory pool, to share with later captures."""
        return super().pool()

    def num_nodes(self) -> int:
        """Number of captured tasks, copies and memsets (0 without a capture)."""
        return super().num_nodes()


class graph:
    """Context manager capturing kiln work into a :class:`KilnGraph` (``torch.cuda.graph``).

    Arguments:
        kiln_graph: the graph to capture into.
        pool: a pool token (``other_graph.pool()`` or :func:`graph_pool_handle`)
            to share memory with other captures.
        stream: the stream to capture on; by default a side stream of the
            current device that ``graph`` creates once and reuses (never the
            default stream).
        capture_error_mode: "global", "thread_local" or "relaxed".

    On entry it synchronizes the device and empties the cache, as CUDA's does
    (and collects garbage if ``torch.compiler.config.force_cudagraph_gc``).
    If the body raises, the capture is ended and discarded and the body's
    exception propagates unchanged.
    """

    # One side stream per device, made on first use. (CUDA keeps a single
    # one, made on whichever device was current first; a capture for
    # another device would then miss that device's work.)
    _default_capture_streams: dict[int, torch.Stream] = {}

    def __init__(self, kiln_graph: KilnGraph, pool: Optional[tuple[int, int]] = None,
                 stream: Optional[torch.Stream] = None,
                 capture_error_mode: str = "global") -> None:
        import torch_kiln.kiln as kiln

        if stream is None:
            stream = graph._default_capture_stream()
        self.pool = pool
        self.capture_stream = stream
        self.stream_ctx = kiln.stream(self.capture_stream)
        self.kiln_graph = kiln_graph
        self.capture_error_mode = capture_error_mode

    @staticmethod
    def _default_capture_stream() -> torch.Stream:
        """The side stream ``graph`` captures on by default on the current device."""
        import torch_kiln.kiln as kiln

        device = kiln.current_device()
        stream = graph._default_capture_streams.get(device)
        if stream is None:
            stream = graph._default_capture_streams[device] = kiln.Stream(device)
        return stream

    def __enter__(self) -> None:
        import torch_kiln.kiln as kiln

        kiln.synchronize()
        if torch.compiler.config.force_cudagraph_gc:  # as torch.cuda.graph: costly, opt-in
            gc.collect()
        kiln.empty_cache()
        self.stream_ctx.__enter__()
        try:
            self.kiln_graph.capture_begin(self.pool, capture_error_mode=self.capture_error_mode)
        except BaseException:
            self.stream_ctx.__exit__(None, None, None)
            raise

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None:
                self.kiln_graph.capture_end()
            else:
                # The body failed: end the capture quietly so the body's own
                # error is what the user sees.
                try:
                    self.kiln_graph._capture_end_quietly()
                except RuntimeError:
                    pass
                self.kiln_graph.reset()
        finally:
            self.stream_ctx.__exit__(exc_type, exc, tb)
