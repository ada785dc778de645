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
// Both kernels are compositions of kiln operators, so they also run on fake
// tensors (Dynamo's FakeTensorMode, symbolic shapes): they read only
// metadata, and sizes through their SymInt accessors (See Note [Kiln kernels
// under FakeTensorMode] in aten/FakeKernels.cc). AOTAutograd's traces do not
// reach the dropout override: there kiln takes CPU's Python decomposition
// (native_dropout), so compiled kiln gives compiled CPU's masks (Note
// [Tracing kiln's eager compositions] in
// torch_kiln/compiler/traced_compositions.py).
#include <ATen/ops/bernoulli.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

namespace at::kiln {
namespace {

// Bernoulli(p) noise in the layout at::empty_like(input) gives, drawn in
// memory order exactly as `at::empty_like(input).bernoulli_(p)` draws it
// (CPU's dropout), but into a 1-D buffer viewed with that layout. Under
// torch.compile the in-place form is functionalized into bernoulli.p, whose
// result is contiguous, so for a channels-last or transposed input it drew
// the same numbers in another order and compiled dropout masks differed from
// eager (found by a fresh user); a 1-D buffer has one order either way.
at::Tensor bernoulliNoiseLike(const at::Tensor& input, double p) {
  // empty_like's layout (dense, in the input's dimension order) on the meta
  // device: metadata only.
  const at::Tensor layout = at::empty_like(input, input.options().device(c10::kMeta));
  at::Tensor flat = at::empty_symint({input.sym_numel()}, input.options());
  flat.bernoulli_(p);
  return flat.as_strided_symint(layout.sym_sizes(), layout.sym_strides());
}

at::Tensor dropout(const at::Tensor& input, double p, bool train) {
  TORCH_CHECK(p >= 0 && p <= 1, "dropout probability has to be between 0 and 1, but got ", p);
  if (p == 0 || !train || input.sym_numel() == 0) {
    return input;
  }
  if (p == 1) {
    return input.mul(at::zeros({}, input.options()));
  }
  at::Tensor noise = bernoulliNoiseLike(input, 1 - p);
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
  at::Tensor mask = bernoulliNoiseLike(input, p1m);
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
