"""Causal attention in the kl tile language, flash-attention style (the
forward kernel here, the backward kernels in kl_attention_backward.py):
out = softmax(q @ k^T * scale + causal mask) @ v for q, k, v of shape
(batch * heads, seq, head_dim), float32, bfloat16 or float16, as
torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).

Each program takes BM queries of one (batch, head) and walks the key tiles
up to the diagonal (a kl.range loop with a runtime trip count) keeping a
running row maximum m, row sum l and output accumulator acc (online
softmax: when the maximum grows, l and acc are rescaled by exp(m_old -
m_new)), so the (seq, seq) score matrix never exists. The exps are
kl.fast_exp (ATen's exp_u20), as PyTorch's CPU flash attention
(aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) uses. It also writes each
row's logsumexp L = m + log(l) of the scaled scores (float32, (batch *
heads, seq)), which the backward kernels (kl_attention_backward.py,
FlashAttention-2's Algorithm 2) use to recompute the probabilities.

``causal_attention`` is differentiable: it calls the operator
``kilnex::kl_causal_attention`` (returns out and L), whose autograd formula
calls ``kilnex::kl_causal_attention_backward`` (the three backward kernels).
Both are ``kl.op``s (kiln's ``torch.library.triton_op``): each Python
function allocating outputs and launching kernels is one operator, and its
own fake implementation. Both run on kiln tensors (compiled kl kernels, tasks on the current stream)
and CPU tensors (the kl simulator), and are one graph node each under
torch.compile(fullgraph=True).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import torch_kiln.kl as kl
from torch_kiln.kl import tile_model

from . import kl_attention_backward


@kl.jit
def attention_kernel(out, lse, q, k, v, seq, scale, BM: kl.constexpr, BN: kl.constexpr,
                     D: kl.constexpr):
    start = kl.program_id(0) * BM
    bh = kl.program_id(1)
    rm = start + kl.arange(0, BM)
    rd = kl.arange(0, D)
    qt = kl.load(q, (bh, rm[:, None], rd[None, :]), mask=rm[:, None] < seq, other=0.0)
    qt = qt.to(kl.float32) * scale
    m_i = kl.full((BM,), -float("inf"), kl.float32)
    l_i = kl.zeros((BM,), kl.float32)
    acc = kl.zeros((BM, D), kl.float32)
    end = kl.minimum(seq, start + BM)
    for n0 in kl.range(0, end, BN):
        rn = n0 + kl.arange(0, BN)
        kt = kl.load(k, (bh, rn[:, None], rd[None, :]), mask=rn[:, None] < seq, other=0.0)
        s = kl.matmul(qt, kl.transpose(kt.to(kl.float32)))  # (BM, BN)
        s = kl.where((rm[:, None] >= rn[None, :]) & (rn[None, :] < seq), s, -float("inf"))
        m_new = kl.maximum(m_i, kl.max(s, axis=1))
        p = kl.fast_exp(s - m_new[:, None])
        alpha = kl.fast_exp(m_i - m_new)
        l_i = l_i * alpha + kl.sum(p, axis=1)
        vt = kl.load(v, (bh, rn[:, None], rd[None, :]), mask=rn[:, None] < seq, other=0.0)
        acc = acc * alpha[:, None] + kl.matmul(p, vt.to(kl.float32))
        m_i = m_new
    kl.store(out, (bh, rm[:, None], rd[None, :]), acc / l_i[:, None], mask=rm[:, None] < seq)
    # The row logsumexp of the scaled scores, for the backward (FlashAttention-2's L)
    kl.store(lse, (bh, rm), m_i + kl.log(l_i), mask=rm < seq)


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(q, k, v, block) -> None:
    where = "kl causal_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a tensor, got {type(t).__name__}")
    if q.dim() not in (3, 4):
        raise ValueError(f"{where}: q must be (batch, heads, seq, head_dim) or (batch * heads, "
                         f"seq, head_dim), got shape {tuple(q.shape)}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"{where}: q, k and v must have the same shape, got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{where}: q, k and v must have one dtype of float32, bfloat16 or "
                        f"float16, got {q.dtype}, {k.dtype}, {v.dtype}")
    head_dim = q.shape[-1]
    if not 1 <= head_dim <= tile_model.MAX_PARTITION_DIM:
        raise ValueError(f"{where}: head_dim is {head_dim}; the kl kernels allow 1 to "
                         f"{tile_model.MAX_PARTITION_DIM} (k and v are loaded transposed, as "
                         f"(head_dim, block) tiles, and the tile model's partition dim is at "
                         f"most {tile_model.MAX_PARTITION_DIM})")
    if (not isinstance(block, (tuple, list)) or len(block) != 2 or
            not all(isinstance(b, int) and not isinstance(b, bool) and
                    1 <= b <= tile_model.MAX_PARTITION_DIM for b in block)):
        raise ValueError(f"{where}: block must be two ints (queries, keys) in 1 to "
                         f"{tile_model.MAX_PARTITION_DIM}, got {block!r}")


@kl.op("kilnex::kl_causal_attention", mutates_args=())
def causal_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int,
                             block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel on q, k, v of shape (batch * heads, seq, head_dim):
    (out, same shape and dtype as q; lse, float32 (batch * heads, seq))."""
    bh, seq, d = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    attention_kernel[(kl.cdiv(seq, block_m), bh)](out, lse, q, k, v, seq, 1.0 / math.sqrt(d),
                                                  BM=block_m, BN=block_n, D=d)
    return out, lse


@kl.op("kilnex::kl_causal_attention_backward", mutates_args=())
def causal_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, block_m: int,
                              block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_q, grad_k, grad_v) of causal attention, shapes and dtypes of q,
    k, v, from the forward's out and lse: the backward kernels of
    kl_attention_backward.py (delta, then dK/dV per key block, then dQ per
    query block), in stream order."""
    bwd = kl_attention_backward
    bh, seq, d = q.shape
    scale = 1.0 / math.sqrt(d)
    grad_q, grad_k, grad_v = (torch.empty(t.shape, dtype=t.dtype, device=t.device)
                              for t in (q, k, v))
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    bwd.attention_backward_delta_kernel[(kl.cdiv(seq, block_m), bh)](
        delta, out, grad_out, seq, BM=block_m, D=d)
    bwd.attention_backward_dkdv_kernel[(kl.cdiv(seq, block_n), bh)](
        grad_k, grad_v, q, k, v, grad_out, lse, delta, seq, scale, BM=block_m, BN=block_n, D=d)
    bwd.attention_backward_dq_kernel[(kl.cdiv(seq, block_m), bh)](
        grad_q, q, k, v, grad_out, lse, delta, seq, scale, BM=block_m, BN=block_n, D=d)
    return grad_q, grad_k, grad_v


def _setup_context(ctx, inputs, output):
    q, k, v, block_m, block_n = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.block = (block_m, block_n)
    ctx.mark_non_differentiable(lse)


def _autograd_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    grad_q, grad_k, grad_v = causal_attention_backward(grad_out, q, k, v, out, lse, *ctx.block)
    return grad_q, grad_k, grad_v, None, None


causal_attention_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def causal_attention(q, k, v, block=(64, 64)):
    """Causal attention, as F.scaled_dot_product_attention(q, k, v,
    is_causal=True), differentiable in q, k and v.

    q, k, v: (batch, heads, seq, head_dim) or (batch * heads, seq, head_dim),
    one shape, one dtype of float32, bfloat16, float16 (math in float32),
    head_dim 1 to 128; kiln tensors (compiled kernels) or CPU tensors (the
    simulator). block: (queries, keys) per tile, each 1 to 128. Returns the
    output, q's shape and dtype. Raises TypeError for non-tensors or other
    dtypes, ValueError for other shapes, head_dims or blocks."""
    _check(q, k, v, block)
    shape = q.shape
    q3, k3, v3 = (t.flatten(0, -3) for t in (q, k, v))  # (batch * heads, seq, head_dim)
    out, _ = causal_attention_forward(q3, k3, v3, block[0], block[1])
    return out.reshape(shape)


def reference(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
