// KilnHostAllocator.h — pinned (page-locked) host memory for kiln.
//
// PyTorch's generic caching host allocator (ATen/core/CachingHostAllocator.h,
// the same code CUDA and XPU use) instantiated over kiln streams and events,
// with memory from kilnMallocHost. Registered with at::setHostAllocator for
// PrivateUse1, so Tensor.pin_memory(), torch.empty(..., pin_memory=True) and
// DataLoader(pin_memory=True) give kiln-pinned CPU tensors, and
// non_blocking copies between them and kiln tensors are truly asynchronous.
//
// A pinned block used by an asynchronous copy is protected by record_event
// (called by the copy code): it is not reused until that copy has finished.
#pragma once

#include <ATen/core/CachingHostAllocator.h>

namespace c10::kiln {

at::HostAllocator* getKilnHostAllocator();

} // namespace c10::kiln
