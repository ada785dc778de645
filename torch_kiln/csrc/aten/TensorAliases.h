// TensorAliases.h — stand-ins for kiln tensors that never touch device memory
// on the calling thread.
//
// The reference device computes with ATen's CPU kernels (Note [How an eager
// op runs on kiln], KilnOpExecutor.cc), which needs two stand-ins per kiln
// tensor:
//   * a host alias (target kCPU): a CPU tensor over the *same bytes* as the
//     kiln tensor, same dtype, sizes, strides, storage offset and conj/neg
//     bits. Only tasks running on a kiln stream may read or write through it.
//   * a meta image (target kMeta): a meta tensor with the same layout and a
//     storage of the same byte size, used on the calling thread to compute
//     output sizes, strides and dtypes with the op's meta kernel.
//
// A TensorAliaser gives tensors that share a kiln storage stand-ins that share
// one storage, so aliasing checks inside kernels (overlap, in-place on a view,
// copy between views of one base) behave exactly as they do on CPU; and one
// tensor passed as two arguments one stand-in, so checks of tensor identity
// (`is_same`: TensorIterator refuses to resize an out= that is also an
// input, "output with shape [2] doesn't match the broadcast shape [2, 2]")
// behave as they do on CPU too. CPU
// tensors (the 0-dim "scalar" tensors ops accept from the host) pass through
// unchanged: kernels of every device, meta included, accept them.
//
// Not thread-safe: one aliaser per op launch.
#pragma once

#include <utility>

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <c10/util/SmallVector.h>

namespace at::kiln {

struct TensorDescriptor; // KernelLaunch.h

class TensorAliaser {
 public:
  explicit TensorAliaser(c10::DeviceType target) : target_(target) {}

  // Undefined tensors map to undefined tensors.
  at::Tensor alias(const at::Tensor& tensor);
  // The same for a tensor recorded as a descriptor (host aliases only).
  at::Tensor alias(const TensorDescriptor& descriptor);

 private:
  c10::Storage storageFor(const void* key, void* data, size_t nbytes);
  // The stand-in already made for the tensor `key` (its TensorImpl), if any.
  at::Tensor* madeFor(const void* key);

  c10::DeviceType target_;
  c10::SmallVector<std::pair<const void*, c10::Storage>, 4> storages_;
  c10::SmallVector<std::pair<const void*, at::Tensor>, 4> tensors_;
};

} // namespace at::kiln
