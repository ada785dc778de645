"""A tiled matmul with bias and activation in the kl tile language:
out = act(a @ b + bias) for a (M, K), b (K, N), bias (N,), float32 or
bfloat16, as torch's act(torch.addmm(bias, a, b)).

The grid is (M / BM, N / BN) programs; each accumulates a (BM, BN) float32
tile over K in BK steps (a kl.range loop with a runtime trip count),
masked at ragged edges, then adds the bias and applies the activation
(ACTIVATION: 0 none, 1 relu, 2 gelu with the tanh approximation).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import torch_kiln.kl as kl

NONE, RELU, GELU_TANH = 0, 1, 2


@kl.jit
def matmul_bias_act_kernel(out, a, b, bias, M, N, K, BM: kl.constexpr, BN: kl.constexpr,
                           BK: kl.constexpr, ACTIVATION: kl.constexpr):
    rm = kl.program_id(0) * BM + kl.arange(0, BM)
    rn = kl.program_id(1) * BN + kl.arange(0, BN)
    acc = kl.zeros((BM, BN), kl.float32)
    for k0 in kl.range(0, K, BK):
        rk = k0 + kl.arange(0, BK)
        at = kl.load(a, (rm[:, None], rk[None, :]), mask=(rm[:, None] < M) & (rk[None, :] < K),
                     other=0.0)
        bt = kl.load(b, (rk[:, None], rn[None, :]), mask=(rk[:, None] < K) & (rn[None, :] < N),
                     other=0.0)
        acc = acc + kl.matmul(at, bt, acc_dtype=kl.float32)
    acc = acc + kl.load(bias, rn, mask=rn < N, other=0.0).to(kl.float32)[None, :]
    if ACTIVATION == RELU:
        acc = kl.maximum(acc, 0.0)
    if ACTIVATION == GELU_TANH:
        inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = 0.5 * acc * (1.0 + kl.tanh(inner))
    kl.store(out, (rm[:, None], rn[None, :]), acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


ACTIVATIONS = {NONE: "none", RELU: "relu", GELU_TANH: "gelu (tanh)"}
DTYPES = (torch.float32, torch.bfloat16)


def _check(a, b, bias, activation, block) -> None:
    """The checks torch.addmm makes, raised before any launch (a bad shape
    would otherwise read past a tensor and fail only at synchronization)."""
    where = "kl matmul_bias_act"
    for name, t in (("a", a), ("b", b), ("bias", bias)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a tensor, got {type(t).__name__}")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{where}: a and b must be 2-D, got a {tuple(a.shape)} and b "
                         f"{tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{where}: a (M, K) and b (K, N) must agree in K, got a "
                         f"{tuple(a.shape)} and b {tuple(b.shape)}")
    if tuple(bias.shape) != (b.shape[1],):
        raise ValueError(f"{where}: bias must be (N,) = ({b.shape[1]},), got "
                         f"{tuple(bias.shape)}")
    if a.dtype not in DTYPES or b.dtype != a.dtype or bias.dtype != a.dtype:
        raise TypeError(f"{where}: a, b and bias must have one dtype of float32 or bfloat16, "
                        f"got {a.dtype}, {b.dtype}, {bias.dtype}")
    if activation not in ACTIVATIONS or isinstance(activation, bool):
        raise ValueError(f"{where}: activation must be one of "
                         f"{', '.join(f'{k} ({v})' for k, v in ACTIVATIONS.items())}, "
                         f"got {activation!r}")
    if (not isinstance(block, (tuple, list)) or len(block) != 3 or
            not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in block)):
        raise ValueError(f"{where}: block must be three positive ints (BM, BN, BK), "
                         f"got {block!r}")


def matmul_bias_act(a, b, bias, activation: int = NONE, block=(32, 64, 32)):
    """act(a @ b + bias) for a (M, K), b (K, N), bias (N,) of one dtype
    (float32 or bfloat16); out (M, N) in that dtype. activation is NONE, RELU
    or GELU_TANH; block is (BM, BN, BK). Raises TypeError or ValueError naming
    the argument for anything else."""
    _check(a, b, bias, activation, block)
    M, K = a.shape
    N = b.shape[1]
    bm, bn, bk = block
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    matmul_bias_act_kernel[(math.ceil(M / bm), math.ceil(N / bn))](
        out, a, b, bias, M, N, K, BM=bm, BN=bn, BK=bk, ACTIVATION=activation)
    return out


def reference(a, b, bias, activation: int = NONE):
    y = torch.addmm(bias.float(), a.float(), b.float())
    if activation == RELU:
        y = torch.relu(y)
    elif activation == GELU_TANH:
        y = F.gelu(y, approximate="tanh")
    return y.to(a.dtype)
