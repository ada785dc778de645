// Convolutions on kiln. PyTorch's convolution front end (aten::_convolution)
// picks a backend by device and sends PrivateUse1 tensors to
// convolution_overrideable / convolution_backward_overrideable, which have no
// kernel of their own. Kiln runs them through aten::convolution and
// aten::convolution_backward on the device, so the CPU backend selection
// (oneDNN, slow_conv2d, depthwise, ...) and hence the numbers are exactly
// CPU's for the same inputs.
//
// The two overrideable operators have no Meta kernel in PyTorch; kiln's are
// the same argument mapping onto aten::convolution / convolution_backward,
// whose Meta kernels then give the shapes (with symbolic sizes too), so
// torch.compile traces kiln convolutions (Note [Kiln kernels under
// FakeTensorMode], FakeKernels.cc).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "aten/KilnOpExecutor.h"

namespace at::kiln {
namespace {

const c10::OperatorHandle& convolutionOp() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::convolution", "");
  return op;
}

const c10::OperatorHandle& convolutionBackwardOp() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::convolution_backward", "");
  return op;
}

// convolution_overrideable has exactly aten::convolution's arguments.
void convolutionOverrideable(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  runOnKiln(convolutionOp(), stack);
}

void convolutionOverrideableMeta(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  convolutionOp().callBoxed(stack);
}

// convolution_backward_overrideable(grad_output, input, weight, stride,
// padding, dilation, transposed, output_padding, groups, output_mask) lacks
// convolution_backward's `bias_sizes` (after `weight`): the bias has one
// element per output channel.
// Symbolic under torch.compile with dynamic shapes, hence SymInts.
void insertBiasSizes(torch::jit::Stack* stack) {
  constexpr size_t kNumArgs = 10;
  const size_t first = stack->size() - kNumArgs;
  const at::Tensor& weight = (*stack)[first + 2].toTensor();
  const bool transposed = (*stack)[first + 6].toBool();
  const c10::SymInt groups = (*stack)[first + 8].toSymInt();
  const c10::SymInt out_channels = transposed ? weight.sym_size(1) * groups : weight.sym_size(0);
  stack->insert(stack->begin() + static_cast<std::ptrdiff_t>(first + 3),
                c10::IValue(c10::SymIntArrayRef(&out_channels, 1)));
}

void convolutionBackwardOverrideable(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  insertBiasSizes(stack);
  runOnKiln(convolutionBackwardOp(), stack);
}

void convolutionBackwardOverrideableMeta(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  insertBiasSizes(stack);
  convolutionBackwardOp().callBoxed(stack);
}

} // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("convolution_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&convolutionOverrideable>());
  m.impl("convolution_backward_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&convolutionBackwardOverrideable>());
}

TORCH_LIBRARY_IMPL(aten, Meta, m) {
  m.impl("convolution_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&convolutionOverrideableMeta>());
  m.impl("convolution_backward_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&convolutionBackwardOverrideableMeta>());
}

} // namespace at::kiln
