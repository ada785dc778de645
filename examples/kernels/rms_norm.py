"""A fused RMSNorm kernel for kiln: y = x / sqrt(mean(x**2, -1) + eps) * weight
over the last dimension of a (rows, features) float32 input, as
torch.nn.functional.rms_norm(x, (features,), weight, eps). Forward is one pass
per row (the eager composite takes a pow, a mean, an add, an rsqrt and two
muls); backward one pass for the input gradient and one for the weight's.
Registered as ``kilnex::rms_norm`` with CPU (PyTorch's composite) and fake
implementations and autograd.

Numbers: per-row sums in float32, SIMD lanes then a horizontal add, so the
results agree with PyTorch's (which reduces in another order) to float32
rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import torch_kiln.kernels as kernels

SOURCE = r"""
#include <cmath>
#include <ATen/cpu/vec/vec.h>
#include <kiln/kernel.h>

namespace {
using Vec = at::vec::Vectorized<float>;

// sum of f(i) over a contiguous row of length n: SIMD lanes, then the lanes.
template <typename LoadF>
float row_sum(int64_t n, LoadF load) {
  Vec acc(0.0f);
  int64_t c = 0;
  for (; c + Vec::size() <= n; c += Vec::size()) acc = acc + load(c);
  float lanes[Vec::size()];
  acc.store(lanes);
  float sum = 0.0f;
  for (int i = 0; i < Vec::size(); ++i) sum += lanes[i];
  return sum;
}
} // namespace

// y[r, :] = x[r, :] * rstd[r] * weight; rstd[r] = 1 / sqrt(mean(x[r, :]^2) + eps)
KILN_KERNEL(rms_norm_forward) {
  auto y = ctx.tensor<float, 2>(0);
  auto rstd = ctx.tensor<float, 1>(1);
  auto x = ctx.tensor<const float, 2>(2);
  auto weight = ctx.tensor<const float, 1>(3);
  const float eps = static_cast<float>(ctx.scalar(4));
  const int64_t cols = x.size(1);
  KILN_KERNEL_CHECK(weight.size(0) == cols, "weight has ", weight.size(0), " features, x has ", cols);
  // is_contiguous, as PyTorch's, ignores the strides of size-1 dims
  KILN_KERNEL_CHECK(x.is_contiguous() && y.is_contiguous() && weight.is_contiguous(),
                    "rms_norm_forward needs contiguous tensors");
  ctx.parallel_for(0, x.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = &x(r, 0);
      float* yr = &y(r, 0);
      float sum = row_sum(cols, [&](int64_t c) { const Vec v = Vec::loadu(xr + c); return v * v; });
      int64_t c = cols - cols % Vec::size();
      for (; c < cols; ++c) sum += xr[c] * xr[c];
      const float inv = 1.0f / std::sqrt(sum / float(cols) + eps);
      rstd(r) = inv;
      const Vec vinv(inv);
      c = 0;
      for (; c + Vec::size() <= cols; c += Vec::size()) {
        (Vec::loadu(xr + c) * vinv * Vec::loadu(weight.data() + c)).store(yr + c);
      }
      for (; c < cols; ++c) yr[c] = xr[c] * inv * weight(c);
    }
  });
}

// With g = grad_y * weight:
//   grad_x[r, :] = rstd * (g - x * rstd^2 * mean(g * x))
//   grad_weight[:] = sum over r of grad_y[r, :] * x[r, :] * rstd[r]   (rows in order)
KILN_KERNEL(rms_norm_backward) {
  auto grad_x = ctx.tensor<float, 2>(0);
  auto grad_weight = ctx.tensor<float, 1>(1);
  auto grad_y = ctx.tensor<const float, 2>(2);
  auto x = ctx.tensor<const float, 2>(3);
  auto weight = ctx.tensor<const float, 1>(4);
  auto rstd = ctx.tensor<const float, 1>(5);
  const int64_t rows = x.size(0), cols = x.size(1);
  KILN_KERNEL_CHECK(x.is_contiguous() && grad_y.is_contiguous() && grad_x.is_contiguous(),
                    "rms_norm_backward needs contiguous tensors");
  const float* w = weight.data();
  ctx.parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = &x(r, 0);
      const float* gr = &grad_y(r, 0);
      float* out = &grad_x(r, 0);
      float dot = row_sum(cols, [&](int64_t c) {
        return Vec::loadu(gr + c) * Vec::loadu(w + c) * Vec::loadu(xr + c);
      });
      int64_t c = cols - cols % Vec::size();
      for (; c < cols; ++c) dot += gr[c] * w[c] * xr[c];
      const float inv = rstd(r);
      const float scale = inv * inv * dot / float(cols);
      const Vec vinv(inv), vscale(scale);
      c = 0;
      for (; c + Vec::size() <= cols; c += Vec::size()) {
        const Vec g = Vec::loadu(gr + c) * Vec::loadu(w + c);
        (vinv * (g - Vec::loadu(xr + c) * vscale)).store(out + c);
      }
      for (; c < cols; ++c) out[c] = inv * (gr[c] * w[c] - xr[c] * scale);
    }
  });
  ctx.parallel_for(0, cols, 64, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      float sum = 0.0f;
      for (int64_t r = 0; r < rows; ++r) sum += grad_y(r, c) * x(r, c) * rstd(r);
      grad_weight(c) = sum;
    }
  });
}
"""

SIGNATURES = [
    "rms_norm_forward(float32[*,*]! y, float32[*]! rstd, float32[*,*] x, float32[*] weight, "
    "float eps)",
    "rms_norm_backward(float32[*,*]! grad_x, float32[*]! grad_weight, float32[*,*] grad_y, "
    "float32[*,*] x, float32[*] weight, float32[*] rstd)",
]

_library = None


def library() -> kernels.KernelLibrary:
    global _library
    if _library is None:
        _library = kernels.load_inline("rms_norm_ext", SOURCE, SIGNATURES)
    return _library


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """PyTorch's RMSNorm: the CPU implementation and the tests' reference."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _check(x, weight):
    torch._check(x.dim() == 2, lambda: f"kilnex::rms_norm: x must be 2-D, got {x.dim()}-D")
    torch._check(weight.dim() == 1 and weight.shape[0] == x.shape[1],
                 lambda: f"kilnex::rms_norm: weight must have shape ({x.shape[1]},), got "
                         f"{tuple(weight.shape)}")


@torch.library.custom_op("kilnex::rms_norm_forward", mutates_args=(), device_types="kiln")
def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, weight)
    x = x.contiguous()
    y = torch.empty_like(x)
    rstd = x.new_empty(x.shape[0])
    library().rms_norm_forward(y, rstd, x, weight.contiguous(), eps)
    return y, rstd


@_forward.register_kernel("cpu")
def _forward_cpu(x, weight, eps):
    _check(x, weight)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + eps)
    return reference(x, weight, eps).contiguous(), rstd


@_forward.register_fake
def _forward_fake(x, weight, eps):
    _check(x, weight)
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape[0])


@torch.library.custom_op("kilnex::rms_norm_backward", mutates_args=(), device_types="kiln")
def _backward_op(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    grad_weight = torch.empty_like(weight)
    library().rms_norm_backward(grad_x, grad_weight, grad_y.contiguous(), x.contiguous(),
                                weight.contiguous(), rstd)
    return grad_x, grad_weight


@_backward_op.register_kernel("cpu")
def _backward_cpu(grad_y, x, weight, rstd):
    r = rstd.unsqueeze(1)
    g = grad_y * weight
    grad_x = r * (g - x * r * r * (g * x).mean(-1, keepdim=True))
    return grad_x.contiguous(), (grad_y * x * r).sum(0)


@_backward_op.register_fake
def _backward_fake(grad_y, x, weight, rstd):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


@kernels.custom_op("kilnex::rms_norm", mutates_args=(),
                   cpu=lambda x, weight, eps: _forward_cpu(x, weight, eps)[0],
                   fake=lambda x, weight, eps: _forward_fake(x, weight, eps)[0])
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (rows, features) over features, scaled by weight."""
    return _forward(x, weight, eps)[0]


def _setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    # rstd is recomputed by the forward op: cheap (one pass) next to saving
    # a second output through a custom op's autograd.
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx, grad_y):
    x, weight = ctx.saved_tensors
    _, rstd = _forward(x, weight, ctx.eps)
    grad_x, grad_weight = _backward_op(grad_y, x, weight, rstd)
    return grad_x, grad_weight, None


rms_norm.register_autograd(_backward, setup_context=_setup_context)


class RMSNorm(torch.nn.Module):
    """torch.nn.RMSNorm over the last dimension of 2-D inputs, fused."""

    def __init__(self, features: int, eps: float = 1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(features))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
