"""Causal attention forward in the kl tile language, flash-attention style:
out = softmax(q @ k^T * scale + causal mask) @ v for q, k, v of shape
(batch * heads, seq, head_dim), float32 or bfloat16, as
torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).

Each program takes BM queries of one (batch, head) and walks the key tiles
up to the diagonal (a kl.range loop with a runtime trip count) keeping a
running row maximum m, row sum l and output accumulator acc (online
softmax: when the maximum grows, l and acc are rescaled by exp(m_old -
m_new)), so the (seq, seq) score matrix never exists. The exps are
kl.fast_exp (ATen's exp_u20), as PyTorch's CPU flash attention
(aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) uses. Forward only: no
backward kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import torch_kiln.kl as kl


@kl.jit
def attention_kernel(out, q, k, v, seq, scale, BM: kl.constexpr, BN: kl.constexpr,
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


def causal_attention(q, k, v, block=(64, 64)):
    """Causal attention of q, k, v (batch, heads, seq, head_dim) or
    (batch * heads, seq, head_dim); same shape and dtype out."""
    shape = q.shape
    q3, k3, v3 = (t.reshape(-1, shape[-2], shape[-1]) for t in (q, k, v))
    bh, seq, d = q3.shape
    bm, bn = block
    out = torch.empty_like(q3)
    attention_kernel[(math.ceil(seq / bm), bh)](out, q3, k3, v3, seq, 1.0 / math.sqrt(d),
                                                BM=bm, BN=bn, D=d)
    return out.reshape(shape)


def reference(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
