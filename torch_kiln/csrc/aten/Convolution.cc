// Convolutions on kiln. PyTorch's convolution front end (aten::_convolution)
// picks a backend by device and sends PrivateUse1 tensors to
// convolution_overrideable / convolution_backward_overrideable, which have no
// kernel of their own. Kiln runs them through aten::convolution and
// aten::convolution_backward on the device, so the CPU backend selection
// (oneDNN, slow_conv2d, depthwise, ...) and hence the numbers are exactly
// CPU's for the same inputs.
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

// convolution_backward_overrideable(grad_output, input, weight, stride,
// padding, dilation, transposed, output_padding, groups, output_mask) lacks
// convolution_backward's `bias_sizes` (after `weight`): the bias has one
// element per output channel.
void convolutionBackwardOverrideable(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  constexpr size_t kNumArgs = 10;
  const size_t first = stack->size() - kNumArgs;
  const at::Tensor& weight = (*stack)[first + 2].toTensor();
  const bool transposed = (*stack)[first + 6].toBool();
  const int64_t groups = (*stack)[first + 8].toInt();
  const int64_t out_channels = transposed ? weight.size(1) * groups : weight.size(0);
  stack->insert(stack->begin() + static_cast<std::ptrdiff_t>(first + 3),
                c10::IValue(std::vector<int64_t>{out_channels}));
  runOnKiln(convolutionBackwardOp(), stack);
}

} // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("convolution_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&convolutionOverrideable>());
  m.impl("convolution_backward_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&convolutionBackwardOverrideable>());
}

} // namespace at::kiln
