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
#include <string>
#include <utility>
#include <vector>

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

// Frees all cached, unused blocks of every device back to the runtime
// (blocks of graph memory pools still in use by a graph stay; see
// Note [Graph memory pools] in KilnCachingAllocator.cc).
void emptyCache();

// --- Graph memory pools (kiln graphs; CUDA's beginAllocateToPool,
// endAllocateToPool and releasePool). See Note [Graph memory pools].
//
// From beginAllocateToPool on, allocations on `device` made on `stream`, or
// on a stream that joined its capture `capture_id` (the runtime's capture
// id, kilnStreamGetCaptureInfo), come from the private pool `pool` (created
// with use count 1 on first use; a pool already in use gains a use), until
// endAllocateToPool. releasePool drops one use; at zero the pool's memory
// is no longer reserved for graphs and its free blocks go back to the
// runtime at the next empty_cache (or out-of-memory retry).
void beginAllocateToPool(DeviceIndex device, MempoolId_t pool, StreamId stream,
                         unsigned long long capture_id);
void endAllocateToPool(DeviceIndex device, MempoolId_t pool);
void releasePool(DeviceIndex device, MempoolId_t pool);

// --- Pool ids and user memory pools (torch.kiln.MemPool, use_mem_pool). See
// Note [User memory pools] in KilnCachingAllocator.cc.
//
// A new pool id, as CUDA numbers them: {0, n} for a user pool (MemPool),
// {n, 0} for graph pools (graph_pool_handle(), a graph's own pool).
MempoolId_t newPoolId(bool user_created);
// Whether `id` was handed out by newPoolId (so a capture may name it).
bool isIssuedPoolId(MempoolId_t id);
// Creates pool `id` on `device` with use count 1, or adds a use to it if it
// exists (CUDA's createOrIncrefPool). `no_split`: blocks of the pool are
// never split (each allocation gets a whole block: a segment of its own
// rounded size, or a cached block that fits). `use_on_oom`: an ordinary
// allocation that would fail with out-of-memory may take a free block of
// this pool instead (of its stream). The options of an existing pool stay.
void createOrIncrefPool(DeviceIndex device, MempoolId_t id, bool no_split = false,
                        bool use_on_oom = false);
// The pool's use count on `device` (0 if it does not exist there).
int poolUseCount(DeviceIndex device, MempoolId_t id);
// Routes the calling thread's allocations on `device` to pool `id` (adding a
// use, created if needed) until endAllocateCurrentThreadToPool; innermost
// wins when nested. Blocks are kept per (pool, stream), so stream-ordered
// reuse holds inside a pool as outside. A graph capture on the current
// stream takes precedence.
void beginAllocateCurrentThreadToPool(DeviceIndex device, MempoolId_t id);
// Ends the innermost routing of this thread to `id` on `device` (it does not
// drop the use: call releasePool). Raises c10::Error if there is none.
void endAllocateCurrentThreadToPool(DeviceIndex device, MempoolId_t id);
// Returns to the runtime the whole free segments of pool `id` on every
// device, if the pool is no longer in use there (a pool in use keeps them).
void emptyPoolCache(MempoolId_t id);

// --- Enabling and raw allocations (torch.kiln.caching_allocator_enable,
// caching_allocator_alloc/delete).
//
// setEnabled(false) stops caching on every device: ordinary allocations get a
// segment of their own rounded size from the runtime (never a cached or split
// block), and segments freed since the last call go back to the runtime at
// the next allocation (a free may run on a stream worker, where the runtime
// cannot wait for the device) or empty_cache. Statistics stay exact. Graph
// and user pools keep caching (a graph's replays need its blocks).
void setEnabled(bool enabled);
bool isEnabled();
// `size` bytes on `device` for work on `stream` (a stream of that device),
// outside any tensor, as CUDA's raw_alloc_with_stream; nullptr for 0 bytes.
// Raises c10::OutOfMemoryError like a tensor allocation.
void* rawAlloc(size_t size, DeviceIndex device, const KilnStream& stream);
// Frees memory from rawAlloc (stream-ordered, as a tensor's). nullptr is a
// no-op; anything else not from rawAlloc (or freed already) raises c10::Error.
void rawDelete(void* ptr);

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

// --- Memory history and snapshots (torch.kiln.memory._record_memory_history,
// _snapshot). See Note [Kiln memory history] in KilnCachingAllocator.cc.
//
// The types are c10's (c10/core/CachingDeviceAllocator.h), which CUDA's and
// XPU's allocators use too. TraceEntry::stream_ and SegmentInfo::stream hold
// the c10 stream id (torch.kiln.Stream.stream_id; 0 is the default stream),
// not a pointer.
using c10::CachingDeviceAllocator::CreateContextFn;
using c10::CachingDeviceAllocator::RecordContext;
using c10::CachingDeviceAllocator::SegmentInfo;
using c10::CachingDeviceAllocator::TraceEntry;

// Starts or stops recording on every device. `recorder` (required unless
// `when` is NEVER) gathers a stack context; it is called outside the
// allocator's locks, on the thread that allocates or frees. `max_entries`
// bounds the trace of each device (a ring buffer keeping the newest entries;
// at least 1). Disabling, or `clear_history`, empties the traces.
// `skip_actions` lists actions not to record.
void recordHistory(bool enabled, CreateContextFn recorder, size_t max_entries,
                   RecordContext when, bool clear_history,
                   const std::vector<TraceEntry::Action>& skip_actions);

struct SnapshotInfo {
  std::vector<SegmentInfo> segments;              // every device, sorted by (device, address)
  std::vector<std::vector<TraceEntry>> device_traces; // one per device, oldest first;
                                                  // time_.t_ in microseconds since the epoch
};

// The state of every device's allocator: its segments with their blocks, and
// the recorded traces (empty unless recording is on, or if `include_traces` is
// false). Records a SNAPSHOT trace entry while recording. A `pool` other than
// {0, 0} keeps only the segments of that pool. SegmentInfo::stream is the
// real stream's id also for pool segments; owner_private_pool_id names the
// pool ({0, 0}: none).
SnapshotInfo snapshot(bool include_traces = true, MempoolId_t pool = {0, 0});

// Kiln's allocator constants, for the snapshot's "allocator_settings".
struct AllocatorSettings {
  size_t min_block_size;     // allocation granularity (bytes)
  size_t small_size;         // largest request served by the small pool (bytes)
  size_t small_segment_size; // size of a small-pool segment (bytes)
};
AllocatorSettings allocatorSettings();

} // namespace c10::kiln::KilnCachingAllocator
