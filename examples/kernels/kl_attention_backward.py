"""Causal attention backward in the kl tile language: FlashAttention-2's
backward pass (Tri Dao, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning", 2023, arXiv:2307.08691, Algorithm 2),
split, as the paper's section 3.2 and Triton's fused-attention tutorial do,
into three kernels so that no two programs write the same element (no
atomics):

1. ``attention_backward_delta_kernel``: D = rowsum(dO * O), float32
   (batch * heads, seq); one program per BM query rows.
2. ``attention_backward_dkdv_kernel``: one program per BN keys holds K_j,
   V_j and accumulators dK_j, dV_j, and walks the query blocks from the
   diagonal on (causal: query i sees key j only if i >= j), recomputing
   P = exp(S - L) from the forward's row logsumexp L:

       S = (Q_i * scale) K_j^T      P = exp(S - L_i)  (0 where masked)
       dV_j += P^T dO_i             dP = dO_i V_j^T
       dS = P * (dP - D_i)          dK_j += dS^T (Q_i * scale)

3. ``attention_backward_dq_kernel``: one program per BM queries walks the
   key blocks up to the diagonal: dQ_i += dS K_j, times scale at the end.

Shapes: q, k, v, out, grad_out (batch * heads, seq, head_dim), float32,
bfloat16 or float16 (all tile math in float32; results rounded once to the
gradient's dtype at the store); lse and delta float32 (batch * heads, seq).
Ragged seq: rows and keys past seq are masked off (loaded as 0, P = 0, not
stored). The exps are kl.fast_exp, as in the forward, so P is recomputed
with the function that made L. head_dim is a kl.constexpr D: K_j^T and V_j^T
are (D, BN) tiles (kl.transpose), so D is at most the tile model's partition
limit (128).
``examples/kernels/kl_attention.py`` launches them (``causal_attention``'s
autograd).
"""

from __future__ import annotations

import torch_kiln.kl as kl


@kl.jit
def attention_backward_delta_kernel(delta, out, grad_out, seq, BM: kl.constexpr,
                                    D: kl.constexpr):
    rm = kl.program_id(0) * BM + kl.arange(0, BM)
    bh = kl.program_id(1)
    rd = kl.arange(0, D)
    rows = rm[:, None] < seq
    o = kl.load(out, (bh, rm[:, None], rd[None, :]), mask=rows, other=0.0).to(kl.float32)
    do = kl.load(grad_out, (bh, rm[:, None], rd[None, :]), mask=rows, other=0.0).to(kl.float32)
    kl.store(delta, (bh, rm), kl.sum(o * do, axis=1), mask=rm < seq)


@kl.jit
def attention_backward_dkdv_kernel(grad_k, grad_v, q, k, v, grad_out, lse, delta, seq, scale,
                                   BM: kl.constexpr, BN: kl.constexpr, D: kl.constexpr):
    start_n = kl.program_id(0) * BN
    bh = kl.program_id(1)
    rn = start_n + kl.arange(0, BN)
    rd = kl.arange(0, D)
    keys = rn[:, None] < seq
    kj = kl.load(k, (bh, rn[:, None], rd[None, :]), mask=keys, other=0.0).to(kl.float32)
    vj = kl.load(v, (bh, rn[:, None], rd[None, :]), mask=keys, other=0.0).to(kl.float32)
    dk = kl.zeros((BN, D), kl.float32)
    dv = kl.zeros((BN, D), kl.float32)
    # Query blocks from the diagonal on: queries before start_n see none of
    # these keys. The blocks start at start_n, not at multiples of BM.
    for m0 in kl.range(start_n, seq, BM):
        rm = m0 + kl.arange(0, BM)
        rows = rm[:, None] < seq
        qs = kl.load(q, (bh, rm[:, None], rd[None, :]), mask=rows,
                     other=0.0).to(kl.float32) * scale  # (BM, D)
        do = kl.load(grad_out, (bh, rm[:, None], rd[None, :]), mask=rows,
                     other=0.0).to(kl.float32)  # (BM, D)
        l_i = kl.load(lse, (bh, rm), mask=rm < seq, other=0.0)  # (BM,)
        d_i = kl.load(delta, (bh, rm), mask=rm < seq, other=0.0)  # (BM,)
        s = kl.matmul(qs, kl.transpose(kj))  # (BM, BN)
        valid = (rm[:, None] >= rn[None, :]) & rows  # causal, so keys < seq too
        p = kl.where(valid, kl.fast_exp(s - l_i[:, None]), 0.0)
        dv = dv + kl.matmul(kl.transpose(p), do)
        dp = kl.matmul(do, kl.transpose(vj))  # (BM, BN)
        ds = p * (dp - d_i[:, None])
        dk = dk + kl.matmul(kl.transpose(ds), qs)
    kl.store(grad_k, (bh, rn[:, None], rd[None, :]), dk, mask=keys)
    kl.store(grad_v, (bh, rn[:, None], rd[None, :]), dv, mask=keys)


@kl.jit
def attention_backward_dq_kernel(grad_q, q, k, v, grad_out, lse, delta, seq, scale,
                                 BM: kl.constexpr, BN: kl.constexpr, D: kl.constexpr):
    start_m = kl.program_id(0) * BM
    bh = kl.program_id(1)
    rm = start_m + kl.arange(0, BM)
    rd = kl.arange(0, D)
    rows = rm[:, None] < seq
    qs = kl.load(q, (bh, rm[:, None], rd[None, :]), mask=rows,
                 other=0.0).to(kl.float32) * scale  # (BM, D)
    do = kl.load(grad_out, (bh, rm[:, None], rd[None, :]), mask=rows,
                 other=0.0).to(kl.float32)  # (BM, D)
    l_i = kl.load(lse, (bh, rm), mask=rm < seq, other=0.0)
    d_i = kl.load(delta, (bh, rm), mask=rm < seq, other=0.0)
    dq = kl.zeros((BM, D), kl.float32)
    end = kl.minimum(seq, start_m + BM)  # key blocks up to the diagonal
    for n0 in kl.range(0, end, BN):
        rn = n0 + kl.arange(0, BN)
        keys = rn[:, None] < seq
        kj = kl.load(k, (bh, rn[:, None], rd[None, :]), mask=keys, other=0.0).to(kl.float32)
        vj = kl.load(v, (bh, rn[:, None], rd[None, :]), mask=keys, other=0.0).to(kl.float32)
        s = kl.matmul(qs, kl.transpose(kj))  # (BM, BN)
        valid = (rm[:, None] >= rn[None, :]) & rows  # causal, so keys < seq too
        p = kl.where(valid, kl.fast_exp(s - l_i[:, None]), 0.0)
        dp = kl.matmul(do, kl.transpose(vj))
        ds = p * (dp - d_i[:, None])
        dq = dq + kl.matmul(ds, kj)
    kl.store(grad_q, (bh, rm[:, None], rd[None, :]), dq * scale, mask=rows)
