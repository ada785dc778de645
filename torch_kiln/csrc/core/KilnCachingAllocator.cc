// The stream-ordered caching allocator for kiln device memory.
#include "core/KilnCachingAllocator.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_set>
#include <vector>

#include <c10/core/Allocator.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <c10/util/flat_hash_map.h>
#include <c10/util/irange.h>

#include "core/FailedResults.h"
#include "core/KilnEvent.h"
#include "core/KilnGraph.h"
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
//  * Per-process memory fraction. set_per_process_memory_fraction(f) caps
//    what the device's allocator may reserve at f * capacity, as CUDA's
//    allowed_memory_maximum does: a new segment that would pass the cap is
//    treated like a runtime out-of-memory (release the cache, retry once,
//    then raise naming the cap). Only new segments are checked, so the hot
//    path (a cached block) never looks at it.

// Note [Kiln memory history]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch.kiln.memory._record_memory_history / _snapshot are CUDA's memory
// snapshot tools (c10/cuda/CUDACachingAllocator.cpp, recordHistory and
// snapshot) on kiln, producing the same dictionaries so PyTorch's
// torch.cuda._memory_viz and the pytorch.org/memory_viz page read them:
//  * Segments are remembered in `segments_` (a Segment per runtime allocation,
//    pointing at its lowest-address block), so a snapshot can walk every
//    block, allocated or free, without a registry of live blocks on the hot
//    path. Splits and merges keep Segment::head current.
//  * While recording, every allocator action appends a c10 TraceEntry to the
//    device's ring buffer (the newest max_entries survive): alloc,
//    free_requested, free_completed (at once, or when record_stream's events
//    completed), segment_alloc, segment_free, oom, snapshot. The order is the
//    one the visualizer replays: a segment_alloc before the allocs inside it,
//    every free_completed of a segment before its segment_free.
//  * Stack contexts come from a CreateContextFn that the Python layer
//    registers (torch's CapturedTraceback::gather, as CUDA's bindings do).
//    The allocator calls it before taking its mutex, since gathering Python
//    frames takes the GIL: lock order is always GIL -> allocator mutex.
//    CapturedTraceback only takes the GIL on threads Python knows, so a free
//    on a stream worker (a task holding the last reference) records no
//    Python frames instead of waiting for the GIL; and contexts release their
//    frames without the GIL. So the allocator itself never calls into Python.
//  * When recording is off, malloc and free pay one relaxed atomic load and
//    branch (maybeGatherContext) plus one predictable branch per trace site.

// Note [Graph memory pools]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A kiln graph's replay writes the addresses its capture allocated, so that
// memory must stay the graph's (CUDA's private pools, CUDACachingAllocator's
// beginAllocateToPool). While a capture is underway, allocations on the
// capturing stream are tagged with the pool's *key*, a negative StreamId that
// no real stream has, instead of the stream's id. Free lists are ordered by
// that id, so pool blocks are only ever handed out to allocations of the
// same pool — during this capture (in stream order, like the replays), or a
// later capture sharing the pool (pool=, graph_pool_handle()) — and tensors
// freed during or after the capture return their blocks to the pool, never
// to ordinary allocations. A block remembers its real stream for
// record_stream. While a pool is in use (use count > 0: its graphs, and a
// capture underway), its free segments are never given back to the runtime
// (empty_cache, releasing smaller segments, the out-of-memory retry), since
// a graph may still write them. When the last use is released (graph reset
// or destroyed), its free segments are released at the next empty_cache,
// as CUDA frees freeable pools in release_cached_blocks.

// Note [User memory pools]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// torch.kiln.MemPool and use_mem_pool are CUDA's MemPool and use_mem_pool:
// inside `with use_mem_pool(pool)`, the calling thread's allocations on the
// pool's device come from that pool, and blocks freed later (on any thread)
// go back to it, never to ordinary allocations. They reuse the graph pools'
// mechanism with one difference: a user pool keeps a key per (pool, stream),
// made on the stream's first allocation into the pool, so a block is only
// reused on the stream it was allocated on, exactly as outside a pool (a
// graph's pool has one key, since its capture runs on one stream and its
// replays are ordered by the user). Pools are numbered as CUDA's ({0, n}
// for MemPools, {n, 0} for graph pools); only numbers handed out here are
// accepted by captures. Use counts are CUDA's: 1 for the MemPool object,
// one more per active use_mem_pool and per graph holding the pool. While
// in use, a pool's free segments stay reserved (empty_cache keeps them);
// when the MemPool is destroyed they go back to the runtime. The options:
// no_split pools never split a block (a request takes a whole cached block
// or a segment of its own rounded size); a use_on_oom pool lends its free
// blocks (of the same stream) to an ordinary allocation that would
// otherwise fail with out-of-memory, after the cache was released. A graph
// capture underway on the current stream takes precedence over the thread's
// pool. Custom allocators (MemPool(allocator=...)) are not supported.

namespace {

using c10::CachingAllocator::format_size;
using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatType;
using c10::CachingAllocator::StatTypes;
using c10::CachingDeviceAllocator::BlockInfo;
using c10::CachingDeviceAllocator::DeviceStats;

constexpr size_t kMinBlockSize = 512;      // allocation granularity (bytes)
constexpr size_t kSmallSize = 256 << 10;    // largest request of the small pool
constexpr size_t kSmallSegment = 1 << 20;   // size of a small-pool segment
constexpr size_t kMinLargeSplit = kSmallSize; // a large block splits if more is left
constexpr int kMaxDevices = 64;
constexpr size_t kNumTraceActions = static_cast<size_t>(TraceEntry::OOM) + 1;

using c10::GatheredContext;
using Context = std::shared_ptr<GatheredContext>;

struct Segment;

struct Block {
  DeviceIndex device = 0;
  StreamId stream_id = 0; // the stream's id, or a graph pool's key (Note [Graph memory pools])
  StreamId real_stream = 0; // the stream it was allocated on
  size_t size = 0;      // bytes reserved from the runtime (rounded)
  size_t requested = 0; // bytes the client asked for
  void* ptr = nullptr;
  bool allocated = false;
  bool is_small = false;
  Block* prev = nullptr; // neighbours in the same segment (split blocks)
  Block* next = nullptr;
  std::vector<StreamId> stream_uses; // other streams that used the block
  int pending_events = 0;
  Segment* segment = nullptr; // the runtime allocation this block is part of
  Context context_when_allocated; // only while recording with a context
};

// One runtime allocation (kilnMalloc), split into blocks head, head->next, ...
struct Segment {
  Block* head = nullptr; // the block at the segment's start address
  StreamId stream_id = 0;   // the stream's id, or a pool's key
  StreamId real_stream = 0; // the stream it was allocated on
  size_t size = 0;
  bool is_small = false;
  Context context_when_allocated;
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

// The user pools the calling thread allocates to (use_mem_pool), as
// (device, pool id), innermost last (Note [User memory pools]).
thread_local std::vector<std::pair<DeviceIndex, MempoolId_t>> t_pool_routes;

// caching_allocator_enable (read without a lock on malloc's path).
std::atomic<bool> g_caching_enabled{true};

// Everything the allocator knows about one device, guarded by `mutex`.
class DeviceCache {
 public:
  explicit DeviceCache(DeviceIndex device) : device_(device) {}

  Block* malloc(size_t requested, const KilnStream& stream) {
    // Before the lock: gathering may take the GIL (Note [Kiln memory history]).
    Context context = maybeGatherContext(RecordContext::STATE);
    std::lock_guard<std::mutex> lock(mutex_);
    processEvents(context);
    const size_t size = roundSize(requested);
    const bool is_small = size <= kSmallSize;
    FreeList& pool = is_small ? small_free_ : large_free_;
    StreamId key = C10_UNLIKELY(capturing_.load(std::memory_order_relaxed))
        ? keyForCapturingStream(stream)
        : stream.id();
    if (key == stream.id() && C10_UNLIKELY(!t_pool_routes.empty())) {
      key = keyForThreadRoute(stream.id());
    }
    // Not caching (caching_allocator_enable(False)) applies to ordinary
    // allocations only; pools keep their blocks.
    const bool uncached =
        key == stream.id() && C10_UNLIKELY(!g_caching_enabled.load(std::memory_order_relaxed));

    Block* block = uncached ? nullptr : takeCached(pool, key, size);
    if (block == nullptr) {
      const bool whole = uncached || isNoSplitKey(key);
      if (uncached) {
        releaseAllCached(context); // what was freed since the last allocation
      } else if (!is_small && key == stream.id()) {
        releaseSmallerSegments(stream.id(), size, context);
      }
      block = allocateSegment(requested, whole ? size : (is_small ? kSmallSegment : size),
                              is_small, stream, key, context);
    }
    block->real_stream = stream.id();
    if (!uncached && !isNoSplitKey(block->stream_id)) {
      splitIfLarger(block, size);
    }
    clearFailedResult(block->ptr); // new contents (Note [Results of failed kernels])
    block->allocated = true;
    block->requested = requested;
    block->stream_uses.clear();
    recordTrace(TraceEntry::ALLOC, block->ptr, requested, block->stream_id, context);
    block->context_when_allocated = std::move(context);
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
    Context context = maybeGatherContext(RecordContext::ALL);
    std::lock_guard<std::mutex> lock(mutex_);
    block->allocated = false;
    forEachPoolOf(block, [&](size_t t) {
      stats_.allocation[t].decrease(1);
      stats_.allocated_bytes[t].decrease(block->size);
      stats_.requested_bytes[t].decrease(block->requested);
    });
    recordTrace(TraceEntry::FREE_REQUESTED, block->ptr, block->requested, block->stream_id,
                context, block->context_when_allocated);
    if (!block->stream_uses.empty()) {
      if (C10_UNLIKELY(anyCaptureUnderway())) {
        // An event recorded on a capturing stream marks a point in a graph
        // and can never be queried: wait to record until no capture is
        // underway (CUDA's needs_events_deferred_until_no_capture). Until
        // then the block counts one pending event, so it is neither reused
        // nor merged into a free neighbour.
        deferred_.push_back(block);
        block->pending_events = 1;
        return;
      }
      if (insertEvents(block) > 0) {
        return;
      }
    }
    deactivate(block, context);
  }

  // Note [Kiln caching allocator]: records an event on every other stream
  // that used `block`, so its reuse waits for their work; returns how many.
  // mutex_ held.
  int insertEvents(Block* block) {
    for (const StreamId id : block->stream_uses) {
      const KilnStream stream(Stream(Stream::UNSAFE, Device(DeviceType::PrivateUse1, device_), id));
      if (isExternalStreamGone(stream)) {
        continue; // destroying a stream waits for its work: nothing to wait for
      }
      KilnEvent event;
      event.record(stream);
      pending_.emplace_back(std::move(event), block);
      block->pending_events++;
    }
    block->stream_uses.clear();
    return block->pending_events;
  }

  void recordStream(Block* block, const KilnStream& stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stream.id() == block->real_stream ||
        std::find(block->stream_uses.begin(), block->stream_uses.end(), stream.id()) !=
            block->stream_uses.end()) {
      return;
    }
    block->stream_uses.push_back(stream.id());
  }

  void emptyCache() {
    Context context = maybeGatherContext(RecordContext::ALL);
    std::lock_guard<std::mutex> lock(mutex_);
    releaseAllCached(context);
  }

  // Note [Graph memory pools].
  void beginAllocateToPool(MempoolId_t id, StreamId stream, unsigned long long capture_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& capture : captures_) {
      TORCH_CHECK(capture.stream != stream, "kiln:", static_cast<int>(device_),
                  " stream ", stream, " is already allocating to a graph memory pool (a capture is "
                  "underway on it)");
    }
    PrivatePool& pool = poolFor(id);
    pool.use_count++;
    captures_.push_back(CaptureRoute{stream, capture_id, pool.key});
    capturing_.store(true, std::memory_order_relaxed);
  }

  // Note [User memory pools].
  void createOrIncrefPool(MempoolId_t id, bool no_split, bool use_on_oom) {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool created = pools_.find(id) == pools_.end();
    PrivatePool& pool = poolFor(id);
    if (created) {
      pool.no_split = no_split;
      pool.use_on_oom = use_on_oom;
    }
    pool.use_count++;
  }

  int poolUseCount(MempoolId_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = pools_.find(id);
    return it == pools_.end() ? 0 : it->second.use_count;
  }

  // Returns the whole free segments of pool `id` to the runtime, unless the
  // pool is in use.
  void emptyPoolCache(MempoolId_t id) {
    Context context = maybeGatherContext(RecordContext::ALL);
    std::lock_guard<std::mutex> lock(mutex_);
    if (pools_.find(id) != pools_.end()) {
      return;
    }
    releaseCached(small_free_, context, &id);
    releaseCached(large_free_, context, &id);
  }

  void endAllocateToPool(MempoolId_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = pools_.find(id);
    if (it == pools_.end()) {
      return;
    }
    for (auto c = captures_.begin(); c != captures_.end(); ++c) {
      if (c->key == it->second.key) {
        captures_.erase(c);
        break;
      }
    }
    capturing_.store(!captures_.empty(), std::memory_order_relaxed);
  }

  void releasePool(MempoolId_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = pools_.find(id);
    TORCH_CHECK(it != pools_.end() && it->second.use_count > 0, "kiln:",
                static_cast<int>(device_), " has no graph memory pool (", id.first, ", ",
                id.second, ") in use to release");
    if (--it->second.use_count == 0) {
      pools_.erase(it); // its blocks keep the key; releaseCached frees them now
    }
  }

  // Note [Kiln caching allocator], per-process memory fraction.
  void setMemoryFraction(double fraction, size_t capacity) {
    std::lock_guard<std::mutex> lock(mutex_);
    fraction_ = fraction;
    if (fraction < 1.0) {
      limit_ = static_cast<size_t>(fraction * static_cast<double>(capacity));
    } else {
      limit_.reset();
    }
  }

  double memoryFraction() {
    std::lock_guard<std::mutex> lock(mutex_);
    return fraction_;
  }

  // Note [Kiln memory history].
  void recordHistory(bool enabled, CreateContextFn recorder, size_t max_entries,
                     RecordContext when, bool clear_history,
                     const std::array<bool, kNumTraceActions>& skip) {
    std::lock_guard<std::mutex> lock(mutex_);
    record_history_ = enabled;
    skip_actions_ = skip;
    context_recorder_.store(enabled ? recorder : nullptr);
    record_context_.store(static_cast<int>(enabled ? when : RecordContext::NEVER),
                          std::memory_order_relaxed);
    max_entries = std::max<size_t>(1, max_entries);
    if (!enabled || clear_history) {
      trace_.clear();
      trace_next_ = 0;
    } else if (max_entries != trace_max_) {
      std::vector<TraceEntry> kept = traceEntries();
      if (kept.size() > max_entries) {
        kept.erase(kept.begin(), kept.end() - static_cast<std::ptrdiff_t>(max_entries));
      }
      trace_ = std::move(kept);
      trace_next_ = 0;
    }
    trace_max_ = max_entries;
  }

  // Appends the device's segments (of pool `pool` only, unless it is
  // {0, 0}), each with its blocks in address order.
  void snapshot(std::vector<SegmentInfo>& out, MempoolId_t pool) {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t total_active = 0;
    const bool all_pools = pool == MempoolId_t{0, 0};
    for (const Segment* segment : segments_) {
      const MempoolId_t owner = ownerOfKey(segment->stream_id);
      if (!all_pools && owner != pool) {
        continue;
      }
      SegmentInfo& info = out.emplace_back();
      info.device = device_;
      info.address = reinterpret_cast<size_t>(segment->head->ptr);
      info.stream = reinterpret_cast<void*>(static_cast<intptr_t>(segment->real_stream));
      info.owner_private_pool_id = owner;
      info.is_large = !segment->is_small;
      info.context_when_allocated = segment->context_when_allocated;
      for (const Block* block = segment->head; block != nullptr; block = block->next) {
        BlockInfo& b = info.blocks.emplace_back();
        b.size = block->size;
        b.requested_size = block->allocated || block->pending_events > 0 ? block->requested : 0;
        b.allocated = block->allocated;
        b.active = block->allocated || block->pending_events > 0;
        b.context_when_allocated = block->context_when_allocated;
        info.total_size += b.size;
        if (b.allocated) {
          info.allocated_size += b.size;
        }
        if (b.active) {
          info.active_size += b.size;
          info.requested_size += b.requested_size;
        }
      }
      total_active += info.active_size;
    }
    recordTrace(TraceEntry::SNAPSHOT, nullptr, total_active, 0, nullptr);
  }

  // The recorded trace, oldest first, with times in microseconds since the epoch.
  std::vector<TraceEntry> trace(const std::function<time_t(approx_time_t)>& to_ns) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<TraceEntry> result = traceEntries();
    for (TraceEntry& entry : result) {
      entry.time_.t_ = to_ns(entry.time_.approx_t_) / 1000;
    }
    return result;
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

  // Note [Kiln memory history]: the context of this call if recording at
  // `level` or above. Call without holding mutex_.
  Context maybeGatherContext(RecordContext level) {
    if (C10_LIKELY(record_context_.load(std::memory_order_relaxed) < static_cast<int>(level))) {
      return nullptr;
    }
    const CreateContextFn recorder = context_recorder_.load();
    return recorder != nullptr ? recorder() : nullptr;
  }

  // Appends to the trace while recording (mutex_ held), with `context`, or
  // `fallback` if there is none (a free shows its allocation's stack unless
  // frees gather their own, as on CUDA).
  void recordTrace(TraceEntry::Action action, const void* addr, size_t size, StreamId stream_id,
                   const Context& context, const Context& fallback = Context()) {
    if (C10_LIKELY(!record_history_)) {
      return;
    }
    recordTraceSlow(action, reinterpret_cast<size_t>(addr), size, stream_id,
                    context ? context : fallback);
  }

  C10_NOINLINE void recordTraceSlow(TraceEntry::Action action, size_t addr, size_t size,
                                    StreamId stream_id, const Context& context) {
    if (skip_actions_[static_cast<size_t>(action)]) {
      return;
    }
    const bool with_context =
        record_context_.load(std::memory_order_relaxed) >= static_cast<int>(RecordContext::ALLOC);
    TraceEntry entry(action, device_, addr, size,
                     reinterpret_cast<void*>(static_cast<intptr_t>(stream_id)),
                     MempoolId_t{0, 0}, c10::getApproximateTime(),
                     with_context ? context : nullptr);
    if (trace_.size() < trace_max_) {
      trace_.push_back(std::move(entry));
      return;
    }
    trace_[trace_next_] = std::move(entry);
    if (++trace_next_ == trace_max_) {
      trace_next_ = 0;
    }
  }

  // The ring buffer's entries, oldest first (mutex_ held).
  std::vector<TraceEntry> traceEntries() const {
    std::vector<TraceEntry> result;
    result.reserve(trace_.size());
    result.insert(result.end(), trace_.begin() + static_cast<std::ptrdiff_t>(trace_next_), trace_.end());
    result.insert(result.end(), trace_.begin(), trace_.begin() + static_cast<std::ptrdiff_t>(trace_next_));
    return result;
  }

  // A stream handed to torch.kiln.ExternalStream that its owner has destroyed
  // since. (Pool and default streams are never destroyed.)
  static bool isExternalStreamGone(const KilnStream& stream) {
    if (!stream.is_external()) {
      return false;
    }
    int device = 0;
    return kilnStreamGetDevice(stream.stream(), &device) != kilnSuccess;
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
    remaining->real_stream = block->real_stream;
    remaining->size = rest;
    remaining->ptr = static_cast<char*>(block->ptr) + size;
    remaining->is_small = block->is_small;
    remaining->segment = block->segment;
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
      if (block->segment->head == other) {
        block->segment->head = block;
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

  // The pool key a stream capturing into a pool allocates with — the stream
  // that began the capture, or one that joined it (Note [Cross-stream
  // capture] in runtime/src/graph.cc) — or the stream's id (Note [Graph
  // memory pools]). mutex_ held.
  StreamId keyForCapturingStream(const KilnStream& stream) const {
    for (const CaptureRoute& capture : captures_) {
      if (capture.stream == stream.id()) {
        return capture.key;
      }
    }
    kilnStreamCaptureStatus status = kilnStreamCaptureStatusNone;
    unsigned long long capture_id = 0;
    KILN_CHECK(kilnStreamGetCaptureInfo(stream.stream(), &status, &capture_id));
    if (status != kilnStreamCaptureStatusNone) {
      for (const CaptureRoute& capture : captures_) {
        if (capture.capture_id == capture_id) {
          return capture.key;
        }
      }
    }
    return stream.id();
  }

  // The key the calling thread's innermost route to a pool of this device
  // allocates with on `stream` (made on first use), or the stream's id if
  // the thread routes nothing here (Note [User memory pools]). mutex_ held.
  StreamId keyForThreadRoute(StreamId stream) {
    for (auto route = t_pool_routes.rbegin(); route != t_pool_routes.rend(); ++route) {
      if (route->first != device_) {
        continue;
      }
      const auto it = pools_.find(route->second);
      if (it == pools_.end()) {
        break; // released while routed: allocate normally
      }
      for (const auto& [real, key] : it->second.stream_keys) {
        if (real == stream) {
          return key;
        }
      }
      const StreamId key = newKey(route->second);
      it->second.stream_keys.emplace_back(stream, key);
      return key;
    }
    return stream;
  }

  // The pool `id` of this device, created (use count 0) if missing. mutex_ held.
  struct PrivatePool;
  PrivatePool& poolFor(MempoolId_t id) {
    auto it = pools_.find(id);
    if (it == pools_.end()) {
      it = pools_.emplace(id, PrivatePool{}).first;
      it->second.key = newKey(id);
    }
    return it->second;
  }

  StreamId newKey(MempoolId_t id) {
    const StreamId key = next_pool_key_--;
    key_owner_.emplace(key, id);
    return key;
  }

  // The pool a key was made for ({0, 0} for a stream's id).
  MempoolId_t ownerOfKey(StreamId key) const {
    if (key >= 0) {
      return {0, 0};
    }
    const auto it = key_owner_.find(key);
    return it == key_owner_.end() ? MempoolId_t{0, 0} : it->second;
  }

  // The pool in use that allocates with `key`, or nullptr (a stream's id, or
  // a key of a pool no longer in use). mutex_ held.
  const PrivatePool* livePoolOfKey(StreamId key) const {
    if (key >= 0) {
      return nullptr;
    }
    const auto it = pools_.find(ownerOfKey(key));
    if (it == pools_.end()) {
      return nullptr;
    }
    if (it->second.key == key) {
      return &it->second;
    }
    for (const auto& entry : it->second.stream_keys) {
      if (entry.second == key) {
        return &it->second;
      }
    }
    return nullptr;
  }

  // Whether `key` names a graph or user pool still in use (its memory must stay).
  bool isLivePoolKey(StreamId key) const {
    return livePoolOfKey(key) != nullptr;
  }

  bool isNoSplitKey(StreamId key) const {
    const PrivatePool* pool = livePoolOfKey(key);
    return pool != nullptr && pool->no_split;
  }

  // A free block of a use_on_oom pool for an ordinary allocation on `stream`
  // that found no memory (Note [User memory pools]), or nullptr.
  Block* takeFromOomPools(bool is_small, size_t size, StreamId stream) {
    for (auto& [id, pool] : pools_) {
      if (!pool.use_on_oom) {
        continue;
      }
      for (const auto& [real, key] : pool.stream_keys) {
        if (real != stream) {
          continue;
        }
        if (Block* block = takeCached(is_small ? small_free_ : large_free_, key, size)) {
          return block;
        }
      }
    }
    return nullptr;
  }

  Block* allocateSegment(size_t requested, size_t size, bool is_small, const KilnStream& stream,
                         StreamId key, const Context& context) {
    void* ptr = nullptr;
    kilnError_t status = reserve(&ptr, size);
    if (status == kilnErrorMemoryAllocation) {
      // Release the cache and retry once (Note [Kiln caching allocator]).
      stats_.num_alloc_retries++;
      releaseAllCached(context);
      status = reserve(&ptr, size);
    }
    const size_t block_size = roundSize(requested);
    if (status == kilnErrorMemoryAllocation && is_small && block_size < size) {
      // No room for a whole small-pool segment (a device smaller than one,
      // or nearly full, or a per-process limit close by): a segment of just
      // this block, still within the limit.
      size = block_size;
      status = reserve(&ptr, size);
    }
    if (status == kilnErrorMemoryAllocation && key == stream.id()) {
      if (Block* lent = takeFromOomPools(is_small, block_size, stream.id())) {
        return lent; // stays the pool's (its key), so it goes back there when freed
      }
    }
    if (status == kilnErrorMemoryAllocation) {
      stats_.num_ooms++;
      raiseOutOfMemory(requested, size, stream.id(), context);
    }
    KILN_CHECK(status);
    auto* block = new Block();
    block->device = device_;
    block->stream_id = key;
    block->real_stream = stream.id();
    block->size = size;
    block->ptr = ptr;
    block->is_small = is_small;
    auto* segment = new Segment();
    segment->head = block;
    segment->stream_id = key;
    segment->real_stream = stream.id();
    segment->size = size;
    segment->is_small = is_small;
    segment->context_when_allocated = context;
    block->segment = segment;
    segments_.insert(segment);
    stats_.num_device_alloc++;
    forEachPoolOf(block, [&](size_t t) {
      stats_.segment[t].increase(1);
      stats_.reserved_bytes[t].increase(size);
    });
    recordTrace(TraceEntry::SEGMENT_ALLOC, ptr, size, stream.id(), context);
    return block;
  }

  // Whether a new segment of `size` bytes stays within the per-process limit.
  bool withinLimit(size_t size) const {
    if (!limit_.has_value()) {
      return true;
    }
    const auto reserved = static_cast<size_t>(
        stats_.reserved_bytes[static_cast<size_t>(StatType::AGGREGATE)].current);
    return size <= *limit_ && reserved <= *limit_ - size;
  }

  // A new segment from the runtime; kilnErrorMemoryAllocation also when the
  // per-process limit would be passed.
  kilnError_t reserve(void** ptr, size_t size) {
    if (!withinLimit(size)) {
      return kilnErrorMemoryAllocation;
    }
    return runtimeMalloc(ptr, size);
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
  // rounded block, or the new segment), which is what must fit in the
  // device's free memory and in the per-process limit.
  [[noreturn]] void raiseOutOfMemory(size_t requested, size_t attempted, StreamId stream_id,
                                     const Context& context) {
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
    recordTrace(TraceEntry::OOM, reinterpret_cast<void*>(free_bytes), requested, stream_id, context);
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
    if (!withinLimit(attempted)) {
      std::ostringstream fraction;
      fraction << fraction_;
      TORCH_CHECK_WITH(
          OutOfMemoryError, false,
          "Kiln out of memory. Tried to allocate ", format_size(requested), " (", requested,
          " bytes) on kiln:", static_cast<int>(device_),
          attempted > roundSize(requested) ? ", which needs a new segment of " : "",
          attempted > roundSize(requested) ? format_size(attempted) : "",
          ", but this process may reserve at most ",
          format_size(*limit_), " there (torch.kiln.set_per_process_memory_fraction(",
          fraction.str(), ") of its ", format_size(total_bytes), " capacity) and ",
          format_size(reserved), " is reserved already. Of the memory in use, ",
          format_size(allocated), " is allocated by PyTorch, and ",
          format_size(reserved > allocated ? reserved - allocated : 0),
          " is reserved by PyTorch but unallocated. Free tensors you no longer need, use smaller "
          "batches, or raise the limit with torch.kiln.set_per_process_memory_fraction.");
    }
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
  void deactivate(Block* block, const Context& context) {
    recordTrace(TraceEntry::FREE_COMPLETED, block->ptr, block->requested, block->stream_id,
                context, block->context_when_allocated);
    block->context_when_allocated = nullptr;
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

  void processEvents(const Context& context) {
    if (C10_UNLIKELY(!deferred_.empty()) && !anyCaptureUnderway()) {
      std::vector<Block*> deferred;
      deferred.swap(deferred_);
      for (Block* block : deferred) {
        block->pending_events = 0; // the hold free() put on it
        if (insertEvents(block) == 0) {
          deactivate(block, context);
        }
      }
    }
    while (!pending_.empty()) {
      auto& [event, block] = pending_.front();
      if (!event.query()) {
        break;
      }
      if (--block->pending_events == 0) {
        deactivate(block, context);
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
  void releaseSmallerSegments(StreamId stream_id, size_t size, const Context& context) {
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
      releaseSegment(block, context);
    }
  }

  void releaseSegment(Block* block, const Context& context) {
    KILN_CHECK(kilnFree(block->ptr)); // waits for the device (see runtime.h)
    stats_.num_device_free++;
    forEachPoolOf(block, [&](size_t t) {
      stats_.segment[t].decrease(1);
      stats_.reserved_bytes[t].decrease(block->size);
    });
    recordTrace(TraceEntry::SEGMENT_FREE, block->ptr, block->size, block->segment->stream_id,
                context);
    segments_.erase(block->segment);
    delete block->segment;
    delete block;
  }

  // Waits for the blocks held back by other streams' work (record_stream),
  // caches them, then returns every whole free segment to the runtime.
  void releaseAllCached(const Context& context) {
    for (auto& [event, block] : pending_) {
      event.synchronize();
      if (--block->pending_events == 0) {
        deactivate(block, context);
      }
    }
    pending_.clear();
    releaseCached(small_free_, context);
    releaseCached(large_free_, context);
  }

  // Returns the pool's whole free segments to the runtime (a segment with
  // an allocated block stays, as do those of pools in use); with `only`,
  // just the segments of that memory pool.
  void releaseCached(FreeList& pool, const Context& context, const MempoolId_t* only = nullptr) {
    bool released = false;
    for (auto it = pool.begin(); it != pool.end();) {
      Block* block = *it;
      if (isSplit(block) || isLivePoolKey(block->stream_id) ||
          (only != nullptr && ownerOfKey(block->stream_id) != *only)) {
        ++it;
        continue;
      }
      if (!released) {
        stats_.num_sync_all_streams++;
        released = true;
      }
      it = pool.erase(it);
      releaseSegment(block, context);
    }
  }

  const DeviceIndex device_;
  std::mutex mutex_;
  FreeList small_free_;
  FreeList large_free_;
  std::deque<std::pair<KilnEvent, Block*>> pending_;
  // Blocks freed with stream uses while a capture was underway, waiting for
  // their events until none is (free, processEvents).
  std::vector<Block*> deferred_;
  DeviceStats stats_;
  std::unordered_set<Segment*> segments_; // every segment (Note [Kiln memory history])

  // Graph memory pools (Note [Graph memory pools]): pools in use by id, and
  // the captures underway with their pool keys. capturing_ is read without
  // mutex_ on malloc's hot path.
  struct PrivatePool {
    int use_count = 0;
    StreamId key = 0; // what graph captures into the pool allocate with
    std::vector<std::pair<StreamId, StreamId>> stream_keys; // thread routes: (stream, key)
    bool no_split = false;
    bool use_on_oom = false;
  };
  std::map<MempoolId_t, PrivatePool> pools_;
  std::map<StreamId, MempoolId_t> key_owner_; // every key made, with its pool's id
  struct CaptureRoute {
    StreamId stream;                // the stream that began the capture
    unsigned long long capture_id;  // the runtime's id, shared by joined streams
    StreamId key;                   // the pool's key
  };
  std::vector<CaptureRoute> captures_;
  std::atomic<bool> capturing_{false};
  StreamId next_pool_key_ = -1;

  // Per-process memory fraction (Note [Kiln caching allocator]).
  double fraction_ = 1.0;
  std::optional<size_t> limit_; // bytes the allocator may reserve; none if fraction_ is 1

  // Recording (Note [Kiln memory history]). The atomics are read without
  // mutex_ by maybeGatherContext; the rest is guarded by mutex_.
  std::atomic<CreateContextFn> context_recorder_{nullptr};
  std::atomic<int> record_context_{static_cast<int>(RecordContext::NEVER)};
  bool record_history_ = false;
  std::array<bool, kNumTraceActions> skip_actions_{};
  std::vector<TraceEntry> trace_; // ring buffer of at most trace_max_ entries
  size_t trace_next_ = 0;         // oldest entry once the buffer is full
  size_t trace_max_ = 1;
};

// Converts the trace's approximate timestamps to wall-clock time; created
// with the allocator so it spans the whole recording (as CUDA's does).
c10::ApproximateClockToUnixTimeConverter& clockConverter() {
  static auto* converter = new c10::ApproximateClockToUnixTimeConverter();
  return *converter;
}
const bool g_clock_started = (clockConverter(), true);

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

  void emptyCache(MempoolId_t mempool_id) override {
    if (mempool_id == MempoolId_t{0, 0}) {
      KilnCachingAllocator::emptyCache();
    } else {
      KilnCachingAllocator::emptyPoolCache(mempool_id);
    }
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

void beginAllocateToPool(DeviceIndex device, MempoolId_t pool, StreamId stream,
                         unsigned long long capture_id) {
  check_device_index(device);
  deviceCache(device).beginAllocateToPool(pool, stream, capture_id);
}

void endAllocateToPool(DeviceIndex device, MempoolId_t pool) {
  check_device_index(device);
  deviceCache(device).endAllocateToPool(pool);
}

void releasePool(DeviceIndex device, MempoolId_t pool) {
  check_device_index(device);
  deviceCache(device).releasePool(pool);
}

namespace {
std::atomic<CaptureId_t> g_next_user_pool{1};  // {0, n}: MemPool
std::atomic<CaptureId_t> g_next_graph_pool{1}; // {n, 0}: graph_pool_handle(), a graph's own

// Blocks handed out by rawAlloc, by address (leaked: freed during exit too).
std::mutex& rawMutex() {
  static auto* mutex = new std::mutex();
  return *mutex;
}
ska::flat_hash_map<void*, Block*>& rawBlocks() {
  static auto* blocks = new ska::flat_hash_map<void*, Block*>();
  return *blocks;
}
} // namespace

MempoolId_t newPoolId(bool user_created) {
  return user_created ? MempoolId_t{0, g_next_user_pool.fetch_add(1)}
                      : MempoolId_t{g_next_graph_pool.fetch_add(1), 0};
}

bool isIssuedPoolId(MempoolId_t id) {
  if (id.first == 0) {
    return id.second != 0 && id.second < g_next_user_pool.load();
  }
  return id.second == 0 && id.first < g_next_graph_pool.load();
}

void createOrIncrefPool(DeviceIndex device, MempoolId_t id, bool no_split, bool use_on_oom) {
  check_device_index(device);
  deviceCache(device).createOrIncrefPool(id, no_split, use_on_oom);
}

int poolUseCount(DeviceIndex device, MempoolId_t id) {
  check_device_index(device);
  return deviceCache(device).poolUseCount(id);
}

void beginAllocateCurrentThreadToPool(DeviceIndex device, MempoolId_t id) {
  check_device_index(device);
  deviceCache(device).createOrIncrefPool(id, false, false);
  t_pool_routes.emplace_back(device, id);
}

void endAllocateCurrentThreadToPool(DeviceIndex device, MempoolId_t id) {
  for (auto route = t_pool_routes.rbegin(); route != t_pool_routes.rend(); ++route) {
    if (route->first == device && route->second == id) {
      t_pool_routes.erase(std::next(route).base());
      return;
    }
  }
  TORCH_CHECK(false, "The calling thread does not allocate to memory pool (", id.first, ", ",
              id.second, ") on kiln:", static_cast<int>(device),
              " (end each use_mem_pool on the thread that began it).");
}

void emptyPoolCache(MempoolId_t id) {
  for (const auto device : c10::irange(device_count())) {
    deviceCache(device).emptyPoolCache(id);
  }
}

void setEnabled(bool enabled) {
  g_caching_enabled.store(enabled, std::memory_order_relaxed);
}

bool isEnabled() {
  return g_caching_enabled.load(std::memory_order_relaxed);
}

void* rawAlloc(size_t size, DeviceIndex device, const KilnStream& stream) {
  check_device_index(device);
  TORCH_CHECK_VALUE(stream.device_index() == device, "caching_allocator_alloc: the stream (",
                    stream, ") is not a stream of kiln:", static_cast<int>(device),
                    "; pass a stream of that device.");
  if (size == 0) {
    return nullptr;
  }
  Block* block = deviceCache(device).malloc(size, stream);
  std::lock_guard<std::mutex> lock(rawMutex());
  rawBlocks().emplace(block->ptr, block);
  return block->ptr;
}

void rawDelete(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  Block* block = nullptr;
  {
    std::lock_guard<std::mutex> lock(rawMutex());
    const auto it = rawBlocks().find(ptr);
    TORCH_CHECK(it != rawBlocks().end(), "caching_allocator_delete: ", ptr,
                " is not memory from torch.kiln.caching_allocator_alloc (or it was freed "
                "already); pass the address caching_allocator_alloc returned, once.");
    block = it->second;
    rawBlocks().erase(it);
  }
  deviceCache(block->device).free(block);
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

void setMemoryFraction(double fraction, DeviceIndex device) {
  check_device_index(device);
  TORCH_CHECK_VALUE(
      fraction >= 0.0 && fraction <= 1.0, "Invalid memory fraction ", fraction,
      " for kiln:", static_cast<int>(device), ": it must be between 0 and 1 (the share of the "
      "device's capacity this process may reserve).");
  deviceCache(device).setMemoryFraction(fraction, getMemoryInfo(device).second);
}

double getMemoryFraction(DeviceIndex device) {
  check_device_index(device);
  return deviceCache(device).memoryFraction();
}

void recordHistory(bool enabled, CreateContextFn recorder, size_t max_entries,
                   RecordContext when, bool clear_history,
                   const std::vector<TraceEntry::Action>& skip_actions) {
  TORCH_CHECK(when == RecordContext::NEVER || recorder != nullptr,
              "recordHistory: a context recorder is needed to record contexts");
  std::array<bool, kNumTraceActions> skip{};
  for (const TraceEntry::Action action : skip_actions) {
    skip[static_cast<size_t>(action)] = true;
  }
  for (const auto device : c10::irange(device_count())) {
    deviceCache(device).recordHistory(enabled, recorder, max_entries, when, clear_history, skip);
  }
}

SnapshotInfo snapshot(bool include_traces, MempoolId_t pool) {
  SnapshotInfo result;
  const DeviceIndex count = device_count();
  for (const auto device : c10::irange(count)) {
    const size_t first = result.segments.size();
    deviceCache(device).snapshot(result.segments, pool);
    std::sort(result.segments.begin() + static_cast<std::ptrdiff_t>(first), result.segments.end(),
              [](const SegmentInfo& a, const SegmentInfo& b) { return a.address < b.address; });
  }
  auto to_ns = clockConverter().makeConverter();
  for (const auto device : c10::irange(count)) {
    result.device_traces.push_back(include_traces ? deviceCache(device).trace(to_ns)
                                                  : std::vector<TraceEntry>{});
  }
  return result;
}

AllocatorSettings allocatorSettings() {
  return {kMinBlockSize, kSmallSize, kSmallSegment};
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
