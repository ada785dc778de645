// torch.autocast(device_type="kiln"): the cast policies of CUDA's autocast,
// registered for the AutocastPrivateUse1 dispatch key.
//
// PyTorch exports its op lists by policy (ATen/autocast_mode.h), the same
// lists CUDA registers: matmul/linear/conv/bmm/baddbmm/addmm/SDPA ...
// run in the autocast dtype ("lower_precision_fp"); softmax, log_softmax,
// layer_norm, losses, norms, exp/log/pow ... run in float32 ("fp32", some of
// them by passing dtype=float32); cat, stack, index_put, addcmul ... run in
// the widest input type ("promote"). Every other op falls through.
// binary_cross_entropy is banned under autocast, as on CUDA (use
// binary_cross_entropy_with_logits).
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace at::kiln {
namespace {

at::Tensor binaryCrossEntropyBanned(const at::Tensor&, const at::Tensor&,
                                    const std::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(
      false,
      "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
      "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
      "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
      "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
      "safe to autocast.");
}

#define KILN_KERNEL_LOW_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define KILN_KERNEL_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define KILN_KERNEL_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define KILN_KERNEL_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  AT_FORALL_LOWER_PRECISION_FP(KILN_KERNEL_LOW_PRECISION_FP)
  AT_FORALL_FP32(KILN_KERNEL_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(KILN_KERNEL_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(KILN_KERNEL_PROMOTE)
  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"),
         TORCH_FN(binaryCrossEntropyBanned));
}

} // namespace
} // namespace at::kiln
