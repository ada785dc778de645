// stream.cc — in-order streams: the queue, the worker thread, sticky errors,
// blocking mode, and the stream and task-launch API.
//
// Why one worker thread per stream: it gives exactly the semantics of a
// hardware queue (entries of a stream run in order, streams run concurrently)
// with no scheduler to get wrong. Why a ring buffer of plain Entry structs:
// launching is the hot path of eager PyTorch (one launch per op), so a launch
// is one short critical section that copies ~100 bytes and allocates nothing
// once the ring has grown to the stream's working depth.
//
// Note [Stream sequence numbers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every entry gets seq = ++submitted_ when it is enqueued (under mu_), and the
// thread that runs it publishes completed_ = seq afterwards (release), so
// "all work launched before this call has finished" is the lock-free test
// completed_ >= the value of submitted_ read at the call. Synchronisation
// therefore never waits for work other threads launch after it started, and
// the worker's writes to device memory happen-before the waiter's return
// (acquire on completed_). Both counters are monotonic over the life of the
// Stream object, across kilnStreamDestroy and reuse from the pool, so a stale
// waiter can never see them go backwards.
//
// Note [Worker spinning]
// ~~~~~~~~~~~~~~~~~~~~~~
// Waking a thread blocked on a condition variable costs tens of microseconds
// (futex wake, scheduler, cache refill), far more than a small op. So a worker
// that ran out of entries polls submitted_ for kWorkerSpinNs before it sleeps,
// and a synchronising thread polls completed_ for kWaitSpinNs before it
// sleeps (see SpinUntil: pause instructions for 2 us, then sched_yield so an
// oversubscribed host still runs the thread we wait for). A synchronising
// thread spins 20 us, which covers a small op. A worker spins 500 us: long
// enough for the program to synchronize, read a result and launch again
// (eager loops do this every step), because waking a worker that slept is
// slower still on a virtual machine, whose idle vCPU the hypervisor may have
// descheduled. Measured with bench/run.py on the 2-core VM, `add` on 2^22
// elements with a synchronize after every op took 1.07-1.19x CPU's time
// with a 20 us worker spin and 0.97-1.13x with 500 us. An idle stream stops
// polling after 500 us, and from 2 us on it yields its core to any thread
// that is ready to run. A launch onto a sleeping worker notifies it after
// releasing mu_ and only then (worker_sleeping_), so a launch onto a busy or
// spinning stream makes no system call. The worker only takes mu_ to notify
// when a waiter has announced itself in sync_waiters_; the announcement and
// the completion are both seq_cst so one of the two threads always sees the
// other (no lost wake-up).
//
// Note [Sticky stream errors]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// When a task fails, its stream records kilnErrorLaunchFailure with the
// message "<task name>: <task message>" and the class the task set with
// kilnTaskSetErrorClass (sticky_code_, sticky_failure_). From then on task,
// copy and memset entries are skipped — they would run on data the failed
// task was meant to produce — but their release functions and staging
// buffers are still dealt with, exactly once. Event records and waits
// are control entries and always take effect, so a stream waiting on an event
// recorded on the failed stream is released instead of hanging forever.
//
// The error is reported once, by the next kilnStreamSynchronize,
// kilnStreamQuery or kilnDeviceSynchronize, or kilnEventSynchronize or
// kilnEventQuery of an event recorded behind the failure, which also clears
// it so the stream works again. Entries launched before the error was
// reported belong to the failed sequence and are skipped even if they run
// after it (a query can report the error while some are still queued):
// reporting stores
// skip_until_ = submitted_ before clearing sticky_code_ (release), and the
// runner checks sticky_code_ (acquire) and then skip_until_. Only the first
// failure is kept; later entries are skipped, so none can fail.
//
// Note [Bounded launch queues]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A stream holds at most max_queued_ (KILN_LAUNCH_QUEUE_DEPTH) entries that
// have not started. Without a bound, a program that runs ahead of a stalled
// device grows without limit (300,000 tiny ops behind a long kernel held
// +475 MB, mostly the tasks' argument images). Submit of a work entry from a
// host thread onto a full queue sleeps on room_cv_ (a host wait: the host-wait
// callback can abandon it) until Pop takes an entry; Pop notifies only when
// room_waiters_ says someone sleeps, so a launch onto a queue with room costs
// one comparison. Control entries (event records and waits) and anything
// submitted by a worker thread (t_running_stream) never wait: the allocator
// records events while holding its lock, and a worker that blocked on
// another stream's full queue could wait for a worker that waits for it.
//
// Note [Launch blocking]
// ~~~~~~~~~~~~~~~~~~~~~~
// With KILN_LAUNCH_BLOCKING=1 no worker threads are started: Submit runs each
// entry on the calling thread, holding the stream's inline_mu_ so entries of
// one stream still run one at a time and in order. A failing task fails its
// own kilnLaunchTask with kilnErrorLaunchFailure and the task's message, and
// is not made sticky (the error has been reported). inline_mu_ is recursive
// because a task may launch onto its own stream; completed_ is advanced with a
// max so a nested entry finishing first does not move it backwards.
#include <pthread.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <system_error>
#include <utility>

#include "runtime_internal.h"

namespace kiln {

thread_local Stream* t_running_stream = nullptr;

namespace {

// kilnStreamGetId numbers; 0 is never handed out.
std::atomic<uint64_t> g_next_stream_id{0};

constexpr int64_t kWorkerSpinNs = 500'000;
constexpr int64_t kWaitSpinNs = 20'000;
constexpr size_t kInitialRing = 64;

// What a running task sets with kilnTaskSetErrorMessage and
// kilnTaskSetErrorClass.
struct TaskContext {
  std::string message;
  int error_class = 0;
  PendingActivity* trace = nullptr;  // the entry's activity record, while tracing
};
thread_local TaskContext* t_task = nullptr;

std::string TaskFailureMessage(const char* name, kilnError_t code, const std::string& message) {
  std::string out = name != nullptr ? name : "unnamed task";
  out += ": ";
  if (message.empty())
    out += StrFormat("failed with %s (the task set no message)", kilnGetErrorName(code));
  else
    out += message;
  return out;
}

// Runs fn(user) with a task context; returns its code and fills *failure on
// failure. A C++ exception escaping the task is a failure, not a crash.
kilnError_t RunTaskFn(const Entry& e, TaskFailure* failure) {
  TaskContext ctx;
  ctx.trace = e.trace;
  TaskContext* outer = t_task;
  t_task = &ctx;
  kilnError_t code = kilnErrorUnknown;
  try {
    code = e.fn(e.user);
  } catch (const std::exception& ex) {
    try {
      ctx.message = std::string("threw an exception: ") + ex.what();
    } catch (...) {  // out of memory while describing it: keep the code
    }
  } catch (...) {
    try {
      ctx.message = "threw an exception of unknown type";
    } catch (...) {
    }
  }
  t_task = outer;
  if (code != kilnSuccess) {
    failure->error_class = ctx.error_class;
    try {
      failure->message = TaskFailureMessage(e.name, code, ctx.message);
    } catch (...) {
    }
  }
  return code;
}

}  // namespace

// --- Lifecycle ---------------------------------------------------------------

kilnError_t Stream::Activate(int device, int priority, bool is_default, bool blocking) {
  try {
    std::lock_guard<std::mutex> lock(mu_);
    if (ring_.empty()) ring_.resize(kInitialRing);
    sticky_failure_ = TaskFailure();
    skip_until_.store(submitted_.load(std::memory_order_relaxed), std::memory_order_relaxed);
    sticky_code_.store(kilnSuccess, std::memory_order_relaxed);
  } catch (const std::bad_alloc&) {
    return Fail(kilnErrorMemoryAllocation, "out of host memory for a new stream's queue");
  }
  max_queued_ = GetRuntime().config.launch_queue_depth;
  device_.store(device, std::memory_order_relaxed);
  id_.store(g_next_stream_id.fetch_add(1, std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  priority_.store(priority, std::memory_order_relaxed);
  is_default_.store(is_default, std::memory_order_relaxed);
  blocking_.store(blocking, std::memory_order_relaxed);
  if (!blocking && !worker_started_) {
    try {
      std::thread([this] { WorkerLoop(); }).detach();  // See Note [Leaked singletons]
    } catch (const std::system_error& e) {
      return Fail(kilnErrorMemoryAllocation, "could not start a worker thread for a new stream: %s",
                  e.what());
    }
    worker_started_ = true;
  }
  alive_.store(true, std::memory_order_release);
  return kilnSuccess;
}

bool Stream::Deactivate() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!alive_.load(std::memory_order_relaxed)) return false;
  alive_.store(false, std::memory_order_release);
  return true;
}

// --- Submission ----------------------------------------------------------------

void Stream::GrowRing() {
  const size_t old_size = ring_.size();
  std::vector<Entry> bigger(old_size * 2);
  for (uint64_t i = head_; i < tail_; ++i) bigger[i & (bigger.size() - 1)] = ring_[i & (old_size - 1)];
  ring_.swap(bigger);
}

kilnError_t Stream::Submit(Entry& e, uint64_t* seq, bool* consumed) {
  if (__builtin_expect(capturing_.load(std::memory_order_acquire), 0)) {
    bool captured = false;
    const kilnError_t err = SubmitCaptured(e, seq, consumed, &captured);
    if (captured || err != kilnSuccess) return err;
  }
  if (blocking_.load(std::memory_order_relaxed)) return SubmitInline(e, seq, consumed);

  std::unique_lock<std::mutex> lock(mu_);
  if (!alive_.load(std::memory_order_relaxed))
    return Fail(kilnErrorInvalidResourceHandle, "the stream was destroyed");
  if (IsWorkEntry(e)) {
    if (kilnError_t err = WaitForRoom(lock)) return err;
  }
  if (tail_ - head_ == ring_.size()) {
    try {
      GrowRing();
    } catch (const std::bad_alloc&) {
      return Fail(kilnErrorMemoryAllocation, "out of host memory for the stream's queue (%llu entries)",
                  static_cast<unsigned long long>(tail_ - head_));
    }
  }
  const uint64_t s = submitted_.load(std::memory_order_relaxed) + 1;
  e.seq = s;
  ring_[tail_ & (ring_.size() - 1)] = e;
  ++tail_;
  submitted_.store(s, std::memory_order_release);
  const bool wake = worker_sleeping_;
  worker_sleeping_ = false;
  lock.unlock();
  if (wake) work_cv_.notify_one();  // the Stream is never freed: safe after unlock
  if (seq != nullptr) *seq = s;
  if (consumed != nullptr) *consumed = true;
  return kilnSuccess;
}

// See Note [Bounded launch queues].
kilnError_t Stream::WaitForRoom(std::unique_lock<std::mutex>& lock) {
  if (__builtin_expect(g_unloading.load(std::memory_order_acquire), 0)) return FailUnloading();
  if (tail_ - head_ < max_queued_ || t_running_stream != nullptr) return kilnSuccess;
  ++room_waiters_;
  const kilnError_t err = HostWait(lock, room_cv_, [this] {
    return tail_ - head_ < max_queued_ || g_unloading.load(std::memory_order_acquire) ||
           !alive_.load(std::memory_order_relaxed);
  });
  --room_waiters_;
  if (err != kilnSuccess) return err;
  if (g_unloading.load(std::memory_order_acquire)) return FailUnloading();
  if (!alive_.load(std::memory_order_relaxed))
    return Fail(kilnErrorInvalidResourceHandle, "the stream was destroyed");
  return kilnSuccess;
}

uint64_t Stream::Queued() {
  std::lock_guard<std::mutex> lock(mu_);
  return tail_ - head_;
}

void Stream::WakeLaunchWaiters() {
  std::lock_guard<std::mutex> lock(mu_);
  room_cv_.notify_all();
}

// See Note [Launch blocking].
kilnError_t Stream::SubmitInline(Entry& e, uint64_t* seq, bool* consumed) {
  std::lock_guard<std::recursive_mutex> serial(inline_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!alive_.load(std::memory_order_relaxed))
      return Fail(kilnErrorInvalidResourceHandle, "the stream was destroyed");
    if (IsWorkEntry(e) && g_unloading.load(std::memory_order_acquire)) return FailUnloading();
    e.seq = submitted_.load(std::memory_order_relaxed) + 1;
    submitted_.store(e.seq, std::memory_order_release);
  }
  if (consumed != nullptr) *consumed = true;
  if (seq != nullptr) *seq = e.seq;
  Stream* outer = t_running_stream;
  t_running_stream = this;
  TaskFailure failure;
  const kilnError_t result = Run(e, &failure);
  t_running_stream = outer;
  PublishCompleted(e.seq);
  if (result != kilnSuccess)
    return FailVerbatim(kilnErrorLaunchFailure, failure.message, failure.error_class);
  return kilnSuccess;
}

// --- Execution -------------------------------------------------------------------

void Stream::WorkerLoop() {
  pthread_setname_np(pthread_self(), "kiln-stream");
  t_running_stream = this;  // everything this thread runs is this stream's work
  TaskFailure failure;
  Entry e;
  for (;;) {
    Pop(&e);
    failure.message.clear();
    failure.error_class = 0;
    if (Run(e, &failure) != kilnSuccess) SetSticky(std::move(failure));
    PublishCompleted(e.seq);
  }
}

void Stream::Pop(Entry* e) {
  // See Note [Worker spinning]. completed_ is the last entry this thread ran,
  // so submitted_ > completed_ means an entry is waiting in the ring.
  SpinUntil(
      [this] {
        return submitted_.load(std::memory_order_acquire) > completed_.load(std::memory_order_relaxed);
      },
      kWorkerSpinNs);
  std::unique_lock<std::mutex> lock(mu_);
  while (head_ == tail_) {
    worker_sleeping_ = true;
    work_cv_.wait(lock);
  }
  *e = ring_[head_ & (ring_.size() - 1)];
  ++head_;
  if (room_waiters_ > 0) room_cv_.notify_all();  // See Note [Bounded launch queues]
}

bool Stream::ShouldSkip(uint64_t seq) {
  // Order matters: see Note [Sticky stream errors].
  if (sticky_code_.load(std::memory_order_acquire) != kilnSuccess) return true;
  if (seq <= skip_until_.load(std::memory_order_relaxed)) return true;
  if (__builtin_expect(g_dropping.load(std::memory_order_relaxed), 0)) {
    dropped_.fetch_add(1, std::memory_order_relaxed);  // See Note [Shutdown at exit]
    return true;
  }
  return false;
}

kilnError_t Stream::Run(Entry& e, TaskFailure* failure) {
  // See Note [Activity tracing]: e.trace is set only while tracing, so when it
  // is off this costs one test of a field we already hold.
  PendingActivity* const trace = e.trace;
  const int64_t start = trace != nullptr ? NowNs() : 0;
  int64_t end = 0;
  bool ran = true;
  kilnError_t result = kilnSuccess;
  switch (e.kind) {
    case EntryKind::kTask: {
      ran = !ShouldSkip(e.seq);
      if (ran && RunTaskFn(e, failure) != kilnSuccess) result = kilnErrorLaunchFailure;
      if (trace != nullptr) end = NowNs();  // the task's own time, not its release
      if (e.release != nullptr) e.release(e.user);
      break;
    }
    case EntryKind::kCopy:
      ran = !ShouldSkip(e.seq);
      if (ran) std::memmove(e.dst, e.src, e.count);
      if (trace != nullptr) end = NowNs();
      if (e.outcome != nullptr) *e.outcome = ran ? CopyOutcome::kDone : CopyOutcome::kSkipped;
      std::free(e.staging);
      break;
    case EntryKind::kMemset:
      ran = !ShouldSkip(e.seq);
      if (ran) std::memset(e.dst, e.value, e.count);
      break;
    case EntryKind::kRecord:
      // CompleteEventRecord publishes the event and the stream's progress
      // itself; the activity record is written first, so whoever sees the
      // event complete (or the stream idle) also finds the record, as for
      // every other entry (the runner publishes completion after Run).
      if (trace != nullptr) FinishTrace(trace, true, start, start);
      CompleteEventRecord(e.event, e.gen, this, e.seq);
      return kilnSuccess;
    case EntryKind::kWait:
      WaitEventGeneration(e.event, e.gen);
      break;
    case EntryKind::kGraph:
      ran = !ShouldSkip(e.seq);
      if (ran) result = RunGraph(*e.graph, failure);
      if (trace != nullptr) end = NowNs();
      GraphUnref(e.graph);
      break;
  }
  if (trace != nullptr) FinishTrace(trace, ran, start, end != 0 ? end : NowNs());
  return result;
}

// Note [Stream capture]: the nodes run back to back inside the graph's one
// entry; the first failing task stops the graph and becomes the entry's
// failure, named after the task.
kilnError_t Stream::RunGraph(const Graph& graph, TaskFailure* failure) {
  for (const Entry& node : graph.nodes) {
    switch (node.kind) {
      case EntryKind::kTask:
        if (RunTaskFn(node, failure) != kilnSuccess) return kilnErrorLaunchFailure;
        break;
      case EntryKind::kCopy:
        std::memmove(node.dst, node.src, node.count);
        break;
      case EntryKind::kMemset:
        std::memset(node.dst, node.value, node.count);
        break;
      default:  // never captured (SubmitCaptured refuses them)
        break;
    }
  }
  return kilnSuccess;
}

void Stream::FinishTrace(PendingActivity* trace, bool ran, int64_t start, int64_t end) {
  Tracer& tracer = GetRuntime().tracer;
  if (ran) {
    tracer.Complete(trace, start, end);
  } else {
    tracer.Discard(trace);  // skipped after a sticky error: it never ran
  }
}

void Stream::SetSticky(TaskFailure failure) {
  std::lock_guard<std::mutex> lock(mu_);
  if (sticky_code_.load(std::memory_order_relaxed) != kilnSuccess) return;
  sticky_failure_.message.swap(failure.message);
  sticky_failure_.error_class = failure.error_class;
  sticky_code_.store(kilnErrorLaunchFailure, std::memory_order_release);
}

void Stream::AdvanceCompleted(uint64_t seq) {
  uint64_t current = completed_.load(std::memory_order_relaxed);
  while (current < seq &&
         !completed_.compare_exchange_weak(current, seq, std::memory_order_seq_cst,
                                           std::memory_order_relaxed)) {
  }
}

void Stream::PublishCompleted(uint64_t seq) {
  AdvanceCompleted(seq);
  // See Note [Worker spinning] for why this cannot lose a wake-up.
  if (sync_waiters_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    done_cv_.notify_all();
  }
}

// --- Waiting and errors ------------------------------------------------------------

void Stream::WaitFor(uint64_t seq) {
  if (SpinUntil([&] { return completed_.load(std::memory_order_acquire) >= seq; }, kWaitSpinNs))
    return;
  BlockUntilCompleted(seq, /*interruptible=*/false, /*deadline_ns=*/0);
}

kilnError_t Stream::HostWaitFor(uint64_t seq) {
  if (SpinUntil([&] { return completed_.load(std::memory_order_acquire) >= seq; }, kWaitSpinNs))
    return kilnSuccess;
  return BlockUntilCompleted(seq, /*interruptible=*/true, 0) == WaitOutcome::kDone
      ? kilnSuccess
      : kilnErrorInterrupted;  // CallHostWaitCallback has set the message
}

bool Stream::WaitForUntil(uint64_t seq, int64_t deadline_ns) {
  if (completed_.load(std::memory_order_acquire) >= seq) return true;
  return BlockUntilCompleted(seq, /*interruptible=*/false, deadline_ns) == WaitOutcome::kDone;
}

Stream::WaitOutcome Stream::BlockUntilCompleted(uint64_t seq, bool interruptible,
                                                int64_t deadline_ns) {
  auto done = [&] { return completed_.load(std::memory_order_seq_cst) >= seq; };
  WaitOutcome outcome = WaitOutcome::kDone;
  sync_waiters_.fetch_add(1, std::memory_order_seq_cst);
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (interruptible) {
      if (HostWait(lock, done_cv_, done) != kilnSuccess) outcome = WaitOutcome::kInterrupted;
    } else if (deadline_ns != 0) {
      const auto deadline = std::chrono::steady_clock::now() +
                            std::chrono::nanoseconds(deadline_ns - NowNs());
      if (!done_cv_.wait_until(lock, deadline, done)) outcome = WaitOutcome::kTimedOut;
    } else {
      done_cv_.wait(lock, done);
    }
  }
  sync_waiters_.fetch_sub(1, std::memory_order_relaxed);
  return outcome;
}

kilnError_t Stream::CheckNotSelf() const {
  if (t_running_stream != this) return kilnSuccess;
  return Fail(kilnErrorNotPermitted,
              "called from inside a task running on the stream it would wait for; the wait "
              "would include the calling task itself and never end");
}

kilnError_t Stream::TakeStickyError() {
  if (sticky_code_.load(std::memory_order_acquire) == kilnSuccess) return kilnSuccess;
  kilnError_t code;
  TaskFailure failure;
  {
    std::lock_guard<std::mutex> lock(mu_);
    code = static_cast<kilnError_t>(sticky_code_.load(std::memory_order_relaxed));
    if (code == kilnSuccess) return kilnSuccess;  // another thread reported it
    failure.message.swap(sticky_failure_.message);
    failure.error_class = std::exchange(sticky_failure_.error_class, 0);
    const uint64_t upto = submitted_.load(std::memory_order_relaxed);
    if (upto > skip_until_.load(std::memory_order_relaxed))
      skip_until_.store(upto, std::memory_order_relaxed);
    sticky_code_.store(kilnSuccess, std::memory_order_release);
  }
  return FailVerbatim(code, failure.message, failure.error_class);
}

void Stream::DiscardStickyError() {
  std::lock_guard<std::mutex> lock(mu_);
  sticky_failure_ = TaskFailure();
  skip_until_.store(submitted_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  sticky_code_.store(kilnSuccess, std::memory_order_release);
}

// --- Handles -------------------------------------------------------------------------

kilnError_t ResolveStream(Runtime& rt, kilnStream_t handle, Stream** out) {
  if (handle == nullptr) {
    const int d = t_current_device;
    if (kilnError_t err = CheckDevice(rt, d)) return err;
    return GetDefaultStream(rt, d, out);
  }
  if (!rt.stream_pool.Contains(handle))
    return Fail(kilnErrorInvalidResourceHandle,
                "%p is not a stream (use a handle from kilnStreamCreate or kilnStreamGetDefault, "
                "or NULL for the current device's default stream)",
                static_cast<void*>(handle));
  auto* s = reinterpret_cast<Stream*>(handle);
  if (!s->alive())
    return Fail(kilnErrorInvalidResourceHandle, "stream %p has been destroyed",
                static_cast<void*>(handle));
  *out = s;
  return kilnSuccess;
}

namespace {

kilnError_t CreateStream(Runtime& rt, kilnStream_t* stream, unsigned int flags, int priority) {
  if (stream == nullptr) return Fail(kilnErrorInvalidValue, "stream is NULL");
  if (flags != 0) return Fail(kilnErrorInvalidValue, "flags must be 0 (got %u)", flags);
  int d = 0;
  if (kilnError_t err = CurrentDevice(rt, &d)) return err;
  if (priority < kStreamPriorityHighest) priority = kStreamPriorityHighest;
  if (priority > kStreamPriorityLowest) priority = kStreamPriorityLowest;

  Stream* s = rt.stream_pool.Acquire();
  if (kilnError_t err = s->Activate(d, priority, /*is_default=*/false, rt.config.launch_blocking)) {
    rt.stream_pool.Release(s);
    return err;
  }
  try {
    Device& dev = rt.devices[d];
    std::lock_guard<std::mutex> lock(dev.mu);
    dev.streams.push_back(s);
  } catch (...) {
    s->Deactivate();
    rt.stream_pool.Release(s);
    throw;
  }
  *stream = reinterpret_cast<kilnStream_t>(s);
  return kilnSuccess;
}

}  // namespace
}  // namespace kiln

using kiln::ApiCall;
using kiln::Fail;
using kiln::Runtime;
using kiln::Stream;

extern "C" {

KILN_API kilnError_t kilnStreamGetDefault(kilnStream_t* stream, int device) {
  return ApiCall("kilnStreamGetDefault", [&](Runtime& rt) {
    if (stream == nullptr) return Fail(kilnErrorInvalidValue, "stream is NULL");
    if (kilnError_t err = kiln::CheckDevice(rt, device)) return err;
    Stream* s = nullptr;
    if (kilnError_t err = kiln::GetDefaultStream(rt, device, &s)) return err;
    *stream = reinterpret_cast<kilnStream_t>(s);
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnStreamCreate(kilnStream_t* stream) {
  return ApiCall("kilnStreamCreate",
                 [&](Runtime& rt) { return kiln::CreateStream(rt, stream, 0, kiln::kStreamPriorityLowest); });
}

KILN_API kilnError_t kilnStreamCreateWithPriority(kilnStream_t* stream, unsigned int flags,
                                                  int priority) {
  return ApiCall("kilnStreamCreateWithPriority",
                 [&](Runtime& rt) { return kiln::CreateStream(rt, stream, flags, priority); });
}

KILN_API kilnError_t kilnStreamDestroy(kilnStream_t stream) {
  return ApiCall("kilnStreamDestroy", [&](Runtime& rt) {
    if (stream == nullptr)
      return Fail(kilnErrorInvalidResourceHandle,
                  "NULL names the current device's default stream, which cannot be destroyed");
    Stream* s = nullptr;
    if (kilnError_t err = kiln::ResolveStream(rt, stream, &s)) return err;
    if (s->is_default())
      return Fail(kilnErrorInvalidResourceHandle,
                  "stream %p is the default stream of kiln device %d; default streams live for "
                  "the whole process and cannot be destroyed",
                  static_cast<void*>(stream), s->device());
    if (kilnError_t err = s->RefuseIfCapturing("kilnStreamDestroy of the capturing stream"))
      return err;
    if (kilnError_t err = s->CheckNotSelf()) return err;
    if (!s->Deactivate())
      return Fail(kilnErrorInvalidResourceHandle, "stream %p has been destroyed",
                  static_cast<void*>(stream));
    s->WaitFor(s->submitted());
    // A failure nobody synchronised on is still reported, once, here.
    const kilnError_t sticky = s->TakeStickyError();
    {
      kiln::Device& dev = rt.devices[s->device()];
      std::lock_guard<std::mutex> lock(dev.mu);
      for (auto it = dev.streams.begin(); it != dev.streams.end(); ++it) {
        if (*it == s) {
          dev.streams.erase(it);
          break;
        }
      }
    }
    rt.stream_pool.Release(s);
    return sticky;
  });
}

KILN_API kilnError_t kilnStreamQuery(kilnStream_t stream) {
  return ApiCall("kilnStreamQuery", [&](Runtime& rt) {
    Stream* s = nullptr;
    if (kilnError_t err = kiln::ResolveStream(rt, stream, &s)) return err;
    if (kilnError_t err = s->RefuseIfCapturing("kilnStreamQuery of the capturing stream")) return err;
    if (kilnError_t err = s->TakeStickyError()) return err;
    return s->Idle() ? kilnSuccess : kilnErrorNotReady;
  });
}

KILN_API kilnError_t kilnStreamSynchronize(kilnStream_t stream) {
  return ApiCall("kilnStreamSynchronize", [&](Runtime& rt) {
    kiln::ApiActivity activity(rt, "kilnStreamSynchronize");
    Stream* s = nullptr;
    if (kilnError_t err = kiln::ResolveStream(rt, stream, &s)) return err;
    activity.SetStream(s);
    if (kilnError_t err = s->RefuseIfCapturing("kilnStreamSynchronize of the capturing stream"))
      return err;
    if (kilnError_t err = s->CheckNotSelf()) return err;
    if (kilnError_t err = s->HostWaitFor(s->submitted())) return err;
    return s->TakeStickyError();
  });
}

KILN_API kilnError_t kilnStreamGetDevice(kilnStream_t stream, int* device) {
  return ApiCall("kilnStreamGetDevice", [&](Runtime& rt) {
    if (device == nullptr) return Fail(kilnErrorInvalidValue, "device is NULL");
    Stream* s = nullptr;
    if (kilnError_t err = kiln::ResolveStream(rt, stream, &s)) return err;
    *device = s->device();
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnStreamGetId(kilnStream_t stream, unsigned long long* streamId) {
  return ApiCall("kilnStreamGetId", [&](Runtime& rt) {
    if (streamId == nullptr) return Fail(kilnErrorInvalidValue, "streamId is NULL");
    Stream* s = nullptr;
    if (kilnError_t err = kiln::ResolveStream(rt, stream, &s)) return err;
    *streamId = s->id();
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnStreamGetSubmittedCount(kilnStream_t stream, unsigned long long* count) {
  return ApiCall("kilnStreamGetSubmittedCount", [&](Runtime& rt) {
    if (count == nullptr) return Fail(kilnErrorInvalidValue, "count is NULL");
    Stream* s = nullptr;
    if (kilnError_t err = kiln::ResolveStream(rt, stream, &s)) return err;
    *count = s->submitted();
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnStreamGetPriority(kilnStream_t stream, int* priority) {
  return ApiCall("kilnStreamGetPriority", [&](Runtime& rt) {
    if (priority == nullptr) return Fail(kilnErrorInvalidValue, "priority is NULL");
    Stream* s = nullptr;
    if (kilnError_t err = kiln::ResolveStream(rt, stream, &s)) return err;
    *priority = s->priority();
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnLaunchTask(kilnStream_t stream, kilnTaskFn_t fn, kilnTaskReleaseFn_t release,
                                    void* userData, const char* name) {
  bool consumed = false;  // true once the entry (and so release) belongs to the stream
  const kilnError_t result = ApiCall("kilnLaunchTask", [&](Runtime& rt) {
    kiln::ApiActivity activity(rt, "kilnLaunchTask");
    if (fn == nullptr) return Fail(kilnErrorInvalidValue, "fn is NULL (task %s)", name ? name : "unnamed");
    Stream* s = nullptr;
    if (kilnError_t err = kiln::ResolveStream(rt, stream, &s)) return err;
    kiln::Entry e;
    e.kind = kiln::EntryKind::kTask;
    e.fn = fn;
    e.release = release;
    e.user = userData;
    e.name = name;
    activity.Attach(e, s, kilnActivityKindTask, name);
    const kilnError_t err = s->Submit(e, nullptr, &consumed);
    if (!consumed) activity.Detach(e);
    return err;
  });
  if (!consumed && release != nullptr) release(userData);
  return result;
}

KILN_API void kilnTaskSetErrorMessage(const char* message) {
  if (kiln::g_forked_child.load(std::memory_order_relaxed)) return;
  kiln::TaskContext* ctx = kiln::t_task;
  if (ctx == nullptr) return;
  try {
    ctx->message = message != nullptr ? message : "";
  } catch (...) {
  }
}

KILN_API void kilnTaskSetActivityName(const char* name) {
  if (kiln::g_forked_child.load(std::memory_order_relaxed)) return;
  kiln::TaskContext* ctx = kiln::t_task;
  if (ctx == nullptr || ctx->trace == nullptr || name == nullptr) return;
  char* dst = ctx->trace->record.name;
  const size_t n = strnlen(name, KILN_ACTIVITY_NAME_MAX - 1);
  std::memcpy(dst, name, n);
  dst[n] = '\0';
}

KILN_API void kilnTaskSetErrorClass(int errorClass) {
  if (kiln::g_forked_child.load(std::memory_order_relaxed)) return;
  kiln::TaskContext* ctx = kiln::t_task;
  if (ctx != nullptr) ctx->error_class = errorClass;
}

KILN_API kilnError_t kilnGetLaunchBlocking(int* blocking) {
  return ApiCall("kilnGetLaunchBlocking", [&](Runtime& rt) {
    if (blocking == nullptr) return Fail(kilnErrorInvalidValue, "blocking is NULL");
    *blocking = rt.config.launch_blocking ? 1 : 0;
    return kilnSuccess;
  });
}

}  // extern "C"
