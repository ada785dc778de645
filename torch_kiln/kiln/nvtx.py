"""``torch.kiln.nvtx``: ``torch.cuda.nvtx``'s annotation API on kiln.

Kiln has no NVTX (NVIDIA's tools extension); each range is a
``torch.profiler.record_function`` range instead, so it shows in
``torch.profiler`` traces (CPU track, and on the kiln stream tracks for the
device work launched inside it: docs/profiling.md) as NVTX ranges show in
Nsight. Outside a profiler the calls cost a ``record_function``.

* ``range_push(msg)`` / ``range_pop()``: a per-thread stack of nested ranges;
  both return the zero-based depth of the range started or ended. ``range_pop``
  with no range open returns -1 and changes nothing (NVTX returns a negative
  value there too).
* ``range_start(msg)`` / ``range_end(handle)``: a range that may end on another
  thread; ``range_end`` of an unknown or ended handle raises ``ValueError``.
* ``mark(msg)``: an instantaneous event (a zero-length range).
* ``range(msg, *args, **kwargs)``: context manager and decorator around a
  ``range_push(msg.format(*args, **kwargs))`` / ``range_pop()`` pair.

``msg`` must be a ``str`` (``TypeError`` otherwise).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Iterator

from torch.autograd.profiler import record_function

__all__ = ["mark", "range", "range_end", "range_pop", "range_push", "range_start"]

_local = threading.local()
_started: dict[int, record_function] = {}
_started_lock = threading.Lock()
_next_handle = itertools.count(1)


def _stack() -> list[record_function]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _checked(msg: str, function: str) -> str:
    if not isinstance(msg, str):
        raise TypeError(f"torch.kiln.nvtx.{function}: msg must be a str, got "
                        f"{type(msg).__name__} {msg!r}.")
    return msg


def range_push(msg: str) -> int:
    """Open a nested range named ``msg`` on this thread; returns its zero-based depth."""
    rf = record_function(_checked(msg, "range_push"))
    rf.__enter__()
    stack = _stack()
    stack.append(rf)
    return len(stack) - 1


def range_pop() -> int:
    """Close this thread's innermost range; returns its zero-based depth, or -1
    if no range is open."""
    stack = _stack()
    if not stack:
        return -1
    stack.pop().__exit__(None, None, None)
    return len(stack)


def range_start(msg: str) -> int:
    """Open a range named ``msg`` that any thread may end; returns its handle
    (an int > 0) for ``range_end``."""
    rf = record_function(_checked(msg, "range_start"))
    rf.__enter__()
    with _started_lock:
        handle = next(_next_handle)
        _started[handle] = rf
    return handle


def range_end(range_id: int) -> None:
    """End the range ``range_start`` returned ``range_id`` for.

    Raises ``ValueError`` if ``range_id`` names no open range."""
    with _started_lock:
        rf = _started.pop(range_id, None)
    if rf is None:
        raise ValueError(f"torch.kiln.nvtx.range_end: {range_id!r} is not the handle of an open "
                         "range (range_start returns one; each range ends once).")
    rf.__exit__(None, None, None)


def mark(msg: str) -> None:
    """Record an instantaneous event named ``msg`` (a zero-length range)."""
    with record_function(_checked(msg, "mark")):
        pass


@contextlib.contextmanager
def range(msg: str, *args, **kwargs) -> Iterator[None]:
    """A range named ``msg.format(*args, **kwargs)`` around the block (or the
    decorated function)."""
    range_push(_checked(msg, "range").format(*args, **kwargs))
    try:
        yield
    finally:
        range_pop()
