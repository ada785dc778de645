// Dropout on kiln computes exactly what it computes on CPU.
//
// For accelerators PyTorch routes nn.functional.dropout to the fused
// aten::native_dropout, whose CPU kernel draws from the global CPU generator
// (it has no generator argument) and whose backward multiplies by a rounded
// 1/(1-p). Kiln instead keeps CPU's own composition of dropout
// (noise = bernoulli(1-p) / (1-p); out = input * noise) by overriding
// aten::dropout at the autograd level, so forward and backward match CPU bit
// for bit and the mask comes from the kiln generator, which follows CPU's
// sequence (Note [Kiln random numbers]). aten::native_dropout, when called
// directly, is likewise composed from kiln ops, drawing from the kiln
// generator.
//
// Both kernels are compositions of kiln operators, so they also trace under
// torch.compile (FakeTensorMode, symbolic shapes): they read only metadata,
// and sizes through their SymInt accessors (See Note [Kiln kernels under
// FakeTensorMode] in aten/FakeKernels.cc).
#include <ATen/ops/bernoulli.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

namespace at::kiln {
namespace {

at::Tensor dropout(const at::Tensor& input, double p, bool train) {
  TORCH_CHECK(p >= 0 && p <= 1, "dropout probability has to be between 0 and 1, but got ", p);
  if (p == 0 || !train || input.sym_numel() == 0) {
    return input;
  }
  if (p == 1) {
    return input.mul(at::zeros({}, input.options()));
  }
  at::Tensor noise = at::empty_like(input);
  noise.bernoulli_(1 - p);
  noise.div_(1 - p);
  return input.mul(noise);
}

std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p,
                                                  std::optional<bool> train) {
  if (input.sym_numel() == 0) {
    return {input, at::empty_like(input, input.options().dtype(c10::kBool))};
  }
  if (train.has_value() && !*train) {
    return {input.clone(), at::ones_like(input, input.options().dtype(c10::kBool))};
  }
  const double p1m = 1. - p;
  const double scale = p1m == 0 ? 0. : 1. / p1m;
  at::Tensor mask = at::empty_like(input);
  mask.bernoulli_(p1m);
  at::Tensor output = input.mul(mask).mul_(scale);
  return {output, mask.to(c10::kBool)};
}

} // namespace

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("dropout", TORCH_FN(dropout));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("native_dropout", TORCH_FN(native_dropout));
}

} // namespace at::kiln
