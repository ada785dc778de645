// scaled_dot_product_attention on kiln picks the same kernel as on CPU.
//
// SDPA asks a per-device dispatch stub (_fused_sdp_choice_stub) which fused
// kernel to use; a device with no entry gets the unfused "math" composition,
// whose rounding differs from CPU's fused flash-attention kernel. Kiln's entry
// asks CPU's own selection logic, which reads only metadata (dtypes, shapes,
// strides, dropout, mask), so for the same inputs kiln runs
// _scaled_dot_product_flash_attention_for_cpu (and its backward) through the
// op executor exactly when CPU does, giving CPU's numbers.
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice_ops.h>

#include "aten/TensorAliases.h"

namespace at::kiln {

int64_t fusedSdpChoice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const std::optional<at::Tensor>& attn_mask, double dropout_p,
                       bool is_causal, std::optional<double> scale, bool enable_gqa) {
  // Host aliases carry the metadata, including requires_grad (CPU picks the
  // math kernel for a mask that needs a gradient); the selection never reads
  // the data.
  TensorAliaser aliaser(c10::kCPU);
  auto hostAlias = [&](const at::Tensor& t) {
    at::Tensor alias = aliaser.alias(t);
    if (t.requires_grad()) {
      alias.set_requires_grad(true);
    }
    return alias;
  };
  std::optional<at::Tensor> mask;
  if (attn_mask.has_value() && attn_mask->defined()) {
    mask = hostAlias(*attn_mask);
  }
  return at::_ops::_fused_sdp_choice::redispatch(
      c10::DispatchKeySet(c10::DispatchKey::CPU), hostAlias(query), hostAlias(key),
      hostAlias(value), mask, dropout_p, is_causal, scale, enable_gqa);
}

} // namespace at::kiln

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &at::kiln::fusedSdpChoice)
} // namespace at::native
