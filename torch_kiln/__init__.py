"""Kiln: an open, native PyTorch backend for AI accelerators.

Importing ``torch`` loads Kiln automatically (through the ``torch.backends``
entry point), after which ``"kiln"`` is a PyTorch device like ``"cuda"``::

    import torch
    x = torch.randn(4, 4, device="kiln")
    y = (x @ x).relu().cpu()

With ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` the automatic load is off; then
``import torch_kiln`` does the same registration.

The device API mirrors ``torch.cuda`` and lives in ``torch.kiln``
(``torch_kiln/kiln/``); ``torch.accelerator`` works unchanged.
"""


def _autoload() -> None:
    """Entry point of the ``torch.backends`` group (PyTorch calls it during
    ``import torch``): importing this package is the whole registration.

    Defined before ``import torch`` below, because importing ``torch_kiln``
    first makes ``import torch`` call this entry point while this module is
    still initialising."""


import torch  # noqa: E402

# Loading the extension registers the kiln device with PyTorch's C++ core:
# device guard, hooks, allocators and kernels for DeviceType::PrivateUse1.
from torch_kiln import _C  # noqa: F401

torch.utils.rename_privateuse1_backend("kiln")

# Kiln runs PyTorch's Python meta kernels, which would import torch._dynamo on
# the first op (Note [Meta kernels without importing Dynamo]).
from torch_kiln import _lazy_dynamo_disable  # noqa: E402

_lazy_dynamo_disable.install()

from torch_kiln import kiln  # noqa: E402  (needs the backend name above)

torch._register_device_module("kiln", kiln)
# `import torch.kiln.memory` (and `from torch.kiln.memory import ...`, as CUDA
# code writes for torch.cuda.memory) must find the loaded submodules, not load
# second copies under the torch.kiln name.
import sys  # noqa: E402

for _name in ("amp", "memory", "nvtx", "random", "streams"):
    sys.modules.setdefault(f"torch.kiln.{_name}", getattr(kiln, _name))
del _name
torch.utils.generate_methods_for_privateuse1_backend(
    for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
)

# GradScaler("kiln") with a fused optimizer over several kiln devices
# (Note [found_inf summed over devices] in torch_kiln/kiln/_grad_scaler_fix.py).
from torch_kiln.kiln import _grad_scaler_fix  # noqa: E402

_grad_scaler_fix.install()

# nn.DataParallel over kiln devices: torch.nn.parallel.comm's torch._C
# primitives, which CPU builds of PyTorch lack (torch_kiln/kiln/_parallel_comm.py).
from torch_kiln.kiln import _parallel_comm  # noqa: E402

_parallel_comm.install()

# --- torch.compile: Dynamo's device interface for kiln -----------------------
# Registered when torch._dynamo.device_interface is first imported, so that
# `import torch` does not pay for importing Dynamo
# (Note [Registering with Dynamo lazily] in torch_kiln/compiler/__init__.py).
from torch_kiln.compiler import register_dynamo_hooks as _register_dynamo_hooks  # noqa: E402

_register_dynamo_hooks()
# -----------------------------------------------------------------------------

# --- torch.distributed: the kccl backend for kiln tensors ----------------------
# `import torch` has imported torch.distributed before it loads backends, so
# registering here costs no import (torch_kiln/distributed/__init__.py).
from torch_kiln.distributed import register as _register_kccl  # noqa: E402

_register_kccl()
# -----------------------------------------------------------------------------

__all__ = ["kiln"]
