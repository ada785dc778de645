"""GradScaler with a fused optimizer whose parameters span several kiln
devices: one found_inf flag, never a count.

Note [found_inf summed over devices]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``GradScaler._unscale_grads_`` (torch/amp/grad_scaler.py) returns one
found_inf flag per device, each 0.0 or 1.0. For an optimizer with
``_step_supports_amp_scaling`` (every ``fused=True`` optimizer),
``GradScaler.step()`` hands the optimizer their *sum*, and the fused steps
(``torch.optim.adam._fused_adam`` and its siblings for AdamW, SGD, Adagrad)
use it twice: ATen's kernels (FusedAdamKernel.cpp, fused_adam_utils.cuh)
skip the update only when ``*found_inf == 1``, and the Python step subtracts
found_inf from the step counts it has just incremented. With the parameters
on two devices and a non-finite gradient on both, the sum is 2.0: the update
is applied with the non-finite gradients (every parameter becomes NaN) and
the step counts go back by two. CUDA has the same defect; fused=False is
unaffected (it tests ``sum(...) != 0`` on the host).

For a ``GradScaler("kiln")`` Kiln wraps ``_unscale_grads_`` so that, when the
gradients span more than one device, it returns a single flag (the maximum of
the per-device flags, on the scaler's device): 1.0 if any device found an inf
or NaN, else 0.0. Every reader of ``found_inf_per_device`` (``step()``'s
fused branch and its ``.item()`` test, ``update()``) only combines the flags,
so their answers stay the same, and the fused step gets the 0/1 flag its
kernel expects. The flags are combined on the device (non_blocking copies
and ``torch.maximum``): no synchronization. Other devices' scalers and
subclasses that override ``_unscale_grads_`` (FSDP's ShardedGradScaler) are
untouched.
"""

from __future__ import annotations

import functools

import torch
from torch.amp.grad_scaler import GradScaler


def _one_flag(per_device: dict, device: torch.device) -> dict:
    """{device: max of the per-device 0/1 flags}, computed in stream order."""
    flags = [flag.to(device, non_blocking=True) for flag in per_device.values()]
    merged = functools.reduce(torch.maximum, flags)
    return {merged.device: merged}


def install() -> None:
    """Wraps ``GradScaler._unscale_grads_`` once per process (idempotent)."""
    original = GradScaler._unscale_grads_
    if getattr(original, "_kiln_one_found_inf", False):
        return
    backend = torch._C._get_privateuse1_backend_name()

    @functools.wraps(original)
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = original(self, optimizer, inv_scale, found_inf, allow_fp16)
        if self._device != backend or len(per_device) < 2:
            return per_device
        return _one_flag(per_device, found_inf.device)

    _unscale_grads_._kiln_one_found_inf = True
    GradScaler._unscale_grads_ = _unscale_grads_
