// Kiln runs CPU's kernel wherever CPU has one.
//
// Note [Composite kernels vs CPU kernels]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A few ATen operators have a dedicated CPU kernel *and* a generic
// CompositeExplicitAutograd kernel that every other device, PrivateUse1
// included, receives by default (native_layer_norm, native_group_norm, addr,
// all/any over dims, ...). The composite computes the same function with
// different rounding, so kiln would not reproduce CPU's numbers. At load
// time, Kiln registers its op executor (which runs the CPU kernel on the
// device) for PrivateUse1 on every such operator. Autograd is unaffected:
// these operators' derivatives are registered separately.
//
// Likewise for a few generic kernels that select a kernel by device type
// and fail for PrivateUse1 (selectsKernelByDeviceType), and for structured
// operators whose generated generic wrapper allocates
// outputs in a layout that differs from CPU's (Note [Meta layouts and CPU
// layouts]): the executor then runs them and takes CPU's layouts.
//
// Three operators have a CPU kernel and a CompositeImplicitAutograd
// decomposition (silu_backward, mish_backward, native_channel_shuffle).
// Without a PrivateUse1 kernel, kiln would run the decomposition, both for
// the result (other rounding: Llama's SiLU MLP then trained off CPU's bits)
// and for autograd (differentiable through the decomposed ops). CPU and CUDA
// instead run their kernel under the operator's Autograd kernel (generated
// VariableType code, which for these operators is "not implemented": silu's
// and mish's own derivatives call them only with grad mode off, and use
// differentiable formulas otherwise). Registering the executor for
// PrivateUse1 gives kiln exactly that: once a backend kernel exists, the
// dispatcher takes AutogradPrivateUse1 from the Autograd kernel instead of
// from the decomposition. We do it only where that Autograd kernel exists,
// so a composite operator never loses a derivative CPU has.
#include <string>
#include <unordered_set>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "aten/KilnOpExecutor.h"
#include "aten/OpSchemaInfo.h"

namespace at::kiln {
namespace {

// Generic (CompositeExplicitAutograd) kernels that pick a per-device kernel
// themselves (a DispatchStub, or a device-type check), and so fail for
// PrivateUse1; through the executor they run on CPU, where the pick succeeds.
bool selectsKernelByDeviceType(const c10::OperatorName& name) {
  static const std::unordered_set<std::string> names = {
      "aten::conj_physical_", // conj_physical_stub
      "aten::mode.values",    // "mode only supports CPU, CUDA and XPU"
  };
  const std::string full =
      name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
  return names.count(full) != 0;
}

std::vector<c10::OperatorName> operatorsNeedingCpuKernel() {
  std::vector<c10::OperatorName> result;
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) {
      continue;
    }
    const auto op = dispatcher.findOp(name);
    if (!op.has_value() || !op->hasSchema()) {
      continue;
    }
    if (op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) {
      continue;
    }
    const bool composite_default =
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd);
    // See the note above: decompositions that CPU does not run.
    const bool cpu_kernel_over_decomposition =
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) &&
        op->hasKernelForDispatchKey(c10::DispatchKey::CPU) &&
        op->hasKernelForDispatchKey(c10::DispatchKey::Autograd);
    if (!op->hasKernelForDispatchKey(c10::DispatchKey::CPU) &&
        !(composite_default && selectsKernelByDeviceType(name))) {
      continue;
    }
    // A structured op's generic wrapper takes its layout from the C++ meta
    // function; where that differs from CPU, run the op through the executor.
    const bool structured_with_wrong_layout =
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional) &&
        metaLayoutsKnownWrong(name.name);
    if (composite_default || structured_with_wrong_layout || cpu_kernel_over_decomposition) {
      result.push_back(name);
    }
  }
  return result;
}

// Lives for the process: the registrations end with the Library object.
const torch::Library* registerCpuKernelOverrides() {
  auto* library = new torch::Library(torch::Library::IMPL, "aten",
                                     c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  for (const auto& name : operatorsNeedingCpuKernel()) {
    const std::string qualified =
        name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
    library->impl(qualified.c_str() + 6, // without "aten::"
                  torch::CppFunction::makeFromBoxedFunction<&kilnFallback>());
  }
  return library;
}

const torch::Library* const registered = registerCpuKernelOverrides();

} // namespace
} // namespace at::kiln
