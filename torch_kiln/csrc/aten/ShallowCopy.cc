// Moving a module to kiln keeps its Parameter objects, as on CUDA.
//
// Module.to() replaces a parameter's data in place (`param.data = new`) only
// if PyTorch says the two tensors have "compatible shallow-copy types"; the
// built-in rule lists CPU, CUDA, MPS, HIP, XPU, HPU and MTIA but not
// PrivateUse1, and otherwise Module.to() wraps every parameter in a *new*
// Parameter. That silently unties tied weights (a GPT's embedding and output
// head become two tensors with separate gradients) and detaches optimizers
// created before .to(). PyTorch lets a PrivateUse1 backend answer through the
// _has_compatible_shallow_copy_type operator (see c10/core/TensorImpl.h):
// kiln answers yes for dense CPU and kiln tensors, and defers to the built-in
// rule for everything else.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

namespace at::kiln {
namespace {

bool isDenseHostOrKiln(const at::Tensor& t) {
  return t.layout() == c10::kStrided && (t.device().is_cpu() || t.device().is_privateuseone()) &&
      !t.is_quantized() && !t.is_nested();
}

bool hasCompatibleShallowCopyType(const at::Tensor& self, const at::Tensor& from) {
  if (isDenseHostOrKiln(self) && isDenseHostOrKiln(from)) {
    return true;
  }
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set());
}

} // namespace

// The operator is CompositeImplicitAutograd; registering the backend key
// alone would leave its autograd key without a kernel, so register both.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(hasCompatibleShallowCopyType));
}

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(hasCompatibleShallowCopyType));
}

} // namespace at::kiln
