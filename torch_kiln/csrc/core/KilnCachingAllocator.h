// KilnCachingAllocator.h — the device memory allocator of kiln tensors: a
// stream-ordered caching allocator in the manner of CUDA's
// (c10/cuda/CUDACachingAllocator.cpp), registered as the c10::DeviceAllocator
// of DeviceType::PrivateUse1 so torch.accelerator.memory_* and
// torch.kiln.memory_* read its statistics under CUDA's memory_stats key names.
//
// See Note [Kiln caching allocator] in KilnCachingAllocator.cc.
//
// Errors: an allocation the device cannot satisfy even after releasing the
// cache raises c10::OutOfMemoryError (torch.OutOfMemoryError) naming the
// device, the request, and the allocated/reserved/free/total figures (and the
// per-process limit, if set_per_process_memory_fraction set one).
// Thread-safety: all functions are thread-safe (one mutex per device).
#pragma once

#include <cstddef>
#include <utility>

#include <c10/core/CachingDeviceAllocator.h>

#include "core/KilnStream.h"

namespace c10::kiln::KilnCachingAllocator {

// The allocator (also reachable as c10::GetAllocator(kPrivateUse1)).
c10::DeviceAllocator* get();

// Marks the block behind `data_ptr` as used by `stream`: when the tensor is
// freed, the block is not reused until the work launched on `stream` up to the
// free has finished (Tensor.record_stream). A no-op for data not from this
// allocator or used only on its own stream.
void recordStream(const c10::DataPtr& data_ptr, const KilnStream& stream);

// Frees all cached, unused blocks of every device back to the runtime.
void emptyCache();

c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex device);
void resetPeakStats(DeviceIndex device);
void resetAccumulatedStats(DeviceIndex device);

// (free, total) bytes of the device, as the runtime reports them.
std::pair<size_t, size_t> getMemoryInfo(DeviceIndex device);

// --- Per-process memory fraction (torch.kiln.set_per_process_memory_fraction)
//
// Limits the memory the allocator may reserve on `device` to
// fraction * capacity bytes (capacity: KILN_DEVICE_MEMORY), as CUDA's
// setMemoryFraction does: a request that would need a new segment beyond the
// limit first releases the cache, then raises c10::OutOfMemoryError naming the
// limit. Memory already reserved is not released when the limit shrinks.
// fraction 1 removes the limit. Throws c10::ValueError unless 0 <= fraction <= 1
// and c10::Error for a bad device index.
void setMemoryFraction(double fraction, DeviceIndex device);
// The fraction last set for `device` (1.0 if never set).
double getMemoryFraction(DeviceIndex device);

} // namespace c10::kiln::KilnCachingAllocator
