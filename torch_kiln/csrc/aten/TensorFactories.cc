// Allocation of kiln tensors: empty.memory_format and empty_strided. Every
// other factory (zeros, ones, full, arange, tensor(...)) is composed by
// PyTorch from these plus kernels run by the op executor, or copies.
#include <ATen/EmptyTensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "aten/OpTracking.h"

namespace at::kiln {
namespace {

void checkFactoryOptions(std::optional<c10::Device> device, std::optional<c10::Layout> layout,
                         std::optional<bool> pin_memory) {
  const auto d = c10::device_or_default(device);
  TORCH_INTERNAL_ASSERT(d.is_privateuseone(), "kiln factory called for ", d);
  TORCH_CHECK_NOT_IMPLEMENTED(
      c10::layout_or_default(layout) == c10::Layout::Strided,
      "Kiln supports strided (dense) tensors only, got layout ", c10::layout_or_default(layout), ".");
  TORCH_CHECK(
      !c10::pinned_memory_or_default(pin_memory),
      "Only dense CPU tensors can be pinned; pin_memory=True is not valid for a kiln tensor.");
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  checkFactoryOptions(device, layout, pin_memory);
  const c10::DeviceGuard guard(c10::device_or_default(device));
  recordExecutedOp("aten::empty.memory_format");
  return at::detail::empty_generic(size, c10::GetAllocator(c10::kPrivateUse1),
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> pin_memory) {
  checkFactoryOptions(device, layout, pin_memory);
  const c10::DeviceGuard guard(c10::device_or_default(device));
  recordExecutedOp("aten::empty_strided");
  return at::detail::empty_strided_generic(size, stride, c10::GetAllocator(c10::kPrivateUse1),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

} // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
}

} // namespace at::kiln
