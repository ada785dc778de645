"""A row softmax kernel for kiln in C++ (the part-1 kernel interface): out =
softmax(x, dim=-1) of a (rows, columns) float32 x, as torch.softmax(x, -1).
The hand-written C++ counterpart of the kl kernel in kl_softmax.py, so that
``bench/run.py --groups kernels`` can set the tile language next to C++ on
the same algorithm. Registered as ``kilnex::softmax`` (kiln kernel, CPU:
torch.softmax, fake); forward only: a backward through it raises PyTorch's
error for a custom op without autograd.

Per row, one program: the row maximum, then exp(x - max) stored and summed,
then a multiply by the reciprocal of the sum, in at::vec::Vectorized<float>
with ATen's exp_u20 (the exp PyTorch's CPU flash attention uses; within
about 20 ULP, "u20"), so values agree with torch.softmax to float32
rounding plus that exp's error, not bit for bit. Outputs of
kiln::kStreamingBytes or more take streaming stores, as the kl kernel's.
"""

from __future__ import annotations

import torch

import torch_kiln.kernels as kernels

SOURCE = r"""
#include <algorithm>
#include <cstdint>
#include <limits>
#include <ATen/cpu/vec/vec.h>
#include <kiln/kernel.h>

namespace {
using Vec = at::vec::Vectorized<float>;
}  // namespace

// out[r, :] = exp(x[r, :] - max) / sum(exp(x[r, :] - max)); out and x are
// contiguous (rows, cols).
KILN_KERNEL(softmax_forward) {
  auto out = ctx.tensor<float, 2>(0);
  auto x = ctx.tensor<const float, 2>(1);
  const int64_t rows = x.size(0), cols = x.size(1);
  // is_contiguous, as PyTorch's, ignores the strides of size-1 dims
  KILN_KERNEL_CHECK(x.is_contiguous() && out.is_contiguous(),
                    "softmax_forward needs contiguous tensors");
  const bool streaming = rows * cols * int64_t(sizeof(float)) >= kiln::kStreamingBytes;
  ctx.parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = &x(r, 0);
      float* yr = &out(r, 0);
      const int64_t whole = cols - cols % Vec::size();
      Vec vmax(-std::numeric_limits<float>::infinity());
      for (int64_t c = 0; c < whole; c += Vec::size()) vmax = at::vec::maximum(vmax, Vec::loadu(xr + c));
      float lanes[Vec::size()];
      vmax.store(lanes);
      float max = -std::numeric_limits<float>::infinity();
      for (int l = 0; l < Vec::size(); ++l) max = std::max(max, lanes[l]);
      for (int64_t c = whole; c < cols; ++c) max = std::max(max, xr[c]);
      // exp(x - max) into the output row, summed
      const Vec vm(max);
      Vec vsum(0.0f);
      for (int64_t c = 0; c < whole; c += Vec::size()) {
        const Vec e = (Vec::loadu(xr + c) - vm).exp_u20();
        e.store(yr + c);
        vsum = vsum + e;
      }
      vsum.store(lanes);
      float sum = 0.0f;
      for (int l = 0; l < Vec::size(); ++l) sum += lanes[l];
      if (whole < cols) {
        float tail[Vec::size()];
        (Vec::loadu(xr + whole, cols - whole) - vm).exp_u20().store(tail, cols - whole);
        for (int64_t c = whole; c < cols; ++c) { yr[c] = tail[c - whole]; sum += yr[c]; }
      }
      const Vec inv(1.0f / sum);
      int64_t c = 0;
      if (streaming && reinterpret_cast<uintptr_t>(yr) % sizeof(Vec) == 0) {
        for (; c < whole; c += Vec::size()) kiln::store_streaming(yr + c, Vec::loadu(yr + c) * inv);
      } else {
        for (; c < whole; c += Vec::size()) (Vec::loadu(yr + c) * inv).store(yr + c);
      }
      for (; c < cols; ++c) yr[c] *= 1.0f / sum;
    }
    kiln::fence_streaming();
  });
}
"""

SIGNATURES = ["softmax_forward(float32[*,*]! out, float32[*,*] x)"]

_library = None


def library() -> kernels.KernelLibrary:
    global _library
    if _library is None:
        _library = kernels.load_inline("softmax_ext", SOURCE, SIGNATURES)
    return _library


def _check(x: torch.Tensor) -> None:
    torch._check(x.dim() == 2, lambda: f"kilnex::softmax: x must be 2-D, got {x.dim()}-D")
    torch._check(x.dtype == torch.float32,
                 lambda: f"kilnex::softmax: x must be float32, got {x.dtype}")


def _softmax_cpu(x: torch.Tensor) -> torch.Tensor:
    _check(x)
    return torch.softmax(x, -1).contiguous()


def _softmax_fake(x: torch.Tensor) -> torch.Tensor:
    _check(x)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@kernels.custom_op("kilnex::softmax", mutates_args=(), cpu=_softmax_cpu, fake=_softmax_fake)
def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of a 2-D float32 x (rows, columns): a new
    contiguous tensor of x's shape. Raises RuntimeError for other ranks or
    dtypes."""
    _check(x)
    x = x.contiguous()
    out = torch.empty_like(x)
    library().softmax_forward(out, x)
    return out
