"""Builds adaptive eager's generated fusion kernels (Note [Generated kernels
for fusion groups] in torch_kiln/csrc/aten/FusedKernels.cc).

kiln's build thread (C++, started at the first request) calls ``_build``
with a kernel's signature and C++ source; it compiles the source with the
custom-kernel builder (torch_kiln.kernels.build: ATen's SIMD flags, the
on-disk cache in ``$KILN_KERNELS_CACHE_DIR`` or ~/.cache/torch_kiln/kernels,
a file lock), adds ``-ffp-contract=off`` (no FMA contraction across ops: the
bits must stay ATen's), loads the library and returns the kernel's address
and vector width. A failure is raised back to the thread, which records it
(``stats()["failures"]``) and leaves that run of ops unfused.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib

from torch_kiln import _C

FLAGS = ("-ffp-contract=off",)
_LIBRARIES: list[ctypes.CDLL] = []  # loaded kernels are never unloaded


def _load(path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))
    library.kiln_fused_vector_size.restype = ctypes.c_int64
    return library


def _build(signature: str, source: str) -> tuple[int, int]:
    from torch_kiln.kernels import build

    name = "kiln_fused_" + hashlib.sha256(source.encode()).hexdigest()[:24]
    path = build.build_library(name, inline_sources=[source], extra_cflags=list(FLAGS))
    try:
        library = _load(path)
    except OSError:  # a damaged cached copy: build it again
        library = _load(build.build_library(name, inline_sources=[source],
                                            extra_cflags=list(FLAGS), rebuild=True))
    _LIBRARIES.append(library)
    address = ctypes.cast(library.kiln_fused_kernel, ctypes.c_void_p).value
    return address, int(library.kiln_fused_vector_size())


def register() -> None:
    """Makes ``_build`` kiln's fused kernel builder (at import; starts
    nothing), and stops building at exit: a build still running then is
    waited for (seconds at most: one compiler run), queued ones are dropped."""
    _C._set_fused_kernel_builder(_build)
    atexit.register(_C._stop_fused_kernel_builds)


def wait(timeout: float = 300.0) -> bool:
    """Waits until no fused kernel build is queued or running (True), or
    ``timeout`` seconds pass (False)."""
    return _C._wait_for_fused_kernels(float(timeout))


def stats() -> dict:
    """{"built": kernels of their own built (one per signature),
    "interpreter": whether the shared interpreter is built,
    "pending": builds queued or running,
    "runs": generated kernel calls by fusion groups so far,
    "interpreted_runs": how many of those ran the interpreter,
    "failures": [messages of failed builds]}."""
    return dict(_C._fused_kernel_stats())
