"""A fused bias + GELU kernel for kiln: out = gelu(x + bias), exact (erf)
GELU as torch.nn.functional.gelu's default, over a (rows, features) input
and a (features,) bias, float32. Forward and backward are one pass each
(the eager composite takes an add, a gelu and, backward, a gelu_backward
and a sum). Registered as operator ``kilnex::bias_gelu`` with a CPU
implementation (PyTorch's composite), a fake implementation and autograd,
so it runs eagerly on kiln and CPU and as one node under torch.compile.

Numbers: the kernel computes GELU term for term as PyTorch's CPU kernel
does, with ATen's SIMD type (at::vec::Vectorized<float>) on contiguous rows
and std::erf / std::exp elsewhere; on AVX-512 the forward evaluates erf by
ATen's formula (Abramowitz and Stegun 7.1.26) without a division and with
its own exp (see erf in the source), the backward with ATen's erf and exp.
It agrees with the composite within about one float32 ulp, not bit for bit;
the bias gradient sums rows in order, where PyTorch's sum reduces
pairwise. Outputs of 8 MiB or more are written with streaming stores
(kStreamingBytes in the source); the values are the same either way.
Speed: ``python bench/run.py --groups kernels`` (docs/kernels.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import torch_kiln.kernels as kernels

SOURCE = r"""
#include <cmath>
#include <ATen/cpu/vec/vec.h>
#include <kiln/kernel.h>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {
using Vec = at::vec::Vectorized<float>;

// Outputs of kiln::kStreamingBytes (8 MiB) or more are written with
// kiln::store_streaming (kiln/kernel.h): on the 2-core machine, 4096x1024
// float32: 4.34 ms with streaming stores against 5.14 ms without, one A/B
// run under load.

// PyTorch's CPU GELU (aten/src/ATen/native/cpu/Activation.cpp, GeluKernelImpl
// and GeluBackwardKernelImpl, approximate='none'), term for term; the
// backward with ATen's SIMD erf and exp, the forward with the erf below on
// AVX-512. Measured to agree with x + bias followed by F.gelu within about
// one float32 ulp (1.4e-6 at most on values in [-20, 20], as ATen's own erf
// and exp do), not bit for bit.
constexpr float kAlpha = M_SQRT1_2;
constexpr float kBeta = M_2_SQRTPI * M_SQRT1_2 * 0.5;

#if defined(CPU_CAPABILITY_AVX512)
// e^y for y <= 0 (or NaN): y = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two
// parts, Cody and Waite), e^r by its Taylor series to r^6 (truncation below
// 1.2e-7 relative), times 2^n. y below -104 gives 0, as e^y rounds there.
inline __m512 exp_nonpositive(__m512 y) {
  y = _mm512_max_ps(y, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), y);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// erf(x) by Abramowitz and Stegun, Handbook of Mathematical Functions,
// 7.1.26 (|error| <= 1.5e-7): the formula ATen's Vectorized<float>::erf
// evaluates, but 1 / (1 + p|x|) from a reciprocal estimate refined by one
// Newton step (relative error about 2^-28, below float32's rounding) instead
// of a division, and e^(-x^2) from exp_nonpositive instead of Sleef's expf:
// the two costliest parts of the pass. Against ATen's erf, 91% of GELU's
// outputs are bit-identical and the others differ by at most 4.8e-7 (x in
// [-20, 20] and randn * 3, measured on this machine): 1 ulp of outputs near
// 4; in the negative tail, where 1 + erf(x) cancels, the difference is as
// small in absolute terms and large relative to the tiny outputs, like
// ATen's own error there. Elsewhere, ATen's erf.
inline Vec erf(Vec x) {
  const __m512 v = x;
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 abs_v = _mm512_abs_ps(v);
  const __m512 d = _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), abs_v, one);
  __m512 t = _mm512_rcp14_ps(d);
  t = _mm512_mul_ps(t, _mm512_fnmadd_ps(d, t, _mm512_set1_ps(2.0f)));
  __m512 r = _mm512_fmadd_ps(_mm512_set1_ps(1.061405429f), t, _mm512_set1_ps(-1.453152027f));
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(1.421413741f));
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(-0.284496736f));
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(0.254829592f));
  const __m512 e = exp_nonpositive(_mm512_mul_ps(_mm512_mul_ps(v, v), _mm512_set1_ps(-1.0f)));
  const __m512 y = _mm512_fnmadd_ps(_mm512_mul_ps(r, t), e, one); // 1 - r t e^(-x^2)
  return _mm512_or_ps(y, _mm512_and_ps(v, _mm512_set1_ps(-0.0f)));   // the sign of x
}
#else
inline Vec erf(Vec x) { return x.erf(); }
#endif
inline float gelu(float v) { return v * 0.5f * (1.0f + std::erf(v * kAlpha)); }
inline Vec gelu(Vec v) { return v * Vec(0.5f) * (Vec(1.0f) + erf(v * Vec(kAlpha))); }
inline float gelu_grad(float dy, float v) {
  const float cdf = 0.5f * (1.0f + std::erf(v * kAlpha));
  const float pdf = kBeta * std::exp(v * v * -0.5f);
  return dy * (cdf + v * pdf);
}
inline Vec gelu_grad(Vec dy, Vec v) {
  const Vec cdf = Vec(0.5f) * (Vec(1.0f) + (v * Vec(kAlpha)).erf());
  const Vec pdf = Vec(kBeta) * (v * v * Vec(-0.5f)).exp();
  return dy * (cdf + v * pdf);
}
} // namespace

// out[r, c] = gelu(x[r, c] + bias[c]). Rows are split over the device's
// intra-op threads; contiguous rows run Vec::size() columns at a time.
KILN_KERNEL(bias_gelu_forward) {
  auto out = ctx.tensor<float, 2>(0);
  auto x = ctx.tensor<const float, 2>(1);
  auto bias = ctx.tensor<const float, 1>(2);
  const int64_t cols = x.size(1);
  KILN_KERNEL_CHECK(bias.size(0) == cols, "bias has ", bias.size(0), " features, x has ", cols);
  const bool dense = out.stride(1) == 1 && x.stride(1) == 1 && bias.stride(0) == 1;
  const bool streaming =
      dense && x.size(0) * cols * static_cast<int64_t>(sizeof(float)) >= kiln::kStreamingBytes;
  ctx.parallel_for(0, x.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int64_t c = 0;
      if (dense) {
        const float* xr = &x(r, 0);
        float* yr = &out(r, 0);
        if (streaming && reinterpret_cast<uintptr_t>(yr) % sizeof(Vec) == 0) {
          for (; c + Vec::size() <= cols; c += Vec::size()) {
            kiln::store_streaming(yr + c, gelu(Vec::loadu(xr + c) + Vec::loadu(bias.data() + c)));
          }
        }
        for (; c + Vec::size() <= cols; c += Vec::size()) {
          gelu(Vec::loadu(xr + c) + Vec::loadu(bias.data() + c)).store(yr + c);
        }
      }
      for (; c < cols; ++c) out(r, c) = gelu(x(r, c) + bias(c));
    }
    if (streaming) {
      kiln::fence_streaming();
    }
  });
}

// grad_x[r, c] = grad[r, c] * gelu'(x[r, c] + bias[c]);
// grad_bias[c] = sum over r of grad_x[r, c], rows added in order.
KILN_KERNEL(bias_gelu_backward) {
  auto grad_x = ctx.tensor<float, 2>(0);
  auto grad_bias = ctx.tensor<float, 1>(1);
  auto grad = ctx.tensor<const float, 2>(2);
  auto x = ctx.tensor<const float, 2>(3);
  auto bias = ctx.tensor<const float, 1>(4);
  const int64_t rows = x.size(0), cols = x.size(1);
  const bool dense = grad_x.stride(1) == 1 && grad.stride(1) == 1 && x.stride(1) == 1 &&
      bias.stride(0) == 1;
  ctx.parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int64_t c = 0;
      if (dense) {
        const float* xr = &x(r, 0);
        const float* gr = &grad(r, 0);
        float* out = &grad_x(r, 0);
        for (; c + Vec::size() <= cols; c += Vec::size()) {
          const Vec v = Vec::loadu(xr + c) + Vec::loadu(bias.data() + c);
          gelu_grad(Vec::loadu(gr + c), v).store(out + c);
        }
      }
      for (; c < cols; ++c) grad_x(r, c) = gelu_grad(grad(r, c), x(r, c) + bias(c));
    }
  });
  ctx.parallel_for(0, cols, 64, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      float sum = 0.0f;
      for (int64_t r = 0; r < rows; ++r) sum += grad_x(r, c);
      grad_bias(c) = sum;
    }
  });
}
"""

SIGNATURES = [
    "bias_gelu_forward(float32[*,*]! out, float32[*,*] x, float32[*] bias)",
    "bias_gelu_backward(float32[*,*]! grad_x, float32[*]! grad_bias, float32[*,*] grad, "
    "float32[*,*] x, float32[*] bias)",
]

_library = None


def library() -> kernels.KernelLibrary:
    """The compiled kernels (built on first use, then from the cache)."""
    global _library
    if _library is None:
        _library = kernels.load_inline("bias_gelu_ext", SOURCE, SIGNATURES)
    return _library


def reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """PyTorch's composite: the CPU implementation and the tests' reference."""
    return F.gelu(x + bias)


def _check(x: torch.Tensor, bias: torch.Tensor) -> None:
    torch._check(x.dim() == 2, lambda: f"kilnex::bias_gelu: x must be 2-D, got {x.dim()}-D")
    torch._check(bias.dim() == 1 and bias.shape[0] == x.shape[1],
                 lambda: f"kilnex::bias_gelu: bias must have shape ({x.shape[1]},), got "
                         f"{tuple(bias.shape)}")


def _fake(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    _check(x, bias)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _cpu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    _check(x, bias)
    return reference(x, bias).contiguous()


@kernels.custom_op("kilnex::bias_gelu", mutates_args=(), cpu=_cpu, fake=_fake)
def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu(x + bias) for x of shape (rows, features), bias (features,)."""
    _check(x, bias)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    library().bias_gelu_forward(out, x, bias)
    return out


@torch.library.custom_op("kilnex::bias_gelu_backward", mutates_args=(), device_types="kiln")
def _bias_gelu_backward(grad: torch.Tensor, x: torch.Tensor,
                        bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    grad_bias = torch.empty_like(bias)
    library().bias_gelu_backward(grad_x, grad_bias, grad, x, bias)
    return grad_x, grad_bias


@_bias_gelu_backward.register_kernel("cpu")
def _bias_gelu_backward_cpu(grad, x, bias):
    grad_v = torch.ops.aten.gelu_backward(grad, x + bias)
    return grad_v.contiguous(), grad_v.sum(0)


@_bias_gelu_backward.register_fake
def _bias_gelu_backward_fake(grad, x, bias):
    return (torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(bias))


def _setup_context(ctx, inputs, output):
    x, bias = inputs
    ctx.save_for_backward(x, bias)


def _backward(ctx, grad):
    x, bias = ctx.saved_tensors
    grad_x, grad_bias = _bias_gelu_backward(grad.contiguous(), x, bias)
    return grad_x, grad_bias


bias_gelu.register_autograd(_backward, setup_context=_setup_context)


class BiasGelu(torch.nn.Module):
    """A linear layer without bias followed by the fused bias + GELU: what
    Linear + GELU computes, in two kernels instead of three."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = torch.nn.Linear(in_features, out_features, bias=False)
        self.bias = torch.nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bias_gelu(self.linear(x), self.bias)
