"""``load_inline`` / ``load``: build a kernel library and get its kernels."""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence

from torch_kiln.kernels import build
from torch_kiln.kernels.autograd import autograd_kernel
from torch_kiln.kernels.launch import Kernel
from torch_kiln.kernels.signature import parse


def alias_names():
    """Alias-set names for a schema's written tensors: a0, a1, ... (distinct:
    written tensors are not aliases of one another; any number of them).
    Shared by part 1's kernels and kl's (torch_kiln.kl.jit)."""
    return (f"a{i}" for i in itertools.count())


def operator_schema(signature) -> str:
    """The torch.library schema of a kernel: its arguments in order, written
    tensors as mutated (``Tensor(a0!)``), no returns (outputs are passed in),
    e.g. ``scale(Tensor(a0!) out, Tensor x, float alpha) -> ()``."""
    parts, aliases = [], alias_names()
    for argument in signature.arguments:
        if argument.kind == "tensor":
            parts.append(f"Tensor({next(aliases)}!) {argument.name}" if argument.written
                         else f"Tensor {argument.name}")
        else:
            parts.append(f"{argument.kind} {argument.name}")
    return f"{signature.name}({', '.join(parts)}) -> ()"


class KernelLibrary:
    """The kernels of one loaded library, as attributes named like their
    KILN_KERNEL functions (``library.scale(out, x, 2.0)``). With a
    ``namespace``, each kernel is also the PyTorch operator
    ``torch.ops.<namespace>.<kernel>`` (schema: ``operator_schema``), with a
    kiln implementation (the kernel) and a fake one (it returns nothing and
    mutates its written tensors in place), so it works in eager code and as
    one node under torch.compile; and an Autograd kernel that makes backward
    through it raise (autograd.py)."""

    def __init__(self, name: str, path, signatures: Sequence[str], namespace: str | None = None):
        self.name = name
        self.path = str(path)
        # Kept for the life of the process: ctypes never unloads a library,
        # and queued tasks may still run its kernels.
        self._handle = ctypes.CDLL(self.path)
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
        self.namespace = namespace
        self._torch_library = None
        if namespace is not None:
            self._register_operators(namespace)

    def _register_operators(self, namespace: str) -> None:
        import torch

        if not isinstance(namespace, str) or not namespace.isidentifier():
            raise ValueError(f"kiln kernel library {self.name!r}: namespace must be an "
                             f"identifier, got {namespace!r}")
        library = torch.library.Library(namespace, "FRAGMENT")
        for kernel_name, kernel in self.kernels.items():
            try:
                library.define(operator_schema(kernel.signature))
            except RuntimeError as error:
                raise RuntimeError(f"kiln kernel library {self.name!r}: cannot register "
                                   f"operator {namespace}::{kernel_name} ({error}); an operator "
                                   "of that name exists already (another library, or the same "
                                   "one loaded twice with this namespace)") from None
            library.impl(kernel_name, kernel, "PrivateUse1")
            torch.library.register_fake(f"{namespace}::{kernel_name}",
                                        lambda *args, **kwargs: None, lib=library)
            written = [i for i, a in enumerate(kernel.signature.arguments)
                       if a.kind == "tensor" and a.written]
            library.impl(kernel_name, autograd_kernel(f"{namespace}::{kernel_name}", written),
                         "Autograd", with_keyset=True)
        self._torch_library = library  # the registrations live as long as this object

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


def load_inline(name: str, cpp_sources, functions, *, namespace: str | None = None,
                extra_cflags: Sequence[str] = (), verbose: bool = False) -> KernelLibrary:
    """Compiles ``cpp_sources`` (a string or a list of strings, C++ that
    includes ``<kiln/kernel.h>``) into library ``name`` (cached on disk) and
    returns its kernels. ``functions``: one signature per KILN_KERNEL to
    expose (torch_kiln/kernels/signature.py), e.g.
    ``"scale(float32[*]! out, float32[*] x, float alpha)"``. ``namespace``:
    also register each kernel as operator ``torch.ops.<namespace>.<kernel>``
    (KernelLibrary).

    Raises KernelCompileError with the compiler's message if the sources do
    not compile, ValueError for a bad signature, AttributeError for a
    declared kernel the sources do not define."""
    sources = [cpp_sources] if isinstance(cpp_sources, str) else list(cpp_sources)
    if not sources or not all(isinstance(s, str) for s in sources):
        raise TypeError("kiln kernels: cpp_sources must be a string or a list of strings")
    signatures = _signatures(functions)
    return _load(name, signatures, namespace, inline_sources=sources,
                 extra_cflags=extra_cflags, verbose=verbose)


def load(name: str, sources, functions, *, namespace: str | None = None,
         extra_cflags: Sequence[str] = (), verbose: bool = False) -> KernelLibrary:
    """As load_inline, from C++ files (``sources``: paths); compiler messages
    name the files and lines."""
    files = [sources] if isinstance(sources, str) else list(sources)
    if not files:
        raise ValueError("kiln kernels: sources must name at least one C++ file")
    signatures = _signatures(functions)
    return _load(name, signatures, namespace, source_files=files, extra_cflags=extra_cflags,
                 verbose=verbose)


def _load(name, signatures, namespace, **build_args) -> KernelLibrary:
    """Builds (or finds in the cache) and loads; a cached library that does
    not load (truncated, overwritten) is rebuilt once."""
    for signature in signatures:
        parse(signature)  # a bad signature fails before any build
    path = build.build_library(name, **build_args)
    try:
        return KernelLibrary(name, path, signatures, namespace)
    except OSError as error:
        path = build.build_library(name, rebuild=True, **build_args)
        try:
            return KernelLibrary(name, path, signatures, namespace)
        except OSError:
            raise OSError(f"kiln kernel library {name!r}: {path} does not load even after a "
                          f"rebuild ({error})") from None
