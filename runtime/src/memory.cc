// memory.cc — device and pinned host allocations, and pointer classification.
//
// Device memory is host memory from posix_memalign, charged against the
// device's capacity. The allocation table (base → size, device) lets every
// call that takes a device pointer check that it is live and that a range lies
// inside one allocation, so a stale or out-of-range pointer is a clear error
// instead of silent corruption of whatever the host allocator put there.
//
// Why capacity is checked before the system allocator is called: sizes like
// 1 << 50 or SIZE_MAX must come back as kilnErrorMemoryAllocation with the
// request and the free and total bytes, the way a real device reports it. The
// capacity is charged in 256-byte units (the alignment kilnMalloc promises),
// so kilnMemGetInfo reports exactly what allocations can still get.
//
// Note [kilnFree waits for every device]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// cudaFree synchronises before releasing memory, so no kernel still queued can
// write to it after it was handed to someone else. On the reference device any
// stream can touch any device's memory: peer copies run on the destination's
// (or the source's) stream, and a task is a host function that may read any
// pointer. Waiting only for the owning device would leave a pending peer copy
// on another device reading freed memory. So kilnFree and kilnFreeHost wait
// for the work submitted so far on every stream of every device (sticky errors
// are left for the streams' own synchronisation). Freeing is rare — PyTorch's
// caching allocator frees only when it empties its cache — so the wider wait
// costs nothing in steady state.
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iterator>

#include "runtime_internal.h"

namespace kiln {
namespace {

uint64_t HostPhysicalMemory() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return UINT64_MAX;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

// `charged`: what the request takes of the capacity (rounded up to the
// allocation unit), the figure to compare with the free bytes.
kilnError_t FailOutOfMemory(const Device& dev, size_t requested, uint64_t charged,
                            uint64_t free_bytes) {
  const std::string rounded =
      charged == requested
          ? std::string()
          : StrFormat(", which takes %s of device memory (allocations are charged in %zu-byte "
                      "units)",
                      FormatBytes(charged).c_str(), kDeviceAlignment);
  return Fail(kilnErrorMemoryAllocation,
              "out of memory on kiln device %d: requested %s%s; %s free of %s total", dev.index,
              FormatBytes(requested).c_str(), rounded.c_str(), FormatBytes(free_bytes).c_str(),
              FormatBytes(dev.capacity).c_str());
}

// The allocation of `map` that contains `addr`, or map.end(). Entries are
// base → something with a size, looked up via `size_of`.
template <class Map, class SizeOf>
typename Map::const_iterator FindContaining(const Map& map, uintptr_t addr, SizeOf size_of) {
  auto it = map.upper_bound(addr);
  if (it == map.begin()) return map.end();
  --it;
  return addr < it->first + size_of(it->second) ? it : map.end();
}

size_t DeviceSizeOf(const DeviceAllocation& a) { return a.size; }
size_t PinnedSizeOf(size_t size) { return size; }

// Why a pointer handed to kilnFree is not a live device allocation. mem_mu held.
kilnError_t FailNotFreeable(const Runtime& rt, const void* p) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  auto dev = FindContaining(rt.device_allocs, addr, DeviceSizeOf);
  if (dev != rt.device_allocs.end()) {
    return Fail(kilnErrorInvalidDevicePointer,
                "%p points %zu bytes into the kiln device %d allocation at %p (%s); pass the "
                "pointer kilnMalloc returned",
                p, static_cast<size_t>(addr - dev->first), dev->second.device,
                reinterpret_cast<void*>(dev->first), FormatBytes(dev->second.size).c_str());
  }
  if (FindContaining(rt.pinned_allocs, addr, PinnedSizeOf) != rt.pinned_allocs.end()) {
    return Fail(kilnErrorInvalidDevicePointer,
                "%p is pinned host memory from kilnMallocHost; free it with kilnFreeHost", p);
  }
  return Fail(kilnErrorInvalidDevicePointer,
              "%p is not a live allocation from kilnMalloc (already freed, or never allocated "
              "by it); nothing was freed",
              p);
}

// Why a pointer handed to kilnFreeHost is not a live pinned allocation.
kilnError_t FailNotPinned(const Runtime& rt, const void* p) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  if (FindContaining(rt.device_allocs, addr, DeviceSizeOf) != rt.device_allocs.end()) {
    return Fail(kilnErrorInvalidValue,
                "%p is device memory from kilnMalloc; free it with kilnFree", p);
  }
  auto pinned = FindContaining(rt.pinned_allocs, addr, PinnedSizeOf);
  if (pinned != rt.pinned_allocs.end()) {
    return Fail(kilnErrorInvalidValue,
                "%p points %zu bytes into the pinned allocation at %p; pass the pointer "
                "kilnMallocHost returned",
                p, static_cast<size_t>(addr - pinned->first), reinterpret_cast<void*>(pinned->first));
  }
  return Fail(kilnErrorInvalidValue,
              "%p is not a live allocation from kilnMallocHost (already freed, or never "
              "allocated by it); nothing was freed",
              p);
}

}  // namespace

kilnError_t ClassifyRange(Runtime& rt, const char* role, const void* p, size_t count, Range* out) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  if (count > UINTPTR_MAX - addr)
    return Fail(kilnErrorInvalidValue, "%s range of %zu bytes at %p wraps around the address space",
                role, count, p);
  const uintptr_t end = addr + count;

  std::lock_guard<std::mutex> lock(rt.mem_mu);
  auto next = rt.device_allocs.upper_bound(addr);
  if (next != rt.device_allocs.begin()) {
    auto it = std::prev(next);
    const uintptr_t base = it->first;
    const DeviceAllocation& a = it->second;
    if (addr < base + a.size) {
      if (end > base + a.size) {
        return Fail(kilnErrorInvalidValue,
                    "%s range [%p, %p) (%s) runs %zu bytes past the end of the kiln device %d "
                    "allocation [%p, %p) (%s) it starts in",
                    role, p, reinterpret_cast<void*>(end), FormatBytes(count).c_str(),
                    static_cast<size_t>(end - (base + a.size)), a.device,
                    reinterpret_cast<void*>(base), reinterpret_cast<void*>(base + a.size),
                    FormatBytes(a.size).c_str());
      }
      *out = Range{MemoryKind::kDevice, a.device};
      return kilnSuccess;
    }
  }
  if (next != rt.device_allocs.end() && next->first < end) {
    return Fail(kilnErrorInvalidValue,
                "%s host range [%p, %p) (%s) overlaps the kiln device %d allocation at %p",
                role, p, reinterpret_cast<void*>(end), FormatBytes(count).c_str(),
                next->second.device, reinterpret_cast<void*>(next->first));
  }
  auto pinned = FindContaining(rt.pinned_allocs, addr, PinnedSizeOf);
  if (pinned != rt.pinned_allocs.end() && end <= pinned->first + pinned->second) {
    *out = Range{MemoryKind::kPinned, -1};
  } else {
    *out = Range{MemoryKind::kPageable, -1};
  }
  return kilnSuccess;
}

}  // namespace kiln

using kiln::ApiCall;
using kiln::Fail;
using kiln::FormatBytes;
using kiln::Runtime;

extern "C" {

KILN_API kilnError_t kilnMalloc(void** devPtr, size_t size) {
  return ApiCall("kilnMalloc", [&](Runtime& rt) {
    if (devPtr == nullptr) return Fail(kilnErrorInvalidValue, "devPtr is NULL");
    int d = 0;
    if (kilnError_t err = kiln::CurrentDevice(rt, &d)) return err;
    if (size == 0) {
      *devPtr = nullptr;
      return kilnSuccess;
    }
    kiln::Device& dev = rt.devices[d];

    // Charge the capacity first (never ask the host for impossible sizes).
    const size_t align = kiln::kDeviceAlignment;
    if (size > SIZE_MAX - (align - 1)) {
      std::lock_guard<std::mutex> lock(rt.mem_mu);
      return kiln::FailOutOfMemory(dev, size, size, dev.capacity - dev.used);
    }
    const size_t reserved = (size + align - 1) / align * align;
    {
      std::lock_guard<std::mutex> lock(rt.mem_mu);
      const uint64_t free_bytes = dev.capacity - dev.used;
      if (reserved > free_bytes) return kiln::FailOutOfMemory(dev, size, reserved, free_bytes);
      dev.used += reserved;
    }

    void* p = nullptr;
    const int rc = posix_memalign(&p, align, reserved);
    if (rc == 0) {
      try {
        std::lock_guard<std::mutex> lock(rt.mem_mu);
        rt.device_allocs.emplace(reinterpret_cast<uintptr_t>(p),
                                 kiln::DeviceAllocation{size, reserved, d});
        *devPtr = p;
        return kilnSuccess;
      } catch (...) {
        std::free(p);  // table insertion failed: fall through to the host failure
      }
    }
    uint64_t free_bytes = 0;
    {
      std::lock_guard<std::mutex> lock(rt.mem_mu);
      dev.used -= reserved;
      free_bytes = dev.capacity - dev.used;
    }
    return Fail(kilnErrorMemoryAllocation,
                "out of memory on kiln device %d: requested %s, which the device has free "
                "(%s free of %s total), but the host could not provide it (%s); free host "
                "memory or lower KILN_DEVICE_MEMORY",
                d, FormatBytes(size).c_str(), FormatBytes(free_bytes).c_str(),
                FormatBytes(dev.capacity).c_str(), std::strerror(rc != 0 ? rc : ENOMEM));
  });
}

KILN_API kilnError_t kilnFree(void* devPtr) {
  return ApiCall("kilnFree", [&](Runtime& rt) {
    if (devPtr == nullptr) return kilnSuccess;
    const auto addr = reinterpret_cast<uintptr_t>(devPtr);
    {
      std::lock_guard<std::mutex> lock(rt.mem_mu);
      if (rt.device_allocs.find(addr) == rt.device_allocs.end())
        return kiln::FailNotFreeable(rt, devPtr);
    }
    if (kilnError_t err = kiln::CheckNotInsideTaskOf(-1)) return err;
    // See Note [kilnFree waits for every device].
    kiln::WaitAllDevices(rt);
    {
      std::lock_guard<std::mutex> lock(rt.mem_mu);
      auto it = rt.device_allocs.find(addr);
      if (it == rt.device_allocs.end()) return kiln::FailNotFreeable(rt, devPtr);  // lost a race
      rt.devices[it->second.device].used -= it->second.reserved;
      rt.device_allocs.erase(it);
    }
    std::free(devPtr);
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnMallocHost(void** ptr, size_t size) {
  return ApiCall("kilnMallocHost", [&](Runtime& rt) {
    if (ptr == nullptr) return Fail(kilnErrorInvalidValue, "ptr is NULL");
    if (size == 0) {
      *ptr = nullptr;
      return kilnSuccess;
    }
    // Page-locked memory must be resident, so more than the host's physical
    // memory can never succeed; refuse before asking the allocator.
    static const uint64_t physical = kiln::HostPhysicalMemory();
    if (size > physical)
      return Fail(kilnErrorMemoryAllocation,
                  "cannot pin %s of host memory: the host has only %s of physical memory",
                  FormatBytes(size).c_str(), FormatBytes(physical).c_str());
    void* p = nullptr;
    const int rc = posix_memalign(&p, kiln::kPinnedAlignment, size);
    if (rc != 0)
      return Fail(kilnErrorMemoryAllocation, "the host could not provide %s of pinned memory (%s)",
                  FormatBytes(size).c_str(), std::strerror(rc));
    try {
      std::lock_guard<std::mutex> lock(rt.mem_mu);
      rt.pinned_allocs.emplace(reinterpret_cast<uintptr_t>(p), size);
    } catch (...) {
      std::free(p);
      throw;
    }
    *ptr = p;
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnFreeHost(void* ptr) {
  return ApiCall("kilnFreeHost", [&](Runtime& rt) {
    if (ptr == nullptr) return kilnSuccess;
    const auto addr = reinterpret_cast<uintptr_t>(ptr);
    {
      std::lock_guard<std::mutex> lock(rt.mem_mu);
      if (rt.pinned_allocs.find(addr) == rt.pinned_allocs.end()) return kiln::FailNotPinned(rt, ptr);
    }
    if (kilnError_t err = kiln::CheckNotInsideTaskOf(-1)) return err;
    // Pending asynchronous copies may still read or write it.
    // See Note [kilnFree waits for every device].
    kiln::WaitAllDevices(rt);
    {
      std::lock_guard<std::mutex> lock(rt.mem_mu);
      auto it = rt.pinned_allocs.find(addr);
      if (it == rt.pinned_allocs.end()) return kiln::FailNotPinned(rt, ptr);
      rt.pinned_allocs.erase(it);
    }
    std::free(ptr);
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnPointerGetAttributes(kilnPointerAttributes* attributes, const void* ptr) {
  return ApiCall("kilnPointerGetAttributes", [&](Runtime& rt) {
    if (attributes == nullptr) return Fail(kilnErrorInvalidValue, "attributes is NULL");
    kilnPointerAttributes a{kilnMemoryTypeUnregistered, -1, nullptr, 0};
    const auto addr = reinterpret_cast<uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(rt.mem_mu);
    auto dev = kiln::FindContaining(rt.device_allocs, addr, kiln::DeviceSizeOf);
    if (dev != rt.device_allocs.end()) {
      a = {kilnMemoryTypeDevice, dev->second.device, reinterpret_cast<void*>(dev->first),
           dev->second.size};
    } else {
      auto pinned = kiln::FindContaining(rt.pinned_allocs, addr, kiln::PinnedSizeOf);
      if (pinned != rt.pinned_allocs.end())
        a = {kilnMemoryTypeHost, -1, reinterpret_cast<void*>(pinned->first), pinned->second};
    }
    *attributes = a;
    return kilnSuccess;
  });
}

}  // extern "C"
