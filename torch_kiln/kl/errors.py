"""KernelError and the context that names a kernel and the user's line.

Every check of the language (tile_model limits, dtypes, constants, loops)
and every out-of-bounds access the simulator finds raises ``KernelError``
with ``kl kernel '<name>' at <file>:<line>: <what was asked>; <what is
allowed>``. The line is the user's: the innermost stack frame outside this
package when the language function was called (``user_location``).
"""

from __future__ import annotations

import os
import sys
import threading

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class KernelError(RuntimeError):
    """A kl kernel asked for something the language or the device's tile
    model does not allow (raised while tracing or simulating, or at the
    synchronization after a compiled kernel found it). ``kernel``,
    ``filename``, ``lineno`` say where."""

    def __init__(self, message: str, kernel: str | None = None, filename: str | None = None,
                 lineno: int | None = None):
        super().__init__(message)
        self.kernel, self.filename, self.lineno = kernel, filename, lineno


class _State(threading.local):
    def __init__(self):
        self.backend = None  # tracer.Tracer or simulator.Simulator while a kernel runs
        self.kernel = None  # the kernel's name


state = _State()


def user_location() -> tuple[str, int]:
    """(filename, line) of the innermost frame outside torch_kiln/kl."""
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == \
            _PACKAGE_DIR:
        frame = frame.f_back
    if frame is None:
        return ("<unknown>", 0)
    return (frame.f_code.co_filename, frame.f_lineno)


def where(location: tuple[str, int] | None = None) -> str:
    filename, lineno = location or user_location()
    return f"kl kernel {state.kernel!r} at {filename}:{lineno}"


def error(message: str, location: tuple[str, int] | None = None) -> KernelError:
    """A KernelError for the current kernel at the user's line (or ``location``)."""
    location = location or user_location()
    return KernelError(f"{where(location)}: {message}", state.kernel, *location)


def backend():
    if state.backend is None:
        raise RuntimeError("torch_kiln.kl: language functions (kl.load, kl.arange, ...) can only "
                           "be called inside a @kl.jit kernel launched as kernel[grid](...)")
    return state.backend
