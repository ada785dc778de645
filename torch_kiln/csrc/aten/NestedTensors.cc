// NestedTensors.cc — what kiln does with strided nested tensors.
//
// torch.nested tensors with layout=torch.jagged are ordinary tensor
// subclasses over dense kiln tensors and work on kiln like any other op.
// Strided nested tensors (layout=torch.strided, the default of
// torch.nested.nested_tensor) are a C++ TensorImpl whose kernels PyTorch
// writes per device (NestedTensorCPU, NestedTensorCUDA); kiln has none.
// `nested_tensor(..., device="kiln")` still makes one (PyTorch copies the
// CPU-built tensor's buffer, a plain kiln tensor), so kiln:
//   * moves them between devices and dtypes (_to_copy and the empty_like it
//     uses, with ATen's nested implementations), so `nt.cpu()` gives back
//     what the user had;
//   * raises NotImplementedError naming the op and both ways out (jagged
//     layout, or keeping the strided tensor on the CPU) for every other op
//     that reaches the NestedTensorPrivateUse1 key, instead of the
//     dispatcher's "Could not run ... with arguments from the
//     'NestedTensorkiln' backend". That includes linear and matmul: PyTorch
//     gives them nested kernels on NestedTensorCPU/CUDA only, so on kiln they
//     would reach their CompositeImplicitAutograd forms, which read sizes()
//     and fail with "Internal error: NestedTensorImpl doesn't support sizes".
//     (PyTorch's other such operators, chunk, narrow and two backward
//     formulas, reach an op that takes the fallback.)
//
// Note [nn.TransformerEncoder's nested fast path on kiln]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// PyTorch's nn.TransformerEncoder takes a "fast path" in eval mode without
// grad when given a src_key_padding_mask, on "cpu", "cuda" and the
// PrivateUse1 device alike: it packs the batch into a strided nested tensor
// (_nested_tensor_from_mask), runs each layer on it
// (_transformer_encoder_layer_fwd) and pads it back (to_padded_tensor). A
// user never asked for nested tensors there, so kiln runs exactly these ops
// by copying their arguments to the CPU, running CPU's kernels and copying
// the results back: CPU's numbers, with a host synchronization per op
// (counted as sync ops), instead of "NestedTensorImpl doesn't support sizes".
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_to_copy_native.h>
#include <ATen/ops/empty_like_native.h>
#include <torch/library.h>

#include "aten/OpTracking.h"

namespace at::kiln {
namespace {

// Runs `op` on CPU copies of its kiln tensor arguments and moves its tensor
// results back to the kiln device. See Note [nn.TransformerEncoder's nested
// fast path on kiln].
void runOnCpuAndMoveBack(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_arguments = schema.arguments().size();
  recordExecutedOp(schema.operator_name());
  recordSyncOp(schema.operator_name()); // before the copies below wait for the device
  std::optional<c10::Device> device;
  for (size_t i = stack->size() - num_arguments; i < stack->size(); ++i) {
    c10::IValue& value = (*stack)[i];
    if (value.isTensor() && value.toTensor().defined() && value.toTensor().is_privateuseone()) {
      device = value.toTensor().device();
      value = value.toTensor().cpu();
    }
  }
  TORCH_INTERNAL_ASSERT(device.has_value(), schema.name(), " reached kiln without a kiln tensor");
  {
    const at::AutoDispatchBelowADInplaceOrView below_autograd; // grad is off on the fast path
    op.callBoxed(stack);
  }
  const size_t num_returns = schema.returns().size();
  for (size_t i = stack->size() - num_returns; i < stack->size(); ++i) {
    c10::IValue& value = (*stack)[i];
    if (value.isTensor() && value.toTensor().defined()) {
      value = value.toTensor().to(*device);
    }
  }
}

void nestedFallback(const c10::OperatorHandle& op, torch::jit::Stack* /*stack*/) {
  const auto& schema = op.schema();
  const std::string name = schema.overload_name().empty()
      ? schema.name()
      : schema.name() + "." + schema.overload_name();
  TORCH_CHECK_NOT_IMPLEMENTED(
      false, "Kiln does not support strided nested tensors: ", name,
      " was called with a torch.nested tensor of layout torch.strided on a kiln device. Make "
      "nested tensors with layout=torch.jagged (torch.nested.nested_tensor(..., "
      "layout=torch.jagged) works on kiln), or keep strided ones on the CPU (nt.cpu() works).");
}

} // namespace

TORCH_LIBRARY_IMPL(_, NestedTensorPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&nestedFallback>());
}

TORCH_LIBRARY_IMPL(aten, NestedTensorPrivateUse1, m) {
  // ATen's device-generic nested implementations: _to_copy makes its result
  // with empty_like and copies the buffer (a plain tensor) across.
  m.impl("_to_copy", TORCH_FN(at::native::_to_copy_nested));
  m.impl("empty_like", TORCH_FN(at::native::empty_like_nested));
  // Note [nn.TransformerEncoder's nested fast path on kiln]
  m.impl("_transformer_encoder_layer_fwd",
         torch::CppFunction::makeFromBoxedFunction<&runOnCpuAndMoveBack>());
  m.impl("to_padded_tensor", torch::CppFunction::makeFromBoxedFunction<&runOnCpuAndMoveBack>());
  // Composite on kiln but given nested kernels on CPU and CUDA: see the top.
  for (const char* name : {"linear", "matmul", "matmul.out"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&nestedFallback>());
  }
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  // Dense kiln inputs, a strided nested result: see the Note above.
  m.impl("_nested_tensor_from_mask",
         torch::CppFunction::makeFromBoxedFunction<&runOnCpuAndMoveBack>());
}

} // namespace at::kiln
