"""Small matrix products compiled for kiln take CPU's branch.

Note [Kiln's small matmuls are CPU's]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Inductor replaces some matrix products with pointwise products and sums,
and chooses which by device. Kiln runs ATen's CPU matmul kernels, so for
compiled kiln to give compiled CPU's bits it must make CPU's choices; it
made CUDA's (the "not cpu" branches). In 2.13:

* the ``mm`` decomposition (``torch/_inductor/decomposition.py``): on CPU,
  a (1, K) @ (K, 1) dot product becomes ``sum(a * b)``, and an outer product
  (K == 1) becomes ``a * b`` only when both operands together have at most
  32 elements; other devices keep the dot product as a matmul and always
  turn the outer product into ``a * b``;
* the ``addmm`` decomposition: on CPU, a dot product, and a (1, K) @ (K, N)
  product with K, N <= 16, become sums of products plus ``bias``; other
  devices keep both as ``addmm`` and instead turn K == 1 into
  ``alpha * (a * b) + beta * bias``;
* the ``bmm`` decomposition: on CPU, a batch of dot products becomes a sum;
* the ``bmm`` lowering (``torch/_inductor/kernel/bmm.py``, ``tuned_bmm``):
  on CPU, M == 1 or N == 1 becomes a pointwise product summed over K.

A sum of products is not the bits of a BLAS dot product (another order of
additions): a (1, 9) @ (9, 13) ``addmm`` differed from compiled CPU in 6 of
13 float32 outputs (4.8e-7), a (3, 1, 1031) @ (3, 1031, 5) ``bmm`` in 11 of
15 (2.4e-5), its bfloat16 gradient by up to 0.03. For kiln tensors each
decomposition here runs CPU's branch, the same conditions and formulas, and
the ``bmm`` lowering is wrapped the same way (``_fix_small_bmm`` in
``inductor/fixes.py``); other devices get Inductor's functions unchanged.
(``grid_sampler_2d``'s decomposition also asks for "cpu", to choose whether
to expand the grid: layout only, measured bit-identical, left alone.)

Registered with the normalization decompositions, when Inductor's table is
built (Note [Kiln's normalization statistics are CPU's]); part of kiln's
Inductor cache key.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from torch_kiln.compiler.normalization import _on_kiln

aten = torch.ops.aten


def _cpu_branch_for_kiln(original: Callable[..., Any],
                         cpu_branch: Callable[..., Any]) -> Callable[..., Any]:
    """A decomposition that runs ``cpu_branch`` (``NotImplemented`` when it
    does not decompose) for a kiln first operand, ``original`` otherwise."""

    @functools.wraps(original)
    def decomposition(self, *args, **kwargs):
        if _on_kiln(self):
            return cpu_branch(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    decomposition.kiln_wraps = original  # type: ignore[attr-defined]
    return decomposition


def _cpu_branches():
    """The CPU branches of Inductor's mm, addmm and bmm decompositions,
    each cast to the computation dtype as Inductor's own are."""
    from torch._decomp.decompositions import pw_cast_for_opmath
    from torch._dynamo.utils import counters
    from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

    @pw_cast_for_opmath
    def mm(self, input2, out_dtype=None):
        # (M, K) @ (K, N); out_dtype as Inductor's: not read here.
        if (statically_known_true(self.size(-1) == 1)
                and statically_known_true(self.size(0) != 1)
                and statically_known_true(input2.size(1) != 1)
                and statically_known_true(self.size(0) > 0)
                and statically_known_true(input2.size(0) == 1)
                and self.dtype == input2.dtype
                and guard_or_false((torch.numel(self) + torch.numel(input2)) <= 32)):
            counters["inductor"]["decompose_mm"] += 1
            return self * input2
        if statically_known_true(self.size(0) == 1) and statically_known_true(input2.size(-1) == 1):
            counters["inductor"]["decompose_mm"] += 1
            return torch.sum(self.squeeze(0) * input2.squeeze(-1), dim=0,
                             keepdim=True).unsqueeze(0)
        return NotImplemented

    @pw_cast_for_opmath
    def addmm(self, mat1, mat2, out_dtype=None, beta=1, alpha=1):
        # self (bias) broadcast to (M, N) + (M, K) @ (K, N).
        if statically_known_true(mat1.size(0) == 1) and statically_known_true(mat2.size(-1) == 1):
            counters["inductor"]["decompose_addmm"] += 1
            out = torch.sum(mat1.squeeze(0) * mat2.squeeze(-1), dim=0, keepdim=True).unsqueeze(0)
            return alpha * out + beta * self
        if (statically_known_true(mat1.size(0) == 1)
                and guard_or_false(mat2.size(0) <= 16)
                and guard_or_false(mat2.size(1) <= 16)):
            counters["inductor"]["decompose_addmm"] += 1
            out = (mat1.T * mat2).sum(dim=0, keepdim=True)
            return alpha * out + beta * self
        return NotImplemented

    @pw_cast_for_opmath
    def bmm(self, batch2, out_dtype=None):
        # (B, M, K) @ (B, K, N).
        if statically_known_true(self.shape[2] == 1) and statically_known_true(batch2.shape[1] == 1):
            return (self * batch2).contiguous()  # every device's outer product
        if statically_known_true(self.size(1) == 1) and statically_known_true(batch2.size(-1) == 1):
            counters["inductor"]["decompose_bmm"] += 1
            return torch.sum(self.squeeze(1) * batch2.squeeze(-1), dim=1,
                             keepdim=True).unsqueeze(1)
        return NotImplemented

    return {aten.mm.default: mm, aten.addmm.default: addmm, aten.bmm.default: bmm}


def register_decompositions() -> None:
    """Inductor's mm, addmm and bmm decompositions give kiln tensors CPU's
    branch (idempotent). Needs ``torch._inductor.decomposition`` imported."""
    import torch._inductor.decomposition as inductor_decomposition

    table = inductor_decomposition.decompositions
    changed = False
    for op, cpu_branch in _cpu_branches().items():
        if op in table and not hasattr(table[op], "kiln_wraps"):
            table[op] = _cpu_branch_for_kiln(table[op], cpu_branch)
            changed = True
    if changed:
        # select_decomp_table() answers a cached copy of the table.
        inductor_decomposition.fast_random_decomps.cache_clear()
