"""Custom kernels have no autograd formula: backward through one raises.

A kiln kernel (part 1's ``Kernel``, a ``namespace=`` operator, or a kl
kernel) writes its outputs in place, so autograd would otherwise see the
written tensors as untouched: ``scale(out, x, 2)`` then
``(out * x).sum().backward()`` would give ``x.grad == 2 * x`` instead of
``4 * x``, silently. As ``torch.library.custom_op`` does for an operator
without ``register_autograd`` (torch/_library/autograd.py), a call with grad
mode on and any tensor argument that requires grad gives each written
(floating-point) tensor a grad_fn whose backward raises
``RuntimeError: Trying to backward through <kernel> but no autograd formula
was registered...``. Calls under ``torch.no_grad()`` / ``inference_mode``, or
inside a ``custom_op`` implementation or an ``autograd.Function.forward``
(both run with grad mode off), or with no tensor requiring grad, are
untouched; the forward result is unchanged either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _message(name: str) -> str:
    return (f"Trying to backward through {name} (a custom kiln kernel) but no autograd formula "
            "was registered. Wrap the kernel in an operator with torch_kiln.kernels.custom_op "
            "(a function that allocates and returns its outputs) and use register_autograd to "
            "add one, or launch the kernel under torch.no_grad() if no gradient should flow "
            "through it (docs/kernels.md, 'Autograd').")


class _NoAutogradFormula(torch.autograd.Function):
    """Marks the written tensors modified; its backward raises."""

    @staticmethod
    def forward(ctx, name, n_dirty, *tensors):
        ctx.kernel_name = name
        ctx.mark_dirty(*tensors[:n_dirty])
        return tensors[:n_dirty]

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_message(ctx.kernel_name))


def guard_backward(name: str, tensors: Sequence[torch.Tensor],
                   written: Sequence[torch.Tensor]) -> None:
    """After kernel ``name`` was launched with ``tensors`` (all its tensor
    arguments), of which it wrote ``written`` in place: if grad mode is on and
    any of ``tensors`` requires grad, mark each floating-point written tensor
    as modified by a node whose backward raises (see the module docstring).
    Raises what an in-place op raises for a view of a leaf requiring grad."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        return
    dirty = [t for t in written if t.is_floating_point() or t.is_complex()]
    if not dirty:
        return
    others = [t for t in tensors if t.requires_grad and not any(t is d for d in dirty)]
    _NoAutogradFormula.apply(name, len(dirty), *dirty, *others)
