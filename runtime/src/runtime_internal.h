// runtime_internal.h — the one internal header of libkilnrt (never installed).
//
// Every .cc file of the reference runtime includes this header; nothing outside
// runtime/src may. It declares the objects behind the public handles and the
// helpers the API functions share.
//
// Object model and ownership
//   Runtime   one per process, created on the first API call and never
//             destroyed. See Note [Leaked singletons].
//   Device    one per logical device, owned by the Runtime; holds the capacity
//             accounting and the list of the device's live streams.
//   Stream    behind kilnStream_t. Lives in a HandlePool: its memory is never
//             freed, a destroyed stream goes back to the pool (with its worker
//             thread) and is reused by a later kilnStreamCreate.
//             See Note [Handle pools].
//   Event     behind kilnEvent_t. Same pool scheme; an event destroyed while a
//             record is pending goes back to the pool only when that record
//             completes. See Note [Event generations].
//   Memory    the allocation tables (base → size/device) live in the Runtime;
//             the bytes come from the system allocator.
//   Tracer    the activity records of kilnActivity*, owned by the Runtime.
//             See Note [Activity tracing] in trace.cc.
//
// Locking (never take two of these in a different order than listed; most
// paths take exactly one)
//   Device::mu        the device's stream list and its lazily created default
//                     stream. Held only for list edits and snapshots.
//   Runtime::mem_mu   the allocation tables and every Device::used. Held for a
//                     map lookup or edit, never across a system allocation or a
//                     wait.
//   Stream::mu_       the stream's queue, its sticky error and its alive flag.
//                     Held for a push or pop of one entry (a few dozen ns).
//   Event::mu         one event's generation state. Never held while
//                     submitting to a stream, so a blocking-mode record that
//                     completes inline can take it again.
//   g_capture_mu      (graph.cc) every capture in progress and each stream's
//                     part in one. Taken alone: never with Stream::mu_,
//                     Event::mu or Device::mu (only Tracer::mu_ under it).
//   HandlePool::mu_   the pool's free list.
//   Tracer::mu_       the undrained activity records. Taken last: by a worker
//                     after running an entry, by a caller at the end of an
//                     API call; nothing else is acquired while holding it.
// Handle validation (HandlePool::Contains) and the hot counters of a stream are
// lock-free atomics.
#ifndef KILN_RUNTIME_INTERNAL_H_
#define KILN_RUNTIME_INTERNAL_H_

#include <kiln/runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

namespace kiln {

// ---------------------------------------------------------------------------
// Constants
// ---------------------------------------------------------------------------

constexpr int kMaxDevices = 64;
constexpr int kDefaultDeviceCount = 2;
constexpr uint64_t kDefaultDeviceMemory = uint64_t{16} << 30;  // 16 GiB
// See "The launch queue" in runtime.h.
constexpr size_t kDefaultLaunchQueueDepth = 1024;
constexpr size_t kMaxLaunchQueueDepth = size_t{1} << 20;
constexpr size_t kDeviceAlignment = 256;   // promised by kilnMalloc
constexpr size_t kPinnedAlignment = 4096;  // a page, as pinned memory is
constexpr int kStreamPriorityLowest = 0;
constexpr int kStreamPriorityHighest = -1;

// ---------------------------------------------------------------------------
// env.cc — the environment, read once at initialisation
// ---------------------------------------------------------------------------

struct Config {
  // Devices this process sees: all of KILN_DEVICE_COUNT, or those
  // KILN_VISIBLE_DEVICES selects (Note [KILN_VISIBLE_DEVICES] in env.cc).
  int device_count = kDefaultDeviceCount;
  int physical_device_count = kDefaultDeviceCount;  // KILN_DEVICE_COUNT
  // visible_devices[i] is the KILN_DEVICE_COUNT index of device i.
  std::vector<int> visible_devices;
  bool visible_devices_set = false;    // KILN_VISIBLE_DEVICES is in the environment
  std::string visible_devices_value;   // its value, for messages
  uint64_t device_memory = kDefaultDeviceMemory;
  bool launch_blocking = false;
  size_t launch_queue_depth = kDefaultLaunchQueueDepth;
  // Empty when the environment is valid; otherwise every API call fails with
  // kilnErrorInitializationError and this text.
  std::string error;
};

Config ReadConfig();

// ---------------------------------------------------------------------------
// error.cc — messages
// ---------------------------------------------------------------------------

// Name of the public function the calling thread is executing; Fail() prefixes
// messages with it. Set by ApiCall.
extern thread_local const char* t_api;

// Records "<t_api>: <formatted text>" as this thread's last error message and
// returns `code`. Never throws (a message that cannot be stored is dropped).
kilnError_t Fail(kilnError_t code, const char* fmt, ...)
    __attribute__((format(printf, 2, 3)));

// Records `message` verbatim (no function prefix) and `error_class` (what
// kilnGetLastErrorClass returns) and returns `code`. Used for task failures,
// whose text the header fixes as "<name>: <message>".
kilnError_t FailVerbatim(kilnError_t code, const std::string& message, int error_class = 0);

// What a failed task reported: "<name>: <message>" and the class it set with
// kilnTaskSetErrorClass (0 if none).
struct TaskFailure {
  std::string message;
  int error_class = 0;
};

// printf into a std::string.
std::string StrFormat(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// "17179869184 bytes (16.00 GiB)"; small counts are just "3 bytes".
std::string FormatBytes(uint64_t bytes);

// The message of a forked child: see Note [Fork safety].
kilnError_t FailForkedChild();

// ---------------------------------------------------------------------------
// Clocks and spinning. See Note [Worker spinning] in stream.cc.
// ---------------------------------------------------------------------------

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Polls `done` for about `budget_ns`: pause instructions for the first
// kPauseSpinNs (the other side usually answers within a microsecond when it
// has a core of its own), then sched_yield between polls, so that when the
// host is oversubscribed the thread we wait for gets our core instead of
// waiting for our time slice to end. Returns whether `done` became true; the
// caller then blocks on a condition variable.
constexpr int64_t kPauseSpinNs = 2'000;
template <class Pred>
inline bool SpinUntil(Pred done, int64_t budget_ns) {
  if (done()) return true;
  const int64_t start = NowNs();
  for (;;) {
    for (int i = 0; i < 16; ++i) {
      CpuRelax();
      if (done()) return true;
    }
    const int64_t elapsed = NowNs() - start;
    if (elapsed >= budget_ns) return false;
    if (elapsed >= kPauseSpinNs) {
      std::this_thread::yield();
      if (done()) return true;
    }
  }
}

// ---------------------------------------------------------------------------
// Handle pools
// ---------------------------------------------------------------------------

// Note [Handle pools]
// ~~~~~~~~~~~~~~~~~~~
// Streams and events are handed to the user as raw pointers (kilnStream_t,
// kilnEvent_t). We want a bad handle — destroyed, or never ours — to fail with
// kilnErrorInvalidResourceHandle rather than crash, without paying for a
// global locked registry on every launch. So the objects live in a HandlePool:
// chunks of geometrically growing size that are never freed. Contains(p) is a
// lock-free range check over at most kMaxChunks chunks and never dereferences
// p, so any pointer value can be tested safely; once it holds, the object is
// known to be constructed and its `alive` flag decides the rest.
//
// Destroyed objects go back to the free list and are reused. A stale handle
// that aliases a reused object then names the new stream or event — CUDA has
// the same behaviour, and it is the price of never freeing.
template <class T>
class HandlePool {
 public:
  // A constructed, currently unused object (the caller activates it). Throws
  // std::bad_alloc if memory (or the pool's chunk table) is exhausted.
  T* Acquire() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) Grow();
    T* t = free_.back();
    free_.pop_back();
    return t;
  }

  // Returns an object to the pool. The object stays constructed.
  void Release(T* t) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(t);  // capacity was reserved in Grow(): cannot throw
  }

  // True if `p` is the address of one of the pool's objects (live or not).
  bool Contains(const void* p) const {
    const auto addr = reinterpret_cast<uintptr_t>(p);
    const int n = nchunks_.load(std::memory_order_acquire);
    for (int i = 0; i < n; ++i) {
      const auto base = reinterpret_cast<uintptr_t>(chunks_[i]);
      const size_t bytes = (kFirstChunk << i) * sizeof(T);
      if (addr >= base && addr < base + bytes) return (addr - base) % sizeof(T) == 0;
    }
    return false;
  }

 private:
  static constexpr int kMaxChunks = 24;
  static constexpr size_t kFirstChunk = 8;

  void Grow() {  // mu_ held
    const int n = nchunks_.load(std::memory_order_relaxed);
    if (n == kMaxChunks) throw std::bad_alloc();
    const size_t count = kFirstChunk << n;
    free_.reserve(total_ + count);  // so Release never allocates
    T* chunk = static_cast<T*>(::operator new(count * sizeof(T), std::align_val_t(alignof(T))));
    for (size_t i = 0; i < count; ++i) new (chunk + i) T();
    for (size_t i = count; i-- > 0;) free_.push_back(chunk + i);  // lowest first out
    total_ += count;
    chunks_[n] = chunk;
    nchunks_.store(n + 1, std::memory_order_release);  // publishes chunks_[n]
  }

  std::mutex mu_;
  std::vector<T*> free_;
  size_t total_ = 0;
  T* chunks_[kMaxChunks] = {};
  std::atomic<int> nchunks_{0};
};

// ---------------------------------------------------------------------------
// Streams (stream.cc)
// ---------------------------------------------------------------------------

struct Event;
class Stream;
struct PendingActivity;
struct Capture;

// What kilnEventRecord on a capturing stream leaves in the event (Note
// [Cross-stream capture] in graph.cc): no queued record, but the capture and
// how far each of its streams had got, as seen from the recording stream.
struct CapturedRecord {
  uint64_t gen = 0;         // the event generation the record took; 0: none
  uint64_t capture_id = 0;  // the capture's id (kilnStreamGetCaptureInfo)
  // clock[i]: how many operations of the capture's member i the recording
  // stream was ordered after (its own entry included).
  std::vector<uint64_t> clock;
};

// The stream whose entry the calling thread is running right now (a worker
// thread, or the launching thread in blocking mode), else nullptr.
// See Note [Blocking calls inside tasks].
extern thread_local Stream* t_running_stream;

// What a synchronous copy learns about its entry. Written by the thread that
// runs the entry before it publishes completion, read after WaitFor.
enum class CopyOutcome : int { kPending = 0, kDone = 1, kSkipped = 2 };

enum class EntryKind : uint8_t {
  kTask,    // user task: fn(user) then release(user)
  kCopy,    // memmove(dst, src, count), then free(staging)
  kMemset,  // memset(dst, value, count)
  kRecord,  // control: complete event generation `gen`
  kWait,    // control: block until event generation `gen` has completed
  kGraph    // work: run every node of `graph`, then drop the entry's reference
};

struct Graph;

// One queue slot. Plain data, copied into a ring buffer, so a launch costs no
// heap allocation once the ring has grown to the stream's working depth.
struct Entry {
  EntryKind kind = EntryKind::kTask;
  uint64_t seq = 0;  // assigned by Stream::Submit
  // kTask
  kilnTaskFn_t fn = nullptr;
  kilnTaskReleaseFn_t release = nullptr;
  void* user = nullptr;
  const char* name = nullptr;
  // kCopy, kMemset
  void* dst = nullptr;
  const void* src = nullptr;
  size_t count = 0;
  int value = 0;
  void* staging = nullptr;         // freed by the runner, whether run or skipped
  CopyOutcome* outcome = nullptr;  // set for synchronous copies
  // kRecord, kWait
  Event* event = nullptr;
  uint64_t gen = 0;
  // kGraph: a reference owned by the entry (Note [Stream capture])
  Graph* graph = nullptr;
  // Set when activity tracing was enabled at submission: the record the
  // runner completes with the entry's start and end times (or discards if the
  // entry is skipped). Owned by the entry. See Note [Activity tracing].
  PendingActivity* trace = nullptr;
};

// An in-order queue of entries run by one worker thread (or, with
// KILN_LAUNCH_BLOCKING=1, by the launching thread).
//
// Thread-safety: every method may be called from any thread. Activate and
// Deactivate are serialised by their callers (pool hand-out, destroy).
class Stream {
 public:
  Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  // Makes a pooled stream live for `device`. Starts the worker thread the
  // first time the object is used (not in blocking mode). Fails with
  // kilnErrorMemoryAllocation if the thread or the ring cannot be created.
  kilnError_t Activate(int device, int priority, bool is_default, bool blocking);

  // Stops accepting work (kilnStreamDestroy). False if it was already dead.
  bool Deactivate();

  // Enqueues `e` (async mode) or runs it on the calling thread after the
  // stream's earlier work (blocking mode). On success *seq (if given) is the
  // entry's sequence number. On failure nothing was enqueued and nothing of
  // `e` (release, staging) has been run or freed: the caller cleans up.
  // In blocking mode a failing task returns kilnErrorLaunchFailure here; its
  // release has been called (the entry was consumed).
  kilnError_t Submit(Entry& e, uint64_t* seq = nullptr, bool* consumed = nullptr);

  // Blocks until every entry with sequence number <= seq has finished.
  // Does not look at the sticky error. Must not be called from a task of
  // this stream (callers check CheckNotSelf first).
  void WaitFor(uint64_t seq);
  // The same as a host wait (see "The launch queue, host waits and shutdown"
  // in runtime.h): kilnErrorInterrupted if the host-wait callback abandoned it.
  kilnError_t HostWaitFor(uint64_t seq);
  // The same, giving up at `deadline_ns` (NowNs clock); false if it did.
  bool WaitForUntil(uint64_t seq, int64_t deadline_ns);

  // Wakes host threads waiting for room in the queue (kilnRuntimeShutdown:
  // they then fail with kilnErrorRuntimeUnloading).
  void WakeLaunchWaiters();
  // Entries this stream dropped because the runtime was shutting down.
  uint64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }
  // Entries in the queue that have not started.
  uint64_t Queued();
  uint64_t submitted() const { return submitted_.load(std::memory_order_acquire); }
  bool Idle() const {
    return completed_.load(std::memory_order_acquire) >= submitted_.load(std::memory_order_acquire);
  }

  // kilnErrorNotPermitted if the calling thread is running one of this
  // stream's entries (waiting would wait for itself).
  kilnError_t CheckNotSelf() const;

  // Returns the sticky error (recording its message for this thread) and
  // clears it, or kilnSuccess. See Note [Sticky stream errors].
  kilnError_t TakeStickyError();
  bool HasStickyError() const {
    return sticky_code_.load(std::memory_order_acquire) != kilnSuccess;
  }
  // Drops any sticky error without reporting it (stream destruction).
  void DiscardStickyError();

  // Raises the completed count to `seq` (never lowers it) without waking
  // waiters; the runner calls PublishCompleted afterwards.
  void AdvanceCompleted(uint64_t seq);

  // Capture (graph.cc, Note [Stream capture]). BeginCapture fails for the
  // default stream or a stream already capturing; EndCapture (on the stream
  // that began the capture) hands over the recorded graph, or fails if the
  // capture was invalidated or a joined stream was not joined back, ending
  // the capture either way.
  kilnError_t BeginCapture();
  kilnError_t EndCapture(Graph** out);
  // *id (if given) receives the capture's id, 0 when not capturing.
  kilnStreamCaptureStatus CaptureStatus(uint64_t* id = nullptr);
  // If this stream is capturing (began or joined a capture): invalidates the
  // capture and fails with kilnErrorStreamCaptureUnsupported naming `what`.
  // Else kilnSuccess.
  kilnError_t RefuseIfCapturing(const char* what);
  bool capturing() const { return capturing_.load(std::memory_order_acquire); }
  // kilnEventRecord on this stream: if it is capturing, fills *record with
  // the capture's id and this stream's position in it and sets *captured
  // (nothing is enqueued); fails with kilnErrorStreamCaptureInvalidated if
  // the capture was invalidated. *captured false: record as usual.
  kilnError_t MarkCapturedRecord(CapturedRecord* record, bool* captured);
  // kilnStreamWaitEvent on this stream for an event whose latest record was
  // captured: joins that capture or orders this member after the record.
  kilnError_t WaitCapturedRecord(const CapturedRecord& record);

  bool alive() const { return alive_.load(std::memory_order_acquire); }
  int device() const { return device_.load(std::memory_order_relaxed); }
  int priority() const { return priority_.load(std::memory_order_relaxed); }
  bool is_default() const { return is_default_.load(std::memory_order_relaxed); }
  // kilnStreamGetId: assigned by each Activate, so never reused.
  uint64_t id() const { return id_.load(std::memory_order_relaxed); }

 private:
  void WorkerLoop();
  void Pop(Entry* e);  // blocks; worker thread only
  kilnError_t SubmitInline(Entry& e, uint64_t* seq, bool* consumed);
  // Submit while capturing: records `e` into the capture's graph (*captured
  // true) or refuses it; *captured false if the capture ended meanwhile.
  kilnError_t SubmitCaptured(Entry& e, uint64_t* seq, bool* consumed, bool* captured);
  // Runs the nodes of a launched graph (an entry of kind kGraph).
  kilnError_t RunGraph(const Graph& graph, TaskFailure* failure);
  // mu_ held. Makes room for one more work entry, waiting if the calling host
  // thread finds the queue full; fails if the wait was abandoned or the
  // runtime is shutting down.
  kilnError_t WaitForRoom(std::unique_lock<std::mutex>& lock);
  // How WaitFor, HostWaitFor and WaitForUntil wait once spinning is over.
  enum class WaitOutcome { kDone, kInterrupted, kTimedOut };
  WaitOutcome BlockUntilCompleted(uint64_t seq, bool interruptible, int64_t deadline_ns);
  bool ShouldSkip(uint64_t seq);
  // Runs one entry. Returns the task's failure (kilnErrorLaunchFailure, with
  // *failure filled) or kilnSuccess. Skip decisions per Note [Sticky stream
  // errors].
  kilnError_t Run(Entry& e, TaskFailure* failure);
  // Completes (ran) or discards (skipped) an entry's activity record.
  static void FinishTrace(PendingActivity* trace, bool ran, int64_t start, int64_t end);
  void SetSticky(TaskFailure failure);
  void PublishCompleted(uint64_t seq);
  void GrowRing();  // mu_ held

  // Identity. Atomic so that a stale handle racing with reuse is not UB.
  std::atomic<int> device_{-1};
  std::atomic<int> priority_{0};
  std::atomic<bool> is_default_{false};
  std::atomic<bool> alive_{false};
  std::atomic<bool> blocking_{false};  // KILN_LAUNCH_BLOCKING: run entries inline
  std::atomic<uint64_t> id_{0};
  bool worker_started_ = false;  // serialised by the callers of Activate

  // Queue (mu_). head_/tail_ count entries ever popped/pushed.
  std::mutex mu_;
  std::condition_variable work_cv_;  // worker sleeps here when idle
  std::condition_variable done_cv_;  // WaitFor sleeps here
  std::vector<Entry> ring_;          // size is a power of two
  uint64_t head_ = 0;
  uint64_t tail_ = 0;
  bool worker_sleeping_ = false;
  // The launch queue's bound (KILN_LAUNCH_QUEUE_DEPTH), and the host threads
  // waiting for room below it (they sleep on room_cv_; Pop wakes them).
  size_t max_queued_ = kDefaultLaunchQueueDepth;
  int room_waiters_ = 0;
  std::condition_variable room_cv_;
  std::atomic<uint64_t> dropped_{0};

  // See Note [Stream sequence numbers].
  std::atomic<uint64_t> submitted_{0};  // written under mu_
  std::atomic<uint64_t> completed_{0};
  std::atomic<int> sync_waiters_{0};

  // See Note [Sticky stream errors]. sticky_failure_ is guarded by mu_.
  std::atomic<int> sticky_code_{kilnSuccess};
  std::atomic<uint64_t> skip_until_{0};
  TaskFailure sticky_failure_;

  // Capture (Note [Stream capture]): the capture this stream began or
  // joined, and its index among the capture's members. Guarded by
  // g_capture_mu (graph.cc); capturing_ mirrors capture_ != nullptr for
  // Submit's lock-free test.
  std::atomic<bool> capturing_{false};
  Capture* capture_ = nullptr;
  size_t capture_member_ = 0;

  // Serialises inline execution in blocking mode (recursive: a task may
  // launch onto its own stream).
  std::recursive_mutex inline_mu_;
};

// ---------------------------------------------------------------------------
// Events (event.cc)
// ---------------------------------------------------------------------------

// The records of one event that were enqueued but have not completed yet.
// Generations are added in increasing order, so the list is sorted and
// lookups are binary searches; completed entries are trimmed from the front
// (records usually complete in order) and compacted away in bulk, so a long
// backlog of records costs O(log n) per operation, not O(n).
class PendingRecords {
 public:
  struct Record {
    uint64_t gen;
    Stream* stream;  // where it was recorded (see Note [Blocking calls inside tasks])
    bool done;
  };

  bool empty() const { return live_ == 0; }

  // `gen` must be larger than every generation added before. May throw.
  void Add(uint64_t gen, Stream* stream) {
    records_.push_back(Record{gen, stream, false});
    ++live_;
  }

  // The pending record `gen`, or nullptr if it completed (or never existed).
  const Record* Find(uint64_t gen) const {
    size_t lo = head_, hi = records_.size();
    while (lo < hi) {
      const size_t mid = lo + (hi - lo) / 2;
      if (records_[mid].gen < gen) lo = mid + 1;
      else hi = mid;
    }
    if (lo == records_.size() || records_[lo].gen != gen || records_[lo].done) return nullptr;
    return &records_[lo];
  }

  // Marks `gen` complete (no-op if it is not pending).
  void Remove(uint64_t gen) {
    auto* r = const_cast<Record*>(Find(gen));
    if (r == nullptr) return;
    r->done = true;
    --live_;
    while (head_ < records_.size() && records_[head_].done) ++head_;
    if (head_ == records_.size()) {
      records_.clear();
      head_ = 0;
    } else if (head_ >= 32 && head_ * 2 >= records_.size()) {
      records_.erase(records_.begin(), records_.begin() + static_cast<std::ptrdiff_t>(head_));
      head_ = 0;
    }
  }

 private:
  std::vector<Record> records_;
  size_t head_ = 0;  // records_[0, head_) are all done
  size_t live_ = 0;  // records not done
};

// See Note [Event generations]. All fields but `alive` and `flags` are
// guarded by mu.
struct Event {
  std::atomic<bool> alive{false};
  std::atomic<unsigned> flags{0};
  std::mutex mu;
  std::condition_variable cv;
  uint64_t next_gen = 0;    // last generation handed out; never reset
  uint64_t latest_gen = 0;  // most recent record by the current owner, 0 = none
  int64_t latest_time_ns = 0;  // steady_clock when the latest record completed
  // The stream the latest record completed on, if that stream held a sticky
  // error then (see Note [Sticky stream errors]); nullptr otherwise.
  Stream* latest_failed_stream = nullptr;
  PendingRecords pending;
  // The latest record made on a capturing stream; it is the event's latest
  // record while captured.gen == latest_gen (Note [Cross-stream capture]).
  CapturedRecord captured;
  bool pooled = true;  // on the pool's free list

  bool IsPendingLocked(uint64_t gen) const { return pending.Find(gen) != nullptr; }
};

// Run by a stream (worker or inline) for kRecord and kWait entries.
// CompleteEventRecord also advances `stream`'s completed count to `seq` while
// it holds the event's lock, so the event and its stream never disagree: once
// kilnEventSynchronize returns, kilnStreamQuery of a stream whose last work was
// the record reports success, and once the stream is seen idle the event is
// complete.
void CompleteEventRecord(Event* event, uint64_t gen, Stream* stream, uint64_t seq);
void WaitEventGeneration(Event* event, uint64_t gen);
kilnError_t HostWaitEventGeneration(Event* event, uint64_t gen);  // interruptible

// ---------------------------------------------------------------------------
// Activity tracing (trace.cc). See Note [Activity tracing].
// ---------------------------------------------------------------------------

// A device record in flight: filled by the enqueueing thread, completed with
// its times by whichever thread runs the entry.
struct PendingActivity {
  kilnActivityRecord record;
  uint32_t collection;  // the collection it belongs to (Tracer::Enable)
};

// The undrained records of the current collection, and the switch.
//
// Thread-safety: all methods may be called from any thread.
class Tracer {
 public:
  // The hot check: the current collection's number while tracing is enabled,
  // 0 while it is disabled. One relaxed load.
  uint32_t enabled() const { return enabled_.load(std::memory_order_relaxed); }

  void Enable(size_t max_records);
  void Disable() { enabled_.store(0, std::memory_order_relaxed); }

  // Appends a finished record of `collection` (dropped if that collection is
  // over or the buffer is full). Never throws.
  void Write(uint32_t collection, const kilnActivityRecord& record) noexcept;

  // Device records in flight (see Flush). Start: when a PendingActivity is
  // attached to an entry. Complete: writes it with its times and deletes it;
  // Discard: deletes it unwritten (skipped, or never enqueued).
  void StartPending() noexcept { outstanding_.fetch_add(1, std::memory_order_relaxed); }
  void Complete(PendingActivity* p, int64_t start, int64_t end) noexcept;
  void Discard(PendingActivity* p) noexcept;
  // Blocks until no device record is in flight.
  void Flush();

  // Moves up to `capacity` of the oldest records to `out`; returns how many.
  size_t Drain(kilnActivityRecord* out, size_t capacity);
  size_t Available();
  size_t Dropped();

  // Process-unique correlation ids, starting at 1.
  uint64_t NextCorrelationId() noexcept {
    return next_correlation_.fetch_add(1, std::memory_order_relaxed) + 1;
  }

 private:
  void WriteLocked(uint32_t collection, const kilnActivityRecord& record) noexcept;  // mu_ held
  void FinishPendingLocked() noexcept;  // mu_ held

  std::atomic<uint32_t> enabled_{0};
  std::atomic<uint64_t> next_correlation_{0};
  std::atomic<int64_t> outstanding_{0};
  std::mutex mu_;
  std::condition_variable flushed_;
  uint32_t collection_ = 0;  // the latest collection (mu_)
  std::deque<kilnActivityRecord> records_;  // (mu_)
  size_t max_records_ = KILN_ACTIVITY_DEFAULT_MAX_RECORDS;  // (mu_)
  size_t dropped_ = 0;  // (mu_)
};

// The calling thread's OS thread id (gettid), cached.
uint64_t CurrentThreadId() noexcept;

// The innermost external correlation id of `kind` pushed by the calling
// thread, or 0.
uint64_t CurrentExternalId(kilnExternalCorrelationKind kind) noexcept;

struct Runtime;

// Traces one runtime call that enqueues or waits for device work. Created at
// the top of the call; with tracing disabled it costs one relaxed load and
// every method does nothing. The Api record is written when it goes out of
// scope, if the call got as far as naming its target (SetStream/SetDevice).
// Lives on the calling thread.
class ApiActivity {
 public:
  inline ApiActivity(Runtime& rt, const char* api) noexcept;  // defined below Runtime
  ~ApiActivity() {
    if (__builtin_expect(on(), 0)) End();
  }
  ApiActivity(const ApiActivity&) = delete;
  ApiActivity& operator=(const ApiActivity&) = delete;

  bool on() const { return collection_ != 0; }
  void SetStream(const Stream* s) noexcept {
    if (__builtin_expect(on(), 0)) SetStreamSlow(s);
  }
  void SetDevice(int device) noexcept {
    if (__builtin_expect(on(), 0)) SetDeviceSlow(device);
  }

  // Gives `e` a device record of `kind` named `name` (copied now), to be
  // completed by whoever runs it, and sets the target to `s`. If `e` is not
  // enqueued after all, call Detach.
  void Attach(Entry& e, const Stream* s, kilnActivityKind kind, const char* name,
              size_t bytes = 0, int src_device = -1, int dst_device = -1) noexcept {
    if (__builtin_expect(on(), 0)) AttachSlow(e, s, kind, name, bytes, src_device, dst_device);
  }
  void Detach(Entry& e) noexcept {
    if (e.trace != nullptr) {
      tracer_->Discard(e.trace);
      e.trace = nullptr;
    }
  }

 private:
  void Begin(const char* api) noexcept;
  void End() noexcept;
  void SetStreamSlow(const Stream* s) noexcept;
  void SetDeviceSlow(int device) noexcept;
  void AttachSlow(Entry& e, const Stream* s, kilnActivityKind kind, const char* name, size_t bytes,
                  int src_device, int dst_device) noexcept;

  Tracer* tracer_ = nullptr;
  uint32_t collection_;
  bool targeted_ = false;
  kilnActivityRecord record_;  // the Api record; filled only when on()
};

// ---------------------------------------------------------------------------
// Devices and the runtime (init.cc, device.cc)
// ---------------------------------------------------------------------------

struct DeviceAllocation {
  size_t size;      // bytes requested (an import: the mapped size)
  size_t reserved;  // bytes charged to the device (size rounded to 256; 0 for an import)
  int device;
  int fd = -1;      // the memfd behind the mapping (Note [Shareable device memory])
  size_t mapped = 0;  // bytes mapped (size rounded up to a page)
  bool imported = false;  // mapped from another allocation's handle
};

struct Device {
  int index = 0;
  int physical_index = 0;  // among the KILN_DEVICE_COUNT devices (kilnDeviceProp::pciBusID)
  uint64_t capacity = 0;
  uint64_t used = 0;  // guarded by Runtime::mem_mu

  std::mutex mu;                       // guards streams and default creation
  std::vector<Stream*> streams;        // live streams, default first
  std::atomic<Stream*> default_stream{nullptr};
};

struct Runtime {
  Config config;
  int device_count = 0;
  int host_cores = 1;
  std::unique_ptr<Device[]> devices;

  // Allocation tables. See memory.cc.
  std::mutex mem_mu;
  std::map<uintptr_t, DeviceAllocation> device_allocs;
  std::map<uintptr_t, size_t> pinned_allocs;

  HandlePool<Stream> stream_pool;
  HandlePool<Event> event_pool;

  Tracer tracer;
};

// The process's runtime, created on first use (never destroyed).
Runtime& GetRuntime();

// --- Host waits and shutdown (host_wait.cc) ---------------------------------

// Set by kilnRuntimeShutdown, never cleared: g_unloading when it starts
// refusing work, g_dropping when it starts dropping queued work.
extern std::atomic<bool> g_unloading;
extern std::atomic<bool> g_dropping;

// Task, copy and memset entries are work; records and waits are control.
inline bool IsWorkEntry(const Entry& e) {
  return e.kind == EntryKind::kTask || e.kind == EntryKind::kCopy ||
         e.kind == EntryKind::kMemset || e.kind == EntryKind::kGraph;
}

// --- Graphs (graph.cc) ------------------------------------------------------

// A captured graph: the entries recorded by a stream capture, in order.
// Reference counted: the kilnGraph_t handle holds one reference, each queued
// launch (kGraph entry) another; the last one releases the nodes' tasks.
struct Graph {
  int device = 0;
  std::vector<Entry> nodes;  // kTask, kCopy, kMemset; trace == nullptr
  std::string name;          // "kiln graph (<n> nodes)", the launch's name
  std::atomic<int> refs{1};
};
void GraphRef(Graph* graph);
void GraphUnref(Graph* graph);  // releases the nodes' tasks at zero
// Whether any stream of `device` is capturing; if so invalidates those
// captures and fails naming `what` (kilnDeviceSynchronize).
kilnError_t RefuseIfDeviceCapturing(Runtime& rt, int device, const char* what);

// kilnErrorRuntimeUnloading with a message, for work submitted after shutdown.
kilnError_t FailUnloading();

// The interval of the host-wait callback in ns, or 0 when none is set.
int64_t HostWaitIntervalNs();
// Calls the host-wait callback (mu must not be held): kilnErrorInterrupted
// (with a message) if it asked to abandon the wait, else kilnSuccess.
kilnError_t CallHostWaitCallback();

// Blocks on `cv` (with `lock` held) until done() — a host wait: the callback
// is called every interval without the lock, and may abandon the wait
// (kilnErrorInterrupted). Must not be used on worker threads.
template <class Pred>
kilnError_t HostWait(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, Pred done) {
  for (;;) {
    const int64_t interval = HostWaitIntervalNs();
    if (interval == 0 || t_running_stream != nullptr) {
      cv.wait(lock, done);
      return kilnSuccess;
    }
    if (cv.wait_for(lock, std::chrono::nanoseconds(interval), done)) return kilnSuccess;
    lock.unlock();
    const kilnError_t err = CallHostWaitCallback();
    lock.lock();
    if (err != kilnSuccess) return done() ? kilnSuccess : err;
  }
}

inline ApiActivity::ApiActivity(Runtime& rt, const char* api) noexcept
    : collection_(rt.tracer.enabled()) {
  if (__builtin_expect(on(), 0)) {
    tracer_ = &rt.tracer;
    Begin(api);
  }
}

// Set in a child process forked after initialisation. See Note [Fork safety].
extern std::atomic<bool> g_forked_child;

// Runs the body of a public API function: records the function name for error
// messages, refuses forked children and invalid environments, and turns any
// C++ exception into a status code (no exception crosses the C API).
kilnError_t FailFromException();
template <class F>
inline kilnError_t ApiCall(const char* api, F&& body) noexcept {
  t_api = api;
  if (__builtin_expect(g_forked_child.load(std::memory_order_relaxed), 0)) return FailForkedChild();
  try {
    Runtime& rt = GetRuntime();
    if (__builtin_expect(!rt.config.error.empty(), 0))
      return Fail(kilnErrorInitializationError, "%s", rt.config.error.c_str());
    return body(rt);
  } catch (...) {
    return FailFromException();
  }
}

// The calling thread's current device (kilnSetDevice), per thread, default 0.
extern thread_local int t_current_device;

// kilnErrorInvalidDevice (with a message naming the range) unless
// 0 <= device < count.
kilnError_t CheckDevice(const Runtime& rt, int device);

// The current device, checked against the count (there may be 0 devices).
kilnError_t CurrentDevice(const Runtime& rt, int* device);

// The device's default stream, created on first use.
kilnError_t GetDefaultStream(Runtime& rt, int device, Stream** out);

// Resolves a public stream handle: NULL is the current device's default
// stream; anything else must be a live stream from the pool.
kilnError_t ResolveStream(Runtime& rt, kilnStream_t handle, Stream** out);

// Blocks until the work submitted so far on every stream of `device` has
// finished; sticky errors are left alone.
void WaitDevice(Runtime& rt, int device);
// The same for every device (kilnFree, kilnFreeHost).
void WaitAllDevices(Runtime& rt);
// What kilnFree and kilnFreeHost wait for: every device, and true (the memory
// may be released). After kilnRuntimeShutdown they never wait (a task still
// running at exit would hold the process): false if any stream is busy, and
// the memory is then left to the OS (Note [Shutdown at exit]).
bool WaitBeforeFree(Runtime& rt);
// kilnErrorNotPermitted if the calling thread is running a task of a stream of
// `device` (or of any device when device < 0).
kilnError_t CheckNotInsideTaskOf(int device);

// ---------------------------------------------------------------------------
// Memory (memory.cc) — used by the copy functions
// ---------------------------------------------------------------------------

enum class MemoryKind { kPageable, kPinned, kDevice };

struct Range {
  MemoryKind kind = MemoryKind::kPageable;
  int device = -1;  // for kDevice
};

// Classifies [p, p + count) (count > 0). A range starting inside a device
// allocation must end inside it; a host range must not overlap device memory;
// either violation is kilnErrorInvalidValue naming `role` ("dst", "src"), the
// range and the allocation. Pinned means wholly inside one kilnMallocHost
// allocation.
kilnError_t ClassifyRange(Runtime& rt, const char* role, const void* p, size_t count, Range* out);

}  // namespace kiln

#endif  // KILN_RUNTIME_INTERNAL_H_
