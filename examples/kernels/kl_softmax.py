"""Numerically stable row softmax in the kl tile language, as
torch.softmax(x, dim=-1) for a 2-D float32 or bfloat16 x.

One program handles ROWS rows as a (ROWS, BLOCK) tile (BLOCK >= columns,
masked loads fill -inf so padding adds exp(-inf) = 0): subtract the row
maximum, exponentiate, multiply by the reciprocal of the row sum (one
division per row, as ATen's CPU softmax does; within 2 ULP of dividing
each element); in float32, rounded to x's dtype at the store. The exp is
kl.fast_exp (ATen's exp_u20 polynomial, within 5 ULP), as PyTorch's CPU
flash attention uses. docs/kernels.md writes this kernel step by step.
"""

from __future__ import annotations

import torch

import torch_kiln.kl as kl


@kl.jit
def softmax_kernel(out, x, n_rows, n_cols, ROWS: kl.constexpr, BLOCK: kl.constexpr):
    rows = kl.program_id(0) * ROWS + kl.arange(0, ROWS)
    cols = kl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    v = kl.load(x, (rows[:, None], cols[None, :]), mask=mask, other=-float("inf"))
    v = v.to(kl.float32)
    e = kl.fast_exp(v - kl.max(v, axis=1)[:, None])
    inv = 1.0 / kl.sum(e, axis=1)
    kl.store(out, (rows[:, None], cols[None, :]), e * inv[:, None], mask=mask)


def softmax(x: torch.Tensor, rows_per_program: int = 1) -> torch.Tensor:
    """Softmax over the last dim of a 2-D float32 or bfloat16 x, same shape and
    dtype as x. One row per program by default: its tiles then stay in a
    32 KiB L1 data cache for rows up to 2048 columns (docs/kernels.md, step 7
    of the tutorial). Raises TypeError or ValueError naming the argument for
    anything else."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"kl softmax: x must be a 2-D tensor (rows, columns), got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"kl softmax: x must be float32 or bfloat16, got {x.dtype}")
    if (not isinstance(rows_per_program, int) or isinstance(rows_per_program, bool) or
            rows_per_program < 1):
        raise ValueError(f"kl softmax: rows_per_program must be a positive int, got "
                         f"{rows_per_program!r}")
    rows, cols = x.shape
    out = torch.empty_like(x)
    block = 1 << max(0, (cols - 1).bit_length())
    softmax_kernel[(kl.cdiv(rows, rows_per_program),)](out, x, rows, cols,
                                                      ROWS=rows_per_program, BLOCK=block)
    return out


def composite(x: torch.Tensor) -> torch.Tensor:
    """The eager composite this kernel replaces (what a user writes by hand)."""
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)
