"""RMSNorm in the kl tile language: y = x / sqrt(mean(x**2, -1) + eps) * weight
over the last dim of a (rows, features) float32 or bfloat16 input, as
torch.nn.functional.rms_norm(x, (features,), weight, eps).

One program normalises ROWS rows (a (ROWS, BLOCK) tile, BLOCK >= features,
masked at the ragged edge); sums and products in float32, the result rounded
to x's dtype once at the store.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import torch_kiln.kl as kl


@kl.jit
def rms_norm_kernel(out, x, weight, n_rows, n_cols, eps, ROWS: kl.constexpr,
                    BLOCK: kl.constexpr):
    rows = kl.program_id(0) * ROWS + kl.arange(0, ROWS)
    cols = kl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    v = kl.load(x, (rows[:, None], cols[None, :]), mask=mask, other=0.0).to(kl.float32)
    rstd = kl.rsqrt(kl.sum(v * v, axis=1) / n_cols + eps)
    w = kl.load(weight, cols, mask=cols < n_cols, other=0.0).to(kl.float32)
    kl.store(out, (rows[:, None], cols[None, :]), v * rstd[:, None] * w[None, :], mask=mask)


def block_for(n_cols: int) -> int:
    """The smallest power of two >= n_cols (a tile's width)."""
    return 1 << max(0, (n_cols - 1).bit_length())


def _check(x, weight, rows_per_program) -> None:
    """F.rms_norm's checks, raised before any launch: a weight of the wrong
    length would otherwise be read past its end (an error only at
    synchronization) or partly ignored."""
    where = "kl rms_norm"
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a tensor, got {type(t).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{where}: x must be 2-D (rows, features), got shape "
                         f"{tuple(x.shape)}")
    if tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"{where}: weight must be (features,) = ({x.shape[1]},), got "
                         f"{tuple(weight.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != x.dtype:
        raise TypeError(f"{where}: x and weight must have one dtype of float32 or bfloat16, "
                        f"got {x.dtype} and {weight.dtype}")
    if (not isinstance(rows_per_program, int) or isinstance(rows_per_program, bool) or
            rows_per_program < 1):
        raise ValueError(f"{where}: rows_per_program must be a positive int, got "
                         f"{rows_per_program!r}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             rows_per_program: int = 1) -> torch.Tensor:
    """RMSNorm of a 2-D x (rows, features) with weight (features,), both
    float32 or both bfloat16; the result has x's shape and dtype. One row per
    program by default, as kl_softmax.softmax. Raises TypeError or ValueError
    naming the argument for anything else."""
    _check(x, weight, rows_per_program)
    rows, cols = x.shape
    out = torch.empty_like(x)
    rms_norm_kernel[(kl.cdiv(rows, rows_per_program),)](
        out, x, weight, rows, cols, eps, ROWS=rows_per_program, BLOCK=block_for(cols))
    return out


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
