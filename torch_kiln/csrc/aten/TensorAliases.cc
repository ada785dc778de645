#include "aten/TensorAliases.h"

#include "aten/KernelLaunch.h"

#include <c10/core/Allocator.h>
#include <c10/core/TensorImpl.h>

namespace at::kiln {

c10::Storage TensorAliaser::storageFor(const void* key, void* data, size_t nbytes) {
  for (auto& [k, storage] : storages_) {
    if (k == key) {
      return storage;
    }
  }
  c10::Storage storage;
  if (target_ == c10::kMeta) {
    // Resizable, so meta kernels of out= ops can resize their output.
    storage = c10::Storage(c10::Storage::use_byte_size_t(), nbytes,
                           c10::DataPtr(nullptr, c10::Device(c10::kMeta)),
                           c10::GetAllocator(c10::kMeta), /*resizable=*/true);
  } else {
    // Non-owning: the kiln storage keeps the memory; a kernel that tried to
    // reallocate it would fail rather than silently write elsewhere.
    storage = c10::Storage(c10::Storage::use_byte_size_t(), nbytes,
                           c10::DataPtr(data, c10::Device(c10::kCPU)),
                           /*allocator=*/nullptr, /*resizable=*/false);
  }
  storages_.emplace_back(key, storage);
  return storage;
}

at::Tensor* TensorAliaser::madeFor(const void* key) {
  for (auto& [k, tensor] : tensors_) {
    if (k == key) {
      return &tensor;
    }
  }
  return nullptr;
}

at::Tensor TensorAliaser::alias(const at::Tensor& tensor) {
  if (!tensor.defined()) {
    return tensor;
  }
  if (tensor.device().is_cpu()) {
    // Host scalars pass through: kernels of every device accept 0-dim CPU
    // tensors, and Python meta kernels turn wrapped numbers into scalars,
    // which they can only do for CPU tensors.
    return tensor;
  }
  if (at::Tensor* made = madeFor(tensor.unsafeGetTensorImpl())) {
    return *made;
  }
  c10::StorageImpl* source_storage = tensor.storage().unsafeGetStorageImpl();
  c10::Storage storage =
      storageFor(source_storage, source_storage->mutable_data(), source_storage->nbytes());
  const c10::DispatchKey key = target_ == c10::kMeta ? c10::DispatchKey::Meta
                                                     : c10::DispatchKey::CPU;
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(key), tensor.dtype());
  const auto* source = tensor.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(source->sizes(), source->strides(), source->storage_offset());
  impl->_set_conj(source->is_conj());
  impl->_set_neg(source->is_neg());
  tensors_.emplace_back(source, at::Tensor(std::move(impl)));
  return tensors_.back().second;
}

at::Tensor TensorAliaser::alias(const TensorDescriptor& d) {
  TORCH_INTERNAL_ASSERT(target_ == c10::kCPU, "descriptors alias to host tensors only");
  if (!d.defined) {
    return at::Tensor();
  }
  if (d.host_tensor.defined()) {
    return d.host_tensor;
  }
  if (at::Tensor* made = madeFor(d.tensor_key)) {
    return *made;
  }
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      storageFor(d.storage_key, d.data, d.nbytes), c10::DispatchKeySet(c10::DispatchKey::CPU),
      c10::scalarTypeToTypeMeta(d.dtype));
  impl->set_sizes_and_strides(d.sizes, d.strides, d.storage_offset);
  impl->_set_conj(d.is_conj);
  impl->_set_neg(d.is_neg);
  tensors_.emplace_back(d.tensor_key, at::Tensor(std::move(impl)));
  return tensors_.back().second;
}

} // namespace at::kiln
