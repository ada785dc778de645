// KilnOpExecutor.h — the boxed kernel that runs ATen operators on kiln
// tensors (registered as the PrivateUse1 fallback, so every operator without
// a dedicated kiln kernel reaches it). See Note [How an eager op runs on kiln]
// in KilnOpExecutor.cc.
//
// Errors: mixed devices raise "Expected all tensors to be on the same
// device"; invalid arguments raise the same error the CPU kernel raises;
// operators with no CPU kernel raise NotImplementedError naming the operator.
// Failures inside the kernel on the stream surface at the next
// synchronization (Note [Sticky stream errors]).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace at::kiln {

void kilnFallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// Runs `op` on the kiln tensors of `stack` exactly as the fallback does:
// layouts from op's meta kernel, op's CPU kernel on the stream. Dedicated
// kernels use it to run an operator through a CPU equivalent, e.g.
// convolution_overrideable through aten::convolution.
void runOnKiln(const c10::OperatorHandle& op, torch::jit::Stack* stack);

} // namespace at::kiln
