"""Kiln's part of Inductor's cache key.

Inductor caches compiled graphs (FX graph cache, AOTAutograd cache) under a
key built from the graph, the inputs, torch's own sources and Inductor's
config, so a change to *kiln's* code generation (this package: the wrapper,
the scheduling, the trampoline) would not invalidate code cached by an older
kiln — a prototype ran a stale wrapper that way. Inductor's hook for a
device backend's part of the key is the ``device_custom_pass`` of
``register_backend_for_device``: its ``uuid()`` enters every key
(``FxGraphHashDetails.custom_backend_passes``). ``KilnCodegenPass`` leaves
the graph unchanged and its uuid hashes kiln's code generator: the sources of
this package, the compiler package's DeviceInterface and convolution
strides under FakeTensorMode (fake_convolution.py), the normalization
rules (normalization.py), the small matmul decompositions
(small_matmuls.py), the traced recurrent layers and dropout
(traced_compositions.py), the
identity of
the ``torch_kiln._C`` build that launches the kernels, and the intra-op
thread count the kernels are generated for.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphModulePass, get_hash_for_files


@functools.cache
def codegen_uuid() -> str:
    """A hash of everything that decides what kiln's code generator writes."""
    import torch_kiln._C

    here = Path(__file__).resolve().parent
    files = sorted(str(p) for p in here.glob("*.py"))
    files.append(str(here.parent / "device_interface.py"))
    # Output strides of kiln convolutions in the traced graph.
    files.append(str(here.parent / "fake_convolution.py"))
    # Normalization rules and decompositions (CPU's branch on kiln).
    files.append(str(here.parent / "normalization.py"))
    # Small matmul decompositions (CPU's branch on kiln).
    files.append(str(here.parent / "small_matmuls.py"))
    # Recurrent layers and dropout traced with CPU's Python decompositions.
    files.append(str(here.parent / "traced_compositions.py"))
    files = [f for f in files if os.path.exists(f)]
    stat = os.stat(torch_kiln._C.__file__)
    build = f"{torch_kiln._C.__file__}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    return get_hash_for_files(tuple(files), extra=build.decode()).hex()


class KilnCodegenPass(CustomGraphModulePass):
    """Runs on post-grad graphs that use kiln; changes nothing. Exists for
    ``uuid()``, kiln's part of Inductor's cache key."""

    def __call__(self, gm: torch.fx.GraphModule) -> None:
        return None

    def uuid(self) -> str:
        # Inductor keys CPU graphs on the thread count their kernels are
        # generated for (FxGraphHashDetails.cpp_runtime_thread_count) but not
        # graphs without CPU tensors; kiln's kernels depend on it as CPU's do
        # (Note [Generated kernels use at most their compile-time thread
        # count] in kernels.py).
        from torch._inductor.utils import parallel_num_threads

        return f"{codegen_uuid()}:threads={parallel_num_threads()}"
