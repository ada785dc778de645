// scaled_dot_product_attention on kiln picks the same kernel as on CPU.
//
// SDPA asks a per-device dispatch stub (_fused_sdp_choice_stub) which fused
// kernel to use; a device with no entry gets the unfused "math" composition,
// whose rounding differs from CPU's fused flash-attention kernel. Kiln's entry
// asks CPU's own selection logic, which reads only metadata (dtypes, shapes,
// strides, dropout, mask), so for the same inputs kiln runs
// _scaled_dot_product_flash_attention_for_cpu (and its backward) through the
// op executor exactly when CPU does, giving CPU's numbers.
//
// The stub is called from inside SDPA's CompositeImplicitAutograd kernel, so
// it also runs while torch.compile traces a kiln model: then its arguments
// are FakeTensors (whose data pointer must not be touched) that may have
// symbolic sizes (dynamic=True). The CPU selection therefore sees
// storage-less stand-ins that carry only the metadata it reads, with sizes
// and strides as SymInts; it never needs more, and the same code serves
// real, fake and symbolic tensors (see Note [Kiln kernels under
// FakeTensorMode] in aten/FakeKernels.cc).
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice_ops.h>
#include <c10/core/TensorImpl.h>

namespace at::kiln {
namespace {

// A CPU tensor with `t`'s dtype, sizes, strides, storage offset and
// requires_grad (CPU picks the math kernel for a mask that needs a gradient),
// and no storage: the selection reads metadata only.
at::Tensor cpuMetadataStandIn(const at::Tensor& t) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype(), c10::Device(c10::kCPU));
  impl->set_sizes_and_strides(t.sym_sizes(), t.sym_strides(), t.sym_storage_offset());
  at::Tensor standIn(std::move(impl));
  if (t.requires_grad()) {
    standIn.set_requires_grad(true);
  }
  return standIn;
}

int64_t fusedSdpChoice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const std::optional<at::Tensor>& attn_mask, double dropout_p,
                       bool is_causal, std::optional<double> scale, bool enable_gqa) {
  std::optional<at::Tensor> mask;
  if (attn_mask.has_value() && attn_mask->defined()) {
    mask = cpuMetadataStandIn(*attn_mask);
  }
  return at::_ops::_fused_sdp_choice::redispatch(
      c10::DispatchKeySet(c10::DispatchKey::CPU), cpuMetadataStandIn(query),
      cpuMetadataStandIn(key), cpuMetadataStandIn(value), mask, dropout_p, is_causal, scale,
      enable_gqa);
}

} // namespace
} // namespace at::kiln

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &at::kiln::fusedSdpChoice)
} // namespace at::native
