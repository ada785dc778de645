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
    if name.startswith("kl::"):  # a kl kernel: kl.op is its operator wrapper
        wrap, section = "torch_kiln.kl.op", "Autograd for kl kernels"
    else:
        wrap, section = "torch_kiln.kernels.custom_op", "Autograd"
    return (f"Trying to backward through {name} (a custom kiln kernel) but no autograd formula "
            f"was registered. Wrap the kernel in an operator with {wrap} (a function that "
            "allocates and returns its outputs) and use register_autograd to add one, or launch "
            "the kernel under torch.no_grad() if no gradient should flow through it "
            f"(docs/kernels.md, '{section}').")


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
    # (Skipping tensors already marked: an eager operator call is guarded by
    # the kernel below autograd and then by autograd_kernel.)
    dirty = [t for t in written if (t.is_floating_point() or t.is_complex()) and
             type(t.grad_fn).__name__ != "_NoAutogradFormulaBackward"]
    if not dirty:
        return
    others = [t for t in tensors if t.requires_grad and not any(t is d for d in dirty)]
    _NoAutogradFormula.apply(name, len(dirty), *dirty, *others)


def autograd_kernel(name: str, written_positions: Sequence[int]):
    """The Autograd-key kernel of operator ``name`` (``namespace::opname``)
    whose written tensor arguments are at ``written_positions``: the
    operator below autograd, then guard_backward. Eager calls are already
    guarded by the kernel itself; torch.compile traces through this kernel
    (its fake implementation does not guard), so backward through a
    compiled call raises too instead of leaving the kernel's gradient out."""
    namespace, opname = name.split("::")

    def kernel(keyset, *args):
        op = getattr(getattr(torch.ops, namespace), opname).default
        with torch._C._AutoDispatchBelowAutograd():
            result = op.redispatch(keyset & torch._C._after_autograd_keyset, *args)
        guard_backward(name, [a for a in args if isinstance(a, torch.Tensor)],
                       [args[i] for i in written_positions])
        return result

    return kernel
