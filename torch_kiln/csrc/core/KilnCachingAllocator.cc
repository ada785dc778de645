// The stream-ordered caching allocator for kiln device memory.
#include "core/KilnCachingAllocator.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <c10/util/flat_hash_map.h>
#include <c10/util/irange.h>

#include "core/FailedResults.h"
#include "core/KilnEvent.h"
#include "core/KilnException.h"
#include "core/KilnFunctions.h"

namespace c10::kiln::KilnCachingAllocator {

// Note [Kiln caching allocator]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Asking the runtime for memory (kilnMalloc) is slow and kilnFree waits for the
// whole device, so freed tensors keep their memory in a cache, exactly as
// CUDA's caching allocator does. The rules are CUDA's:
//
//  * Stream-ordered reuse. A block remembers the stream it was allocated on.
//    When its tensor is freed, the block goes back to that stream's free list
//    at once, even if kernels still using it are queued: later work on the
//    same stream runs after them, so reusing the block there is safe. A block
//    is only handed out to allocations on its own stream.
//  * record_stream. If a tensor was used on other streams
//    (Tensor.record_stream), freeing it records an event on each of those
//    streams; the block joins its free list only when all those events have
//    completed (checked at each allocation, process_events).
//  * Sizes, segments and splitting. Requests are rounded up to 512 bytes
//    (kMinBlockSize). Requests up to 256 KiB come from the small pool, whose
//    segments (runtime allocations) are 1 MiB (or just the rounded request
//    when the device has no room for 1 MiB); larger ones from the large
//    pool, whose segments have the request's size. A request takes the
//    smallest free block of its pool and stream that is large enough and
//    splits off the rest as a free block when the rest is at least 512 bytes
//    (small pool) or more than 256 KiB (large pool); a freed block merges
//    with free neighbours of its segment. This is CUDA's design
//    (c10/cuda/CUDACachingAllocator.cpp) with smaller sizes: CUDA's small
//    pool takes requests up to 1 MiB in 2 MiB segments and rounds large
//    segments up to 20 MiB, sized for GPUs' gigabytes. Kiln's reference
//    device lives in host RAM; on the example CNN (13 MiB at peak), a 1 MiB
//    small-pool limit with 2 MiB segments reserved 1.3-1.5x the peak
//    allocation, these sizes 1.17x (bench/run.py, group "memory").
//  * A large request that finds no free block big enough first returns the
//    stream's whole free large segments (all smaller than the request) to
//    the runtime, so reserved memory follows the working set instead of
//    keeping every size a program ever used. kilnFree waits for the device,
//    so this costs a synchronization, while an allocation pattern settles
//    (the first steps of a training loop); after that requests are served
//    from the cache. Only whole free segments go back to the runtime.
//  * Out of memory. If the runtime cannot allocate, all cached free blocks of
//    the device are released and the allocation is retried once; if it fails
//    again, torch.OutOfMemoryError names the device, the request and the
//    rounded block it takes, and what is allocated, reserved and free; it
//    blames the host only if the device had room for that block.
//  * Statistics follow CUDA's DeviceStats (c10/core/CachingDeviceAllocator.h),
//    so memory_stats() has CUDA's keys ("allocated_bytes.all.current", ...).

namespace {

using c10::CachingAllocator::format_size;
using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatType;
using c10::CachingAllocator::StatTypes;
using c10::CachingDeviceAllocator::DeviceStats;

constexpr size_t kMinBlockSize = 512;      // allocation granularity (bytes)
constexpr size_t kSmallSize = 256 << 10;    // largest request of the small pool
constexpr size_t kSmallSegment = 1 << 20;   // size of a small-pool segment
constexpr size_t kMinLargeSplit = kSmallSize; // a large block splits if more is left
constexpr int kMaxDevices = 64;

struct Block {
  DeviceIndex device = 0;
  StreamId stream_id = 0;
  size_t size = 0;      // bytes reserved from the runtime (rounded)
  size_t requested = 0; // bytes the client asked for
  void* ptr = nullptr;
  bool allocated = false;
  bool is_small = false;
  Block* prev = nullptr; // neighbours in the same segment (split blocks)
  Block* next = nullptr;
  std::vector<StreamId> stream_uses; // other streams that used the block
  int pending_events = 0;
};

struct BlockLess {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream_id != b->stream_id) {
      return a->stream_id < b->stream_id;
    }
    if (a->size != b->size) {
      return a->size < b->size;
    }
    return reinterpret_cast<uintptr_t>(a->ptr) < reinterpret_cast<uintptr_t>(b->ptr);
  }
};

using FreeList = std::set<Block*, BlockLess>;

size_t roundSize(size_t size) {
  if (size < kMinBlockSize) {
    return kMinBlockSize;
  }
  const size_t rounded = kMinBlockSize * ((size + kMinBlockSize - 1) / kMinBlockSize);
  return rounded < size ? size : rounded; // overflow: keep the absurd size
}

StatTypes statTypesOf(const Block* block) {
  StatTypes types = {false};
  types[static_cast<size_t>(StatType::AGGREGATE)] = true;
  types[static_cast<size_t>(block->is_small ? StatType::SMALL_POOL : StatType::LARGE_POOL)] = true;
  return types;
}

// Applies `f` to the stat-type indices a block counts under: the aggregate
// and its pool (small or large).
template <typename F>
void forEachPoolOf(const Block* block, F&& f) {
  c10::CachingAllocator::for_each_selected_stat_type(statTypesOf(block), f);
}

// Everything the allocator knows about one device, guarded by `mutex`.
class DeviceCache {
 public:
  explicit DeviceCache(DeviceIndex device) : device_(device) {}

  Block* malloc(size_t requested, const KilnStream& stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    processEvents();
    const size_t size = roundSize(requested);
    const bool is_small = size <= kSmallSize;
    FreeList& pool = is_small ? small_free_ : large_free_;

    Block* block = takeCached(pool, stream.id(), size);
    if (block == nullptr) {
      if (!is_small) {
        releaseSmallerSegments(stream.id(), size);
      }
      block = allocateSegment(requested, is_small ? kSmallSegment : size, is_small, stream);
    }
    splitIfLarger(block, size);
    clearFailedResult(block->ptr); // new contents (Note [Results of failed kernels])
    block->allocated = true;
    block->requested = requested;
    block->stream_uses.clear();
    forEachPoolOf(block, [&](size_t t) {
      stats_.allocation[t].increase(1);
      stats_.allocated_bytes[t].increase(block->size);
      stats_.active[t].increase(1);
      stats_.active_bytes[t].increase(block->size);
      stats_.requested_bytes[t].increase(block->requested);
    });
    return block;
  }

  void free(Block* block) {
    std::lock_guard<std::mutex> lock(mutex_);
    block->allocated = false;
    forEachPoolOf(block, [&](size_t t) {
      stats_.allocation[t].decrease(1);
      stats_.allocated_bytes[t].decrease(block->size);
      stats_.requested_bytes[t].decrease(block->requested);
    });
    if (!block->stream_uses.empty()) {
      // Note [Kiln caching allocator]: wait for the other streams' work.
      for (const StreamId id : block->stream_uses) {
        KilnEvent event;
        event.record(KilnStream(Stream(Stream::UNSAFE, Device(DeviceType::PrivateUse1, device_), id)));
        pending_.emplace_back(std::move(event), block);
        block->pending_events++;
      }
      block->stream_uses.clear();
      return;
    }
    deactivate(block);
  }

  void recordStream(Block* block, const KilnStream& stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stream.id() == block->stream_id ||
        std::find(block->stream_uses.begin(), block->stream_uses.end(), stream.id()) !=
            block->stream_uses.end()) {
      return;
    }
    block->stream_uses.push_back(stream.id());
  }

  void emptyCache() {
    std::lock_guard<std::mutex> lock(mutex_);
    releaseAllCached();
  }

  DeviceStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  void resetPeak() {
    std::lock_guard<std::mutex> lock(mutex_);
    forEachCounter([](Stat& stat) { stat.reset_peak(); });
  }

  void resetAccumulated() {
    std::lock_guard<std::mutex> lock(mutex_);
    forEachCounter([](Stat& stat) { stat.reset_accumulated(); });
    stats_.num_alloc_retries = 0;
    stats_.num_ooms = 0;
    stats_.num_sync_all_streams = 0;
    stats_.num_device_alloc = 0;
    stats_.num_device_free = 0;
  }

 private:
  // Applies `f` to every Stat of stats_ (each pool type of each StatArray).
  template <typename F>
  void forEachCounter(F&& f) {
    for (auto* array : {&stats_.allocation, &stats_.segment, &stats_.active,
                        &stats_.inactive_split, &stats_.allocated_bytes, &stats_.reserved_bytes,
                        &stats_.active_bytes, &stats_.inactive_split_bytes,
                        &stats_.requested_bytes}) {
      for (Stat& stat : *array) {
        f(stat);
      }
    }
    f(stats_.oversize_allocations);
    f(stats_.oversize_segments);
  }

  // Best fit among the stream's free blocks of the pool.
  Block* takeCached(FreeList& pool, StreamId stream_id, size_t size) {
    Block key;
    key.stream_id = stream_id;
    key.size = size;
    key.ptr = nullptr;
    auto it = pool.lower_bound(&key);
    if (it == pool.end() || (*it)->stream_id != stream_id) {
      return nullptr;
    }
    Block* block = *it;
    eraseFree(block);
    return block;
  }

  // Leaves `block` with `size` bytes and returns the rest, if large enough to
  // be worth keeping apart, to the free list as a block of its own.
  void splitIfLarger(Block* block, size_t size) {
    const size_t rest = block->size - size;
    if (rest < kMinBlockSize || (!block->is_small && rest <= kMinLargeSplit)) {
      return;
    }
    auto* remaining = new Block();
    remaining->device = block->device;
    remaining->stream_id = block->stream_id;
    remaining->size = rest;
    remaining->ptr = static_cast<char*>(block->ptr) + size;
    remaining->is_small = block->is_small;
    remaining->prev = block;
    remaining->next = block->next;
    if (block->next != nullptr) {
      block->next->prev = remaining;
    }
    block->next = remaining;
    block->size = size;
    insertFree(remaining);
  }

  static bool isSplit(const Block* block) {
    return block->prev != nullptr || block->next != nullptr;
  }

  // A neighbour that may merge: neither allocated nor waiting for events
  // (so it is in its free list).
  static bool isFree(const Block* block) {
    return block != nullptr && !block->allocated && block->pending_events == 0;
  }

  void insertFree(Block* block) {
    (block->is_small ? small_free_ : large_free_).insert(block);
    if (isSplit(block)) {
      forEachPoolOf(block, [&](size_t t) {
        stats_.inactive_split[t].increase(1);
        stats_.inactive_split_bytes[t].increase(block->size);
      });
    }
  }

  void eraseFree(Block* block) {
    (block->is_small ? small_free_ : large_free_).erase(block);
    if (isSplit(block)) {
      forEachPoolOf(block, [&](size_t t) {
        stats_.inactive_split[t].decrease(1);
        stats_.inactive_split_bytes[t].decrease(block->size);
      });
    }
  }

  // Absorbs the free neighbour `other` (block->prev or block->next).
  void mergeInto(Block* block, Block* other) {
    eraseFree(other);
    if (other == block->prev) {
      block->ptr = other->ptr;
      block->prev = other->prev;
      if (block->prev != nullptr) {
        block->prev->next = block;
      }
    } else {
      block->next = other->next;
      if (block->next != nullptr) {
        block->next->prev = block;
      }
    }
    block->size += other->size;
    delete other;
  }

  Block* allocateSegment(size_t requested, size_t size, bool is_small, const KilnStream& stream) {
    void* ptr = nullptr;
    kilnError_t status = runtimeMalloc(&ptr, size);
    if (status == kilnErrorMemoryAllocation) {
      // Release the cache and retry once (Note [Kiln caching allocator]).
      stats_.num_alloc_retries++;
      releaseAllCached();
      status = runtimeMalloc(&ptr, size);
    }
    const size_t block_size = roundSize(requested);
    if (status == kilnErrorMemoryAllocation && is_small && block_size < size) {
      // No room for a whole small-pool segment (a device smaller than one,
      // or nearly full): a segment of just this block.
      size = block_size;
      status = runtimeMalloc(&ptr, size);
    }
    if (status == kilnErrorMemoryAllocation) {
      stats_.num_ooms++;
      raiseOutOfMemory(requested, size);
    }
    KILN_CHECK(status);
    auto* block = new Block();
    block->device = device_;
    block->stream_id = stream.id();
    block->size = size;
    block->ptr = ptr;
    block->is_small = is_small;
    stats_.num_device_alloc++;
    forEachPoolOf(block, [&](size_t t) {
      stats_.segment[t].increase(1);
      stats_.reserved_bytes[t].increase(size);
    });
    return block;
  }

  kilnError_t runtimeMalloc(void** ptr, size_t size) {
    int previous = 0;
    KILN_CHECK(kilnGetDevice(&previous));
    if (previous != device_) {
      KILN_CHECK(kilnSetDevice(device_));
    }
    const kilnError_t status = kilnMalloc(ptr, size);
    if (previous != device_) {
      KILN_WARN(kilnSetDevice(previous));
    }
    return status;
  }

  // `attempted`: the bytes last asked of the runtime for `requested` (the
  // rounded block), which is what must fit in the device's free memory.
  [[noreturn]] void raiseOutOfMemory(size_t requested, size_t attempted) {
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    {
      int previous = 0;
      KILN_WARN(kilnGetDevice(&previous));
      KILN_WARN(kilnSetDevice(device_));
      KILN_WARN(kilnMemGetInfo(&free_bytes, &total_bytes));
      KILN_WARN(kilnSetDevice(previous));
    }
    const auto agg = static_cast<size_t>(StatType::AGGREGATE);
    const auto allocated = static_cast<uint64_t>(stats_.allocated_bytes[agg].current);
    const auto reserved = static_cast<uint64_t>(stats_.reserved_bytes[agg].current);
    c10::reportOutOfMemoryToProfiler(
        static_cast<int64_t>(requested), allocated, reserved,
        Device(DeviceType::PrivateUse1, device_));
    // "200.00 KiB (204800 bytes)", "16 bytes"
    const auto bytes = [](size_t n) {
      return n < 1024 ? format_size(n) : c10::str(format_size(n), " (", n, " bytes)");
    };
    const std::string block =
        attempted == requested
            ? std::string()
            : c10::str(", which takes a block of ", bytes(attempted),
                       " (the allocator rounds requests up to multiples of ", kMinBlockSize,
                       " bytes)");
    TORCH_CHECK_WITH(
        OutOfMemoryError, attempted > free_bytes,
        "Kiln out of memory: the host could not provide ", bytes(attempted),
        " for kiln:", static_cast<int>(device_), " although the device reports ",
        format_size(free_bytes), " free of its ", format_size(total_bytes),
        " capacity. The reference device keeps its memory in host RAM: set KILN_DEVICE_MEMORY to "
        "what this machine can hold, or free host memory.");
    TORCH_CHECK_WITH(
        OutOfMemoryError, false,
        "Kiln out of memory. Tried to allocate ", bytes(requested), " on kiln:",
        static_cast<int>(device_), block,
        ". The device has a total capacity of ",
        format_size(total_bytes), " of which ", format_size(free_bytes),
        " is free. Of the memory in use, ", format_size(allocated),
        " is allocated by PyTorch, and ", format_size(reserved > allocated ? reserved - allocated : 0),
        " is reserved by PyTorch but unallocated. Free tensors you no longer need, "
        "use smaller batches, or raise the capacity with KILN_DEVICE_MEMORY (e.g. KILN_DEVICE_MEMORY=32GiB).");
  }

  // A block no longer allocated and not waited on joins its free list,
  // merged with its free neighbours.
  void deactivate(Block* block) {
    forEachPoolOf(block, [&](size_t t) {
      stats_.active[t].decrease(1);
      stats_.active_bytes[t].decrease(block->size);
    });
    if (isFree(block->prev)) {
      mergeInto(block, block->prev);
    }
    if (isFree(block->next)) {
      mergeInto(block, block->next);
    }
    insertFree(block);
  }

  void processEvents() {
    while (!pending_.empty()) {
      auto& [event, block] = pending_.front();
      if (!event.query()) {
        break;
      }
      if (--block->pending_events == 0) {
        deactivate(block);
      }
      pending_.pop_front();
    }
  }

  // A large request found no free block big enough: the stream's whole free
  // large segments are all smaller, and would stay reserved beside the new
  // segment. Return them to the runtime first, so reserved memory tracks
  // the working set (this waits for the device, like empty_cache; it happens
  // while a program's allocation pattern settles, typically in its first
  // steps).
  void releaseSmallerSegments(StreamId stream_id, size_t size) {
    std::vector<Block*> whole;
    for (Block* block : large_free_) {
      if (block->stream_id == stream_id && !isSplit(block) && block->size < size) {
        whole.push_back(block);
      }
    }
    if (whole.empty()) {
      return;
    }
    stats_.num_sync_all_streams++;
    for (Block* block : whole) {
      large_free_.erase(block);
      releaseSegment(block);
    }
  }

  void releaseSegment(Block* block) {
    KILN_CHECK(kilnFree(block->ptr)); // waits for the device (see runtime.h)
    stats_.num_device_free++;
    forEachPoolOf(block, [&](size_t t) {
      stats_.segment[t].decrease(1);
      stats_.reserved_bytes[t].decrease(block->size);
    });
    delete block;
  }

  // Waits for the blocks held back by other streams' work (record_stream),
  // caches them, then returns every whole free segment to the runtime.
  void releaseAllCached() {
    for (auto& [event, block] : pending_) {
      event.synchronize();
      if (--block->pending_events == 0) {
        deactivate(block);
      }
    }
    pending_.clear();
    releaseCached(small_free_);
    releaseCached(large_free_);
  }

  // Returns the pool's whole free segments to the runtime (a segment with
  // an allocated block stays).
  void releaseCached(FreeList& pool) {
    bool released = false;
    for (auto it = pool.begin(); it != pool.end();) {
      Block* block = *it;
      if (isSplit(block)) {
        ++it;
        continue;
      }
      if (!released) {
        stats_.num_sync_all_streams++;
        released = true;
      }
      it = pool.erase(it);
      releaseSegment(block);
    }
  }

  const DeviceIndex device_;
  std::mutex mutex_;
  FreeList small_free_;
  FreeList large_free_;
  std::deque<std::pair<KilnEvent, Block*>> pending_;
  DeviceStats stats_;
};

DeviceCache& deviceCache(DeviceIndex device) {
  // Leaked on purpose: blocks may be freed during static destruction.
  static DeviceCache** caches = [] {
    auto** all = new DeviceCache*[kMaxDevices];
    for (const auto i : c10::irange(kMaxDevices)) {
      all[i] = new DeviceCache(static_cast<DeviceIndex>(i));
    }
    return all;
  }();
  return *caches[device];
}

void deleteBlock(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  deviceCache(block->device).free(block);
}

class KilnDeviceAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const DeviceIndex device = current_device();
    check_device_index(device);
    if (n == 0) {
      return c10::DataPtr(nullptr, Device(DeviceType::PrivateUse1, device));
    }
    Block* block = deviceCache(device).malloc(n, getCurrentKilnStream(device));
    return c10::DataPtr(block->ptr, block, &deleteBlock,
                        Device(DeviceType::PrivateUse1, device));
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    KILN_CHECK(kilnMemcpy(dest, src, count, kilnMemcpyDeviceToDevice));
  }

  bool initialized() override {
    return true;
  }

  void emptyCache(MempoolId_t /*mempool_id*/) override {
    KilnCachingAllocator::emptyCache();
  }

  void recordStream(const DataPtr& ptr, c10::Stream stream) override {
    KilnCachingAllocator::recordStream(ptr, KilnStream(stream));
  }

  DeviceStats getDeviceStats(DeviceIndex device) override {
    return KilnCachingAllocator::getDeviceStats(device);
  }

  void resetAccumulatedStats(DeviceIndex device) override {
    KilnCachingAllocator::resetAccumulatedStats(device);
  }

  void resetPeakStats(DeviceIndex device) override {
    KilnCachingAllocator::resetPeakStats(device);
  }

  std::pair<size_t, size_t> getMemoryInfo(DeviceIndex device) override {
    return KilnCachingAllocator::getMemoryInfo(device);
  }
};

KilnDeviceAllocator g_allocator;

} // namespace

c10::DeviceAllocator* get() {
  return &g_allocator;
}

void recordStream(const c10::DataPtr& data_ptr, const KilnStream& stream) {
  if (data_ptr.get_deleter() != &deleteBlock || data_ptr.get_context() == nullptr) {
    return;
  }
  auto* block = static_cast<Block*>(data_ptr.get_context());
  deviceCache(block->device).recordStream(block, stream);
}

void emptyCache() {
  const DeviceIndex count = device_count();
  for (const auto device : c10::irange(count)) {
    deviceCache(device).emptyCache();
  }
}

c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex device) {
  check_device_index(device);
  return deviceCache(device).stats();
}

void resetPeakStats(DeviceIndex device) {
  check_device_index(device);
  deviceCache(device).resetPeak();
}

void resetAccumulatedStats(DeviceIndex device) {
  check_device_index(device);
  deviceCache(device).resetAccumulated();
}

std::pair<size_t, size_t> getMemoryInfo(DeviceIndex device) {
  check_device_index(device);
  const DeviceIndex previous = exchange_device(device);
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  const kilnError_t status = kilnMemGetInfo(&free_bytes, &total_bytes);
  KILN_WARN(kilnSetDevice(previous));
  KILN_CHECK(status);
  return {free_bytes, total_bytes};
}

REGISTER_ALLOCATOR(DeviceType::PrivateUse1, &g_allocator);

} // namespace c10::kiln::KilnCachingAllocator
