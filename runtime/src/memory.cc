// memory.cc — device and pinned host allocations, and pointer classification.
//
// Device memory is host memory mapped from a memfd (one per allocation),
// charged against the device's capacity. See Note [Shareable device memory]. The allocation table (base → size, device) lets every
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
// Note [Shareable device memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each kilnMalloc maps a fresh anonymous memory file (memfd_create) MAP_SHARED
// and keeps its descriptor, so the allocation can be shared with another
// process, like CUDA's POSIX-file-descriptor shareable handles
// (cuMemExportToShareableHandle): kilnMemExportToShareableHandle hands out a
// duplicate of the descriptor, which the host layer passes to the other
// process (SCM_RIGHTS); kilnMemImportFromShareableHandle maps it there as
// device memory of a given device. Both mappings are the same pages, so
// writes on either side are seen by the other; the pages live while any
// process maps them or holds a descriptor, so an importer's view stays valid
// after the exporter frees its allocation (keeping the exporter from
// *reusing* that memory while it is shared is the host layer's job: PyTorch's
// caching allocator would hand the block to another tensor). Page faults,
// alignment (page, above the 256 bytes promised) and release on kilnFree
// (munmap) behave as for large malloc blocks, which glibc maps too.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iterator>

#include "runtime_internal.h"

namespace kiln {
namespace {

size_t PageRound(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGE_SIZE));
  return (bytes + page - 1) / page * page;
}

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

    // See Note [Shareable device memory].
    int rc = 0;
    const size_t mapped = kiln::PageRound(reserved);
    const int fd = memfd_create("kiln-device-memory", MFD_CLOEXEC);
    void* p = MAP_FAILED;
    if (fd < 0) {
      rc = errno;
    } else if (ftruncate(fd, static_cast<off_t>(mapped)) != 0) {
      rc = errno;
    } else {
      p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) rc = errno;
    }
    if (p != MAP_FAILED) {
      try {
        std::lock_guard<std::mutex> lock(rt.mem_mu);
        kiln::DeviceAllocation a{size, reserved, d};
        a.fd = fd;
        a.mapped = mapped;
        rt.device_allocs.emplace(reinterpret_cast<uintptr_t>(p), a);
        *devPtr = p;
        return kilnSuccess;
      } catch (...) {
        munmap(p, mapped);  // table insertion failed: fall through to the host failure
        rc = ENOMEM;
      }
    }
    if (fd >= 0) close(fd);
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
    const bool release = kiln::WaitBeforeFree(rt);
    kiln::DeviceAllocation a{0, 0, 0};
    {
      std::lock_guard<std::mutex> lock(rt.mem_mu);
      auto it = rt.device_allocs.find(addr);
      if (it == rt.device_allocs.end()) return kiln::FailNotFreeable(rt, devPtr);  // lost a race
      a = it->second;
      rt.devices[a.device].used -= a.reserved;
      rt.device_allocs.erase(it);
    }
    if (release) munmap(devPtr, a.mapped);
    close(a.fd);  // the pages live on while another process maps them
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
    const bool release = kiln::WaitBeforeFree(rt);
    {
      std::lock_guard<std::mutex> lock(rt.mem_mu);
      auto it = rt.pinned_allocs.find(addr);
      if (it == rt.pinned_allocs.end()) return kiln::FailNotPinned(rt, ptr);
      rt.pinned_allocs.erase(it);
    }
    if (release) std::free(ptr);
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

KILN_API kilnError_t kilnMemExportToShareableHandle(int* fd, size_t* allocationSize,
                                                   size_t* offset, const void* devPtr) {
  return ApiCall("kilnMemExportToShareableHandle", [&](Runtime& rt) {
    if (fd == nullptr || allocationSize == nullptr || offset == nullptr)
      return Fail(kilnErrorInvalidValue, "fd, allocationSize and offset must not be NULL");
    const auto addr = reinterpret_cast<uintptr_t>(devPtr);
    std::lock_guard<std::mutex> lock(rt.mem_mu);
    auto it = kiln::FindContaining(rt.device_allocs, addr, kiln::DeviceSizeOf);
    if (it == rt.device_allocs.end())
      return Fail(kilnErrorInvalidDevicePointer,
                  "%p is not inside a live device allocation (from kilnMalloc or "
                  "kilnMemImportFromShareableHandle); only device memory can be shared",
                  devPtr);
    const int copy = fcntl(it->second.fd, F_DUPFD_CLOEXEC, 0);
    if (copy < 0)
      return Fail(kilnErrorMemoryAllocation,
                  "could not duplicate the allocation's file descriptor (%s); raise the "
                  "open-file limit (ulimit -n)",
                  std::strerror(errno));
    *fd = copy;
    *allocationSize = it->second.size;
    *offset = static_cast<size_t>(addr - it->first);
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnMemImportFromShareableHandle(void** devPtr, int fd,
                                                     size_t allocationSize, int device) {
  return ApiCall("kilnMemImportFromShareableHandle", [&](Runtime& rt) {
    if (devPtr == nullptr) return Fail(kilnErrorInvalidValue, "devPtr is NULL");
    if (kilnError_t err = kiln::CheckDevice(rt, device)) return err;
    if (allocationSize == 0) return Fail(kilnErrorInvalidValue, "allocationSize is 0");
    struct stat st{};
    if (fd < 0 || fstat(fd, &st) != 0)
      return Fail(kilnErrorInvalidValue, "fd %d is not an open file descriptor (%s)", fd,
                  std::strerror(errno));
    if (static_cast<uint64_t>(st.st_size) < allocationSize)
      return Fail(kilnErrorInvalidValue,
                  "fd %d holds %s, less than the allocationSize of %s: it is not the handle of "
                  "that allocation",
                  fd, FormatBytes(static_cast<uint64_t>(st.st_size)).c_str(),
                  FormatBytes(allocationSize).c_str());
    const size_t mapped = kiln::PageRound(allocationSize);
    const int keep = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (keep < 0)
      return Fail(kilnErrorMemoryAllocation, "could not duplicate fd %d (%s)", fd,
                  std::strerror(errno));
    void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, keep, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      close(keep);
      return Fail(kilnErrorInvalidValue, "could not map fd %d as device memory (%s)", fd,
                  std::strerror(e));
    }
    try {
      std::lock_guard<std::mutex> lock(rt.mem_mu);
      kiln::DeviceAllocation a{allocationSize, 0, device};
      a.fd = keep;
      a.mapped = mapped;
      a.imported = true;
      rt.device_allocs.emplace(reinterpret_cast<uintptr_t>(p), a);
    } catch (...) {
      munmap(p, mapped);
      close(keep);
      throw;
    }
    *devPtr = p;
    return kilnSuccess;
  });
}

}  // extern "C"
