"""``load_inline`` / ``load``: build a kernel library and get its kernels."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from torch_kiln.kernels import build
from torch_kiln.kernels.launch import Kernel
from torch_kiln.kernels.signature import parse


class KernelLibrary:
    """The kernels of one loaded library, as attributes named like their
    KILN_KERNEL functions (``library.scale(out, x, 2.0)``)."""

    def __init__(self, name: str, path, signatures: Sequence[str]):
        self.name = name
        self.path = str(path)
        self._handle = ctypes.CDLL(self.path)  # kept for the life of the library
        self.kernels: dict[str, Kernel] = {}
        for text in signatures:
            signature = parse(text)
            if signature.name in self.kernels:
                raise ValueError(f"kiln kernel library {name!r}: kernel {signature.name!r} is "
                                 "declared twice in functions=")
            symbol = f"kiln_kernel_{signature.name}"
            try:
                entry = getattr(self._handle, symbol)
            except AttributeError:
                raise AttributeError(
                    f"kiln kernel library {name!r}: functions= declares {signature.name!r}, but "
                    f"the sources define no KILN_KERNEL({signature.name})") from None
            address = ctypes.cast(entry, ctypes.c_void_p).value
            self.kernels[signature.name] = Kernel(name, signature, address)

    def __getattr__(self, attr: str) -> Kernel:
        kernels = self.__dict__.get("kernels", {})
        if attr in kernels:
            return kernels[attr]
        raise AttributeError(f"kiln kernel library {self.__dict__.get('name')!r} has no kernel "
                             f"{attr!r}; it has {', '.join(kernels) or 'none'}")

    def __repr__(self) -> str:
        return f"<kiln kernel library {self.name} ({', '.join(self.kernels)}) at {self.path}>"


def _signatures(functions) -> list[str]:
    if isinstance(functions, str):
        functions = [functions]
    functions = list(functions)
    if not functions:
        raise ValueError("kiln kernels: functions= must list at least one kernel signature, "
                         "e.g. ['scale(float32[*]! out, float32[*] x, float alpha)']")
    return functions


def load_inline(name: str, cpp_sources, functions, *, extra_cflags: Sequence[str] = (),
                verbose: bool = False) -> KernelLibrary:
    """Compiles ``cpp_sources`` (a string or a list of strings, C++ that
    includes ``<kiln/kernel.h>``) into library ``name`` (cached on disk) and
    returns its kernels. ``functions``: one signature per KILN_KERNEL to
    expose (torch_kiln/kernels/signature.py), e.g.
    ``"scale(float32[*]! out, float32[*] x, float alpha)"``.

    Raises KernelCompileError with the compiler's message if the sources do
    not compile, ValueError for a bad signature, AttributeError for a
    declared kernel the sources do not define."""
    sources = [cpp_sources] if isinstance(cpp_sources, str) else list(cpp_sources)
    if not sources or not all(isinstance(s, str) for s in sources):
        raise TypeError("kiln kernels: cpp_sources must be a string or a list of strings")
    signatures = _signatures(functions)
    path = build.build_library(name, inline_sources=sources, extra_cflags=list(extra_cflags),
                               verbose=verbose)
    return KernelLibrary(name, path, signatures)


def load(name: str, sources, functions, *, extra_cflags: Sequence[str] = (),
         verbose: bool = False) -> KernelLibrary:
    """As load_inline, from C++ files (``sources``: paths); compiler messages
    name the files and lines."""
    files = [sources] if isinstance(sources, str) else list(sources)
    if not files:
        raise ValueError("kiln kernels: sources must name at least one C++ file")
    signatures = _signatures(functions)
    path = build.build_library(name, source_files=files, extra_cflags=list(extra_cflags),
                               verbose=verbose)
    return KernelLibrary(name, path, signatures)
