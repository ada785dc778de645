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


def matmul_bias_act(a, b, bias, activation: int = NONE, block=(32, 64, 32)):
    """act(a @ b + bias), out in a's dtype."""
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
