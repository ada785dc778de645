"""A fused AdamW step for kiln: one pass over a parameter, its gradient and
both moment buffers per step, where torch.optim.AdamW's single-tensor
implementation makes six (mul_, lerp_, mul_, addcmul_, sqrt/div/add_,
addcdiv_). The math is that implementation's (torch/optim/adamw.py via
adam.py, _single_tensor_adam with decoupled weight decay), term for term:

    param     *= 1 - lr * weight_decay
    exp_avg    = lerp(exp_avg, grad, 1 - beta1)
    exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
    denom      = sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps
    param     -= lr / (1 - beta1**step) * exp_avg / denom

Registered as ``kilnex::adamw_step_``, an operator that mutates param,
exp_avg and exp_avg_sq in place (``mutates_args``), with a CPU
implementation (the same formulas in PyTorch ops) and ``FusedAdamW``, an
optimizer using it. float32 parameters; results agree with AdamW(foreach=
False) to float32 rounding (the compiler contracts some products into fused
multiply-adds), not bit for bit.
"""

from __future__ import annotations

import math

import torch

import torch_kiln.kernels as kernels

SOURCE = r"""
#include <cmath>
#include <ATen/cpu/vec/vec.h>
#include <kiln/kernel.h>

namespace {
using Vec = at::vec::Vectorized<float>;
} // namespace

KILN_KERNEL(adamw_step) {
  auto param = ctx.tensor<float, 1>(0);
  auto grad = ctx.tensor<const float, 1>(1);
  auto exp_avg = ctx.tensor<float, 1>(2);
  auto exp_avg_sq = ctx.tensor<float, 1>(3);
  const float lr = float(ctx.scalar(4)), beta1 = float(ctx.scalar(5));
  const float beta2 = float(ctx.scalar(6)), eps = float(ctx.scalar(7));
  const float weight_decay = float(ctx.scalar(8));
  const double step = double(ctx.integer(9));
  const int64_t n = param.size(0);
  KILN_KERNEL_CHECK(grad.size(0) == n && exp_avg.size(0) == n && exp_avg_sq.size(0) == n,
                    "param, grad and the moments must have the same number of elements");
  KILN_KERNEL_CHECK(param.is_contiguous() && grad.is_contiguous() && exp_avg.is_contiguous() &&
                    exp_avg_sq.is_contiguous(), "adamw_step needs contiguous tensors");
  const float decay = 1.0f - lr * weight_decay;
  const float w = 1.0f - beta1;           // lerp weight (< 0.5: self + w * (end - self))
  const float one_minus_beta2 = 1.0f - beta2;
  const float step_size = float(lr / (1.0 - std::pow(double(beta1), step)));
  const float bias_correction2_sqrt = float(std::sqrt(1.0 - std::pow(double(beta2), step)));
  float* p = param.data();
  const float* g = grad.data();
  float* m = exp_avg.data();
  float* v = exp_avg_sq.data();
  ctx.parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + Vec::size() <= end; i += Vec::size()) {
      const Vec gi = Vec::loadu(g + i);
      const Vec pi = Vec::loadu(p + i) * Vec(decay);
      Vec mi = Vec::loadu(m + i);
      mi = mi + Vec(w) * (gi - mi);
      const Vec vi = Vec::loadu(v + i) * Vec(beta2) + gi * gi * Vec(one_minus_beta2);
      const Vec denom = vi.sqrt() / Vec(bias_correction2_sqrt) + Vec(eps);
      (pi - Vec(step_size) * (mi / denom)).store(p + i);
      mi.store(m + i);
      vi.store(v + i);
    }
    for (; i < end; ++i) {
      const float gi = g[i];
      const float pi = p[i] * decay;
      const float mi = m[i] + w * (gi - m[i]);
      const float vi = v[i] * beta2 + gi * gi * one_minus_beta2;
      const float denom = std::sqrt(vi) / bias_correction2_sqrt + eps;
      p[i] = pi - step_size * (mi / denom);
      m[i] = mi;
      v[i] = vi;
    }
  });
}
"""

SIGNATURES = [
    "adamw_step(float32[*]! param, float32[*] grad, float32[*]! exp_avg, float32[*]! exp_avg_sq, "
    "float lr, float beta1, float beta2, float eps, float weight_decay, int step)",
]

_library = None


def library() -> kernels.KernelLibrary:
    global _library
    if _library is None:
        _library = kernels.load_inline("adamw_ext", SOURCE, SIGNATURES)
    return _library


def _check(param, grad, exp_avg, exp_avg_sq):
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        torch._check(t.shape == param.shape,
                     lambda: f"kilnex::adamw_step_: {name} has shape {tuple(t.shape)}, param "
                             f"{tuple(param.shape)}")
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        torch._check(t.is_contiguous(),
                     lambda: f"kilnex::adamw_step_: {name} must be contiguous (it is updated "
                             "in place)")


def _cpu(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step):
    _check(param, grad, exp_avg, exp_avg_sq)
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))


@kernels.custom_op("kilnex::adamw_step_", mutates_args=("param", "exp_avg", "exp_avg_sq"),
                   cpu=_cpu, fake=lambda *args: None)
def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, step: int) -> None:
    """One AdamW step on `param` (float32, contiguous), in place."""
    _check(param, grad, exp_avg, exp_avg_sq)
    library().adamw_step(param.view(-1), grad.contiguous().view(-1), exp_avg.view(-1),
                         exp_avg_sq.view(-1), lr, beta1, beta2, eps, weight_decay, step)


class FusedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW (no amsgrad, no maximize) with the fused step."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p,
                                                           memory_format=torch.contiguous_format)
                state["step"] += 1
                adamw_step_(p, p.grad, state["exp_avg"], state["exp_avg_sq"], group["lr"],
                            beta1, beta2, group["eps"], group["weight_decay"], state["step"])
        return loss
