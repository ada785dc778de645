"""Causal attention forward for kiln in C++ (the part-1 kernel interface):
out = softmax(q @ k^T / sqrt(head_dim) + causal mask) @ v for float32 q, k,
v of shape (batch * heads, seq, head_dim), as
torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).
The hand-written C++ counterpart of the kl kernel in kl_attention.py (same
algorithm, same blocks, same GEMM), so that ``bench/run.py --groups
kernels`` can set the tile language next to C++. Registered as
``kilnex::causal_attention`` (kiln kernel, CPU: SDPA, fake); forward only:
a backward through it raises PyTorch's error for a custom op without
autograd (kl_attention.causal_attention is the differentiable one).

Flash attention's forward (Dao et al., FlashAttention, 2022, Algorithm 1,
with the online softmax of Milakov and Gimelshein, 2018): one program per
(batch * head, block of BM queries) walks the key blocks of BN keys up to
the diagonal, keeping each row's running maximum m, sum l and output
accumulator; when m grows, l and the accumulator are rescaled by exp(m_old
- m_new). The products go to kiln::gemm_f32 (kiln/kernel.h: oneDNN's
batch-reduce GEMM through ATen, what PyTorch's CPU flash attention calls),
the exps to ATen's exp_u20. Values agree with SDPA to float32 rounding plus that
exp's error (about 20 ULP), not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import torch_kiln.kernels as kernels

SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#include <ATen/cpu/vec/vec.h>
#include <kiln/kernel.h>

namespace {
using Vec = at::vec::Vectorized<float>;

// dst (n x m, row-major) = the transpose of src (m rows of n, leading
// dimension ld): ATen's SIMD transposes on 16 x 16 blocks where AVX-512 is
// built, element copies elsewhere.
void transpose(const float* src, int64_t ld, int64_t m, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; i + 16 <= m; i += 16) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) at::vec::transpose_mxn<float>(src + i * ld + j, ld, dst + j * m + i, m, 16, 16);
    for (; j < n; ++j)
      for (int64_t r = i; r < i + 16; ++r) dst[j * m + r] = src[r * ld + j];
  }
#endif
  for (; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) dst[j * m + i] = src[i * ld + j];
}
}  // namespace

// out, q, k, v: contiguous (bh, seq, d). block_m, block_n: queries and keys
// per block.
KILN_KERNEL(causal_attention_forward) {
  auto out = ctx.tensor<float, 3>(0);
  auto q = ctx.tensor<const float, 3>(1);
  auto k = ctx.tensor<const float, 3>(2);
  auto v = ctx.tensor<const float, 3>(3);
  const int64_t bm = ctx.integer(4), bn = ctx.integer(5);
  const int64_t bh = q.size(0), seq = q.size(1), d = q.size(2);
  // is_contiguous, as PyTorch's, ignores the strides of size-1 dims (a
  // (bh, 1, d) tensor may have any stride(1))
  KILN_KERNEL_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() &&
                    out.is_contiguous(), "causal_attention_forward needs contiguous tensors");
  KILN_KERNEL_CHECK(bm >= 1 && bn >= 1, "block sizes must be positive, got ", bm, " and ", bn);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t query_blocks = (seq + bm - 1) / bm;
  ctx.parallel_for(0, bh * query_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(bm * d), kt(d * bn), s(bm * bn), acc(bm * d), m(bm), l(bm);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / query_blocks, start = task % query_blocks * bm;
      const int64_t rows = std::min(bm, seq - start);
      const float* qb = &q(b, start, 0);
      for (int64_t i = 0; i < rows * d; ++i) qs[i] = qb[i] * scale;
      std::fill(m.begin(), m.end(), -inf);
      std::fill(l.begin(), l.end(), 0.0f);
      std::fill(acc.begin(), acc.end(), 0.0f);
      const int64_t keys = start + rows;  // the last query sees keys [0, keys)
      for (int64_t n0 = 0; n0 < keys; n0 += bn) {
        const int64_t cols = std::min(bn, keys - n0);
        transpose(&k(b, n0, 0), d, cols, d, kt.data());  // (d, cols)
        kiln::gemm_f32(rows, cols, d, qs.data(), d, kt.data(), cols, s.data(), cols, false);
        for (int64_t i = 0; i < rows; ++i) {
          float* si = s.data() + i * cols;
          // keys n0 + j <= start + i are seen; at least key 0 in the first block
          const int64_t seen = std::clamp<int64_t>(start + i - n0 + 1, 0, cols);
          float row_max = -inf;
          for (int64_t j = 0; j < seen; ++j) row_max = std::max(row_max, si[j]);
          const float m_new = std::max(m[i], row_max);
          const Vec vm(m_new);
          Vec vsum(0.0f);
          int64_t j = 0;
          for (; j + Vec::size() <= seen; j += Vec::size()) {
            const Vec p = (Vec::loadu(si + j) - vm).exp_u20();
            p.store(si + j);
            vsum = vsum + p;
          }
          float sum = vsum.reduce_add();
          if (j < seen) {
            float tail[Vec::size()];
            (Vec::loadu(si + j, seen - j) - vm).exp_u20().store(tail, seen - j);
            for (int64_t t = j; t < seen; ++t) { si[t] = tail[t - j]; sum += si[t]; }
          }
          std::fill(si + seen, si + cols, 0.0f);  // masked keys: probability 0
          const float alpha = m[i] == -inf ? 0.0f : std::exp(m[i] - m_new);
          l[i] = l[i] * alpha + sum;
          m[i] = m_new;
          float* ai = acc.data() + i * d;
          for (int64_t c = 0; c < d; ++c) ai[c] *= alpha;
        }
        // acc += P (rows x cols) @ V block (cols x d)
        kiln::gemm_f32(rows, d, cols, s.data(), cols, &v(b, n0, 0), d, acc.data(), d, true);
      }
      for (int64_t i = 0; i < rows; ++i) {
        float* oi = &out(b, start + i, 0);
        const float inv = 1.0f / l[i];
        for (int64_t c = 0; c < d; ++c) oi[c] = acc[i * d + c] * inv;
      }
    }
    kiln::gemm_release();
  });
}
"""

SIGNATURES = ["causal_attention_forward(float32[*,*,*]! out, float32[*,*,*] q, float32[*,*,*] k, "
              "float32[*,*,*] v, int block_m, int block_n)"]

_library = None


def library() -> kernels.KernelLibrary:
    global _library
    if _library is None:
        _library = kernels.load_inline("causal_attention_ext", SOURCE, SIGNATURES)
    return _library


def _check(q, k, v, block_m, block_n) -> None:
    torch._check(q.dim() == 3 and k.shape == q.shape and v.shape == q.shape,
                 lambda: f"kilnex::causal_attention: q, k and v must have one shape (batch * "
                         f"heads, seq, head_dim), got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    torch._check(q.dtype == k.dtype == v.dtype == torch.float32,
                 lambda: f"kilnex::causal_attention: q, k and v must be float32, got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")
    torch._check(block_m >= 1 and block_n >= 1,
                 lambda: f"kilnex::causal_attention: blocks must be positive, got "
                         f"({block_m}, {block_n})")


def _attention_cpu(q, k, v, block_m=128, block_n=128):  # the op's defaults
    _check(q, k, v, block_m, block_n)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).contiguous()


def _attention_fake(q, k, v, block_m=128, block_n=128):
    _check(q, k, v, block_m, block_n)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@kernels.custom_op("kilnex::causal_attention", mutates_args=(), cpu=_attention_cpu,
                   fake=_attention_fake)
def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int = 128,
                     block_n: int = 128) -> torch.Tensor:
    """Causal attention of float32 q, k, v (batch * heads, seq, head_dim),
    blocks of block_m queries and block_n keys: a new contiguous tensor of
    q's shape. Raises RuntimeError for other shapes, dtypes or blocks."""
    _check(q, k, v, block_m, block_n)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    library().causal_attention_forward(out, q.contiguous(), k.contiguous(), v.contiguous(),
                                       block_m, block_n)
    return out
