"""Custom kernels on kiln (issue 13, part 1): C++ kernels written against
``kiln/kernel.h`` (``torch_kiln/include``), compiled and cached by
``load_inline`` / ``load``, launched as tasks on kiln streams, and made
PyTorch operators with ``custom_op``. See docs/kernels.md.

* ``load_inline(name, cpp_sources, functions)`` / ``load(name, sources,
  functions)``: a ``KernelLibrary`` whose attributes are its kernels.
* ``custom_op(qualname, mutates_args=..., cpu=..., fake=...)``: a kiln kernel
  as a torch.library operator (eager, torch.compile, opcheck).
* ``include_dir()``: where kiln/kernel.h is, for building kernels yourself.
"""

from torch_kiln.kernels.build import INCLUDE_DIR, KernelCompileError
from torch_kiln.kernels.launch import Kernel
from torch_kiln.kernels.library import KernelLibrary, load, load_inline
from torch_kiln.kernels.ops import custom_op


def include_dir() -> str:
    """The directory holding ``kiln/kernel.h``."""
    return str(INCLUDE_DIR)


__all__ = ["Kernel", "KernelCompileError", "KernelLibrary", "custom_op", "include_dir", "load",
           "load_inline"]
