"""Building custom kernel libraries: C++ sources -> a cached shared library.

``build_library`` compiles sources written against kiln/kernel.h with the
system C++ compiler (``$CXX``, else ``g++``) into one shared library, with
OpenMP for ``KernelContext::parallel_for``, PyTorch's include directory and
the SIMD flags Inductor uses on this machine (``simd_flags``), so a kernel
may use ATen's vectorized types (``<ATen/cpu/vec/vec.h>``). kiln/kernel.h
itself needs no PyTorch headers; a library builds in about a second either
way.

Cache: ``$KILN_KERNELS_CACHE_DIR``, else ``~/.cache/torch_kiln/kernels``. A
library is stored under its name and a key hashing everything that decides
the binary: the sources' text, the flags, kiln/kernel.h's text and the
compiler's version, so a second process (or a second call) with the same
inputs loads it without compiling, and any change rebuilds. A file lock
keeps two processes from building the same library at once; the library
is written under a temporary name and renamed into place, so a reader never
sees half a file.

Errors: a failed compilation raises ``KernelCompileError`` with the
compiler's own message. Sources given as files (``load``) are compiled where
they are, so the message points at the user's file and line; inline sources
(``load_inline``) are named ``<library> cpp_sources[k]`` in it, with line
numbers counted in that string.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

import torch

INCLUDE_DIR = Path(__file__).resolve().parent.parent / "include"
TORCH_INCLUDE_DIR = Path(torch.__file__).resolve().parent / "include"
# ATen's SIMD math (Sleef) lives in libtorch_cpu, which Python loads without
# exporting its symbols to later libraries: kernels link it explicitly.
TORCH_LIBRARY_DIR = Path(torch.__file__).resolve().parent / "lib"
HEADER = INCLUDE_DIR / "kiln" / "kernel.h"
BASE_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-fvisibility=hidden")


class KernelCompileError(RuntimeError):
    """The C++ compiler rejected a kernel library's sources."""


def cache_dir() -> Path:
    configured = os.environ.get("KILN_KERNELS_CACHE_DIR")
    path = Path(configured) if configured else Path.home() / ".cache" / "torch_kiln" / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as error:
        raise OSError(f"kiln kernels: cannot use the kernel cache directory {str(path)!r} "
                      f"({error}); set KILN_KERNELS_CACHE_DIR to a writable directory") from None
    return path


def compiler() -> str:
    return os.environ.get("CXX", "g++")


@functools.cache
def _compiler_version(cxx: str) -> str:
    try:
        result = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise KernelCompileError(f"kiln kernels: the C++ compiler {cxx!r} was not found "
                                 "(set CXX, or install g++)") from None
    return result.stdout.splitlines()[0] if result.stdout else cxx


@functools.cache
def simd_flags() -> tuple[str, ...]:
    """Flags that let kernels use ATen's SIMD types (``#include
    <ATen/cpu/vec/vec.h>``, at::vec::Vectorized) with the instruction set
    ATen itself runs on this machine (torch.backends.cpu.get_cpu_capability):
    its CPU_CAPABILITY macro and -m flags, as Inductor writes them for its C++
    kernels (torch._inductor.cpu_vec_isa). Inductor's own pick_vec_isa()
    is not used: it probes by compiling and loading test programs in
    subprocesses, seconds per process."""
    from torch._inductor import cpu_vec_isa

    isa_class = {"AVX512": cpu_vec_isa.VecAVX512,
                 "AVX2": cpu_vec_isa.VecAVX2}.get(torch.backends.cpu.get_cpu_capability())
    if isa_class is None:
        return ()
    isa = isa_class()
    return (*(f"-D{m}" for m in isa.build_macro()), *isa.build_arch_flags().split())


MAX_NAME_LENGTH = 100  # the cache's file names add a key and a suffix


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"kiln kernel library name must be a Python identifier, got {name!r}")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(f"kiln kernel library name has {len(name)} characters; at most "
                         f"{MAX_NAME_LENGTH} are allowed")


def check_flags(extra_cflags) -> list[str]:
    """``extra_cflags`` as a list of strings, or TypeError."""
    if isinstance(extra_cflags, str) or not all(isinstance(f, str) for f in extra_cflags):
        raise TypeError(f"kiln kernels: extra_cflags must be a list of flags such as "
                        f"['-O0', '-g'], got {extra_cflags!r}")
    return list(extra_cflags)


def build_library(name: str, *, inline_sources: list[str] = (), source_files: list[str] = (),
                  extra_cflags: list[str] = (), verbose: bool = False,
                  rebuild: bool = False) -> Path:
    """The path of the shared library built from the sources (cached;
    ``rebuild`` replaces a cached copy, e.g. one that fails to load)."""
    _check_name(name)
    extra_cflags = check_flags(extra_cflags)
    cxx = compiler()
    files = [Path(f).resolve() for f in source_files]
    for f in files:
        if f.is_dir():
            raise IsADirectoryError(f"kiln kernel library {name!r}: source file {str(f)!r} is a "
                                    "directory; pass the C++ files in it")
        if not f.is_file():
            raise FileNotFoundError(f"kiln kernel library {name!r}: source file {str(f)!r} "
                                    "does not exist")
    # Everything on the command line but the file names: all of it is in the key.
    flags = [*BASE_FLAGS, *simd_flags(), *extra_cflags, f"-I{INCLUDE_DIR}",
             f"-I{TORCH_INCLUDE_DIR}", f"-L{TORCH_LIBRARY_DIR}", "-ltorch_cpu", "-lc10",
             f"-Wl,-rpath,{TORCH_LIBRARY_DIR}",
             # An undefined symbol fails the build (with the linker's message)
             # instead of the later dlopen.
             "-Wl,--no-undefined"]
    key = hashlib.sha256()
    for part in (name, _compiler_version(cxx), HEADER.read_text(), *flags):
        key.update(part.encode() + b"\0")
    for text in inline_sources:
        key.update(b"inline\0" + text.encode() + b"\0")
    for f in files:
        key.update(str(f).encode() + b"\0" + f.read_bytes() + b"\0")
    digest = key.hexdigest()[:20]
    root = cache_dir()
    library = root / f"{name}-{digest}.so"
    if library.exists() and not rebuild:
        return library
    with open(root / f"{name}-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists() and not rebuild:  # another process built it while we waited
            return library
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}-") as work:
            inputs = []
            for k, text in enumerate(inline_sources):
                path = Path(work) / f"{name}_{k}.cpp"
                path.write_text(f'#line 1 "{name} cpp_sources[{k}]"\n{text}\n')
                inputs.append(str(path))
            inputs += [str(f) for f in files]
            output = Path(work) / "library.so"
            command = [cxx, *inputs, *flags, "-o", str(output)]
            if verbose:
                print("kiln kernels:", shlex.join(command))
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise KernelCompileError(
                    f"kiln kernel library {name!r} did not compile ({cxx}, exit status "
                    f"{result.returncode}):\n{result.stderr.strip()}")
            os.replace(output, library)
    return library
