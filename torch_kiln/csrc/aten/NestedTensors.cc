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
//     'NestedTensorkiln' backend".
// Composite operators that read sizes() before dispatching (F.linear) still
// fail inside PyTorch with its own message.
#include <string>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_to_copy_native.h>
#include <ATen/ops/empty_like_native.h>
#include <torch/library.h>

namespace at::kiln {
namespace {

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
}

} // namespace at::kiln
