// Kernels that change which memory a kiln tensor uses: resize_ and the set_
// family. They only touch metadata and the caching allocator on the calling
// thread; moving existing bytes to a larger allocation is a device copy on
// the current stream (see core/KilnStorage.h).
#include <ATen/EmptyTensor.h>
#include <ATen/ops/set_native.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "core/KilnStorage.h"

namespace at::kiln {
namespace {

void checkSizes(c10::IntArrayRef size, const char* op) {
  for (const int64_t s : size) {
    TORCH_CHECK(s >= 0, op, ": Trying to create tensor with negative dimension ", s, ": ", size);
  }
}

// Grows the storage of `self` to cover its current sizes and strides.
void ensureStorageCovers(const at::Tensor& self) {
  const size_t needed = at::detail::computeStorageNbytes(
      self.sizes(), self.strides(), self.dtype().itemsize(),
      static_cast<size_t>(self.storage_offset()));
  if (needed > self.storage().nbytes()) {
    const c10::DeviceGuard guard(self.device());
    c10::kiln::resizeStorageBytes(self.storage().unsafeGetStorageImpl(), needed);
  }
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef sym_size,
                          std::optional<c10::MemoryFormat> memory_format) {
  const auto size = C10_AS_INTARRAYREF_SLOW(sym_size);
  checkSizes(size, "resize_");
  auto* impl = self.unsafeGetTensorImpl();
  if (self.sizes().equals(size) && !memory_format.has_value()) {
    return self;
  }
  impl->set_sizes_contiguous(size);
  if (memory_format.has_value()) {
    TORCH_CHECK(*memory_format != c10::MemoryFormat::Preserve,
                "Unsupported memory format ", *memory_format);
    impl->empty_tensor_restride(*memory_format);
  }
  ensureStorageCovers(self);
  return self;
}

at::Tensor& set_storage_(at::Tensor& self, at::Storage source, c10::SymInt sym_offset,
                         c10::SymIntArrayRef sym_size, c10::SymIntArrayRef sym_stride) {
  const int64_t offset = sym_offset.expect_int();
  const auto size = C10_AS_INTARRAYREF_SLOW(sym_size);
  const auto stride = C10_AS_INTARRAYREF_SLOW(sym_stride);
  TORCH_CHECK(
      source.device() == self.device(),
      "Attempted to set the storage of a tensor on device \"", self.device(),
      "\" to a storage on different device \"", source.device(),
      "\".  This is no longer allowed; the devices must match.");
  checkSizes(size, "set_");
  TORCH_CHECK(offset >= 0, "Tensor: invalid storage offset ", offset);
  TORCH_CHECK(stride.empty() || stride.size() == size.size(),
              "set_: stride has ", stride.size(), " dimensions but size has ", size.size());
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  if (stride.empty()) {
    impl->set_sizes_contiguous(size);
    impl->set_storage_offset(offset);
  } else {
    impl->set_sizes_and_strides(size, stride, offset);
  }
  ensureStorageCovers(self);
  return self;
}

at::Tensor& set_empty_(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0,
                       c10::DataPtr(nullptr, self.device()),
                       c10::GetAllocator(c10::kPrivateUse1), /*resizable=*/true);
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(storage));
  impl->set_sizes_contiguous({0});
  return self;
}

} // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("resize_", TORCH_FN(resize_));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage_));
  m.impl("set_.source_Storage", TORCH_FN(at::native::set_));
  m.impl("set_.source_Tensor", TORCH_FN(at::native::set_tensor_));
  m.impl("set_", TORCH_FN(set_empty_));
}

} // namespace at::kiln
