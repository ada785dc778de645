"""Streams and events of kiln devices (mirrors ``torch.cuda.streams``).

A kiln stream is an in-order queue of device work run by its own worker
thread; work on different streams may overlap. Every device has a default
stream (id 0) and a pool of streams per priority (0 normal, -1 high), handed
out round-robin like CUDA's. Events mark points in a stream: record, wait
(make another stream wait), query, synchronize, and elapsed_time in
milliseconds, read from the device's clock when the marker ran.

``torch.Stream(device="kiln")`` and ``torch.Event(device="kiln")`` are the
same objects; ``torch.kiln.Stream`` and ``torch.kiln.Event`` add CUDA's
constructor signatures.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_kiln import _C
from torch_kiln.kiln._utils import _device_index


class Stream(torch.Stream):
    """A kiln stream (``torch.cuda.Stream``'s interface).

    Args:
        device: the kiln device (int, ``"kiln:N"``, ``torch.device``); default
            the current device.
        priority: 0 (normal, default) or negative (high). Kiln has two levels,
            as reported by ``priority_range()``; like CUDA, lower is higher.

    Use ``with torch.kiln.stream(s):`` (or ``with s:``) to make it current.
    """

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs):
        if {"stream_id", "device_index", "device_type"} & kwargs.keys():
            return super().__new__(cls, **kwargs)  # wrapping an existing stream
        index = _device_index(device, optional=True)
        return super().__new__(cls, device=torch.device("kiln", index), priority=priority)

    @property
    def priority(self) -> int:
        """0 for normal-priority streams (and the default stream), -1 for high."""
        return _C._stream_priority(self.stream_id)

    @staticmethod
    def priority_range() -> tuple[int, int]:
        """(least, greatest) priority: (0, -1), as ``torch.cuda.Stream`` reports."""
        return (0, -1)

    @property
    def kiln_stream(self) -> int:
        """The runtime's handle of this stream (a ``kilnStream_t``, as an int),
        like ``torch.cuda.Stream.cuda_stream``: pass it to code that calls the
        kiln runtime, or to ``torch.kiln.ExternalStream``."""
        return self.native_handle

    @property
    def _as_parameter_(self):
        """The handle as a ``ctypes.c_void_p``, so the stream can be passed to
        a ctypes function taking a ``kilnStream_t``."""
        import ctypes
        return ctypes.c_void_p(self.kiln_stream)

    def __repr__(self) -> str:
        return f"<torch.kiln.Stream device=kiln:{self.device_index} id={self.stream_id}>"


class ExternalStream(Stream):
    """A runtime stream created outside PyTorch, as a ``torch.kiln.Stream``
    (``torch.cuda.ExternalStream``'s interface), so that kiln work can be
    queued on a stream another library owns: ``with torch.kiln.stream(ext):``.

    Args:
        stream_ptr (int): the ``kilnStream_t`` handle (say from the runtime's
            ``kilnStreamCreate``, or another stream's ``kiln_stream``).
            ``0`` (NULL) names the current device's default stream, as in the
            runtime's API.
        device: the kiln device the stream belongs to; ``None`` (default)
            takes it from the runtime. A device that does not match raises.

    The wrapper does not own the stream: keep it alive (do not
    ``kilnStreamDestroy`` it) while PyTorch uses it; work queued on a destroyed
    stream raises ``RuntimeError``. The handle of one of PyTorch's own kiln
    streams gives that stream (``ExternalStream(s.kiln_stream) == s``).

    Raises:
        TypeError: ``stream_ptr`` is not an int.
        ValueError: the runtime does not know the handle (never created, or
            destroyed), or it belongs to another device than ``device``.
    """

    def __new__(cls, stream_ptr: int, device: Any = None, **kwargs):
        if isinstance(stream_ptr, bool) or not isinstance(stream_ptr, int):
            raise TypeError(f"ExternalStream: stream_ptr must be an int (a kilnStream_t handle), got "
                            f"{type(stream_ptr).__name__}.")
        if stream_ptr < 0 or stream_ptr >= 1 << 64:
            raise ValueError(f"ExternalStream: {stream_ptr:#x} is not a kiln runtime stream handle "
                             "(a pointer value).")
        index = -1 if device is None else _device_index(device, optional=True)
        if index < -1:
            raise ValueError(f"ExternalStream: expected a kiln device, got {device!r}.")
        stream_id, device_index, device_type = _C._stream_from_external(stream_ptr, index)
        return super().__new__(cls, stream_id=stream_id, device_index=device_index,
                               device_type=device_type, **kwargs)

    def __repr__(self) -> str:
        return (f"<torch.kiln.ExternalStream device=kiln:{self.device_index} "
                f"kiln_stream={self.kiln_stream:#x}>")


class Event(torch.Event):
    """A kiln event (``torch.cuda.Event``'s interface).

    Args:
        enable_timing: record timestamps so ``elapsed_time`` works.
        blocking: accepted for compatibility; synchronize always blocks.
        interprocess: not supported on kiln (raises ``RuntimeError``).
    """

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        if interprocess:
            raise RuntimeError("Kiln events cannot be shared between processes (interprocess=True).")
        event = super().__new__(cls, device="kiln", enable_timing=enable_timing, blocking=blocking)
        event._enable_timing = enable_timing
        return event

    def elapsed_time(self, end_event: torch.Event) -> float:
        """Milliseconds between this event's and ``end_event``'s completions,
        by the device clock. Raises ``RuntimeError`` (as ``torch.cuda.Event``
        does) unless both events were created with ``enable_timing=True`` on
        the same device and both have been recorded and completed."""
        if not (self._enable_timing and getattr(end_event, "_enable_timing", False)):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        unrecorded = [name for name, event in (("start", self), ("end", end_event))
                      if event.event_id == 0]
        if unrecorded:
            which = " and ".join(unrecorded)
            raise RuntimeError(
                "Both events must be recorded before calculating elapsed time; the "
                f"{which} event{'s were' if len(unrecorded) == 2 else ' was'} never recorded "
                "(record it with Event.record() first).")
        if self.device != end_event.device:
            raise RuntimeError(f"Both events must be on the same device; got {self.device} and "
                             f"{end_event.device}.")
        return _C._event_elapsed_time(self.event_id, end_event.event_id)


def _wrap(stream: torch.Stream) -> Stream:
    return Stream(stream_id=stream.stream_id, device_index=stream.device_index,
                  device_type=stream.device_type)


def current_stream(device: Any = None) -> Stream:
    """The calling thread's current stream of ``device`` (default: current device)."""
    return _wrap(torch.accelerator.current_stream(_device_index(device, optional=True)))


def default_stream(device: Any = None) -> Stream:
    """The default stream of ``device`` (default: current device)."""
    current = torch.accelerator.current_stream(_device_index(device, optional=True))
    return Stream(stream_id=0, device_index=current.device_index, device_type=current.device_type)


def _check_stream(stream: Any, function: str) -> None:
    if stream is not None and not isinstance(stream, torch.Stream):
        raise TypeError(f"{function} expected a torch.kiln.Stream or torch.Stream (or None), "
                        f"but got {type(stream).__name__}: {stream!r}")


def set_stream(stream: torch.Stream | None) -> None:
    """Make ``stream`` the current stream of its device and its device the
    current device, as ``torch.cuda.set_stream`` does. ``None`` is a no-op.

    Raises ``TypeError`` if ``stream`` is not a stream, ``ValueError`` if it
    is another device's."""
    _check_stream(stream, "torch.kiln.set_stream()")
    if stream is None:
        return
    if stream.device.type != "kiln":
        raise ValueError(f"Expected a kiln stream, got a stream on {stream.device}.")
    _C._set_device(stream.device_index)
    torch.accelerator.set_stream(stream)


class StreamContext:
    """Context manager selecting a stream (``torch.kiln.stream(s)``): inside
    the block ``s`` is the current stream and its device the current device;
    both are restored on exit. ``None`` makes it a no-op."""

    def __init__(self, stream: torch.Stream | None):
        _check_stream(stream, "torch.kiln.stream()")
        self.stream = stream
        self.src_prev_stream: torch.Stream | None = None
        self.dst_prev_stream: torch.Stream | None = None

    def __enter__(self):
        if self.stream is None:
            return None
        self.src_prev_stream = current_stream()
        if self.src_prev_stream.device != self.stream.device:
            self.dst_prev_stream = current_stream(self.stream.device_index)
        set_stream(self.stream)
        return self.stream

    def __exit__(self, exc_type, exc_value, traceback):
        if self.stream is None:
            return False
        if self.dst_prev_stream is not None:
            torch.accelerator.set_stream(self.dst_prev_stream)
        set_stream(self.src_prev_stream)
        return False


def stream(stream: torch.Stream | None) -> StreamContext:
    """``with torch.kiln.stream(s): ...`` runs the block's kiln work on ``s``."""
    return StreamContext(stream)
