// trace.cc — activity tracing: the records a profiler drains (kilnActivity*).
//
// Note [Activity tracing]
// ~~~~~~~~~~~~~~~~~~~~~~~
// What a profiler needs from a device is what CUPTI gives CUDA: for every
// unit of device work, when it started and ended on which stream, and which
// host call (and, through external correlation ids, which framework operator)
// enqueued it. The runtime produces two kinds of records:
//
//   * an Api record per runtime call that enqueues or waits for device work,
//     written by the calling thread when the call returns (ApiActivity, a
//     scope object at the top of those calls);
//   * a device record per entry enqueued while tracing is enabled: the
//     enqueueing thread fills a PendingActivity (kind, name, device, stream,
//     correlation and external ids, bytes) and hangs it on the Entry; the
//     thread that runs the entry (the worker, or the caller in blocking mode)
//     stamps the start and end on the device clock (NowNs, the clock events
//     use) and hands it to the Tracer.
// Both carry the same correlation id, drawn when the call begins.
//
// Cost when off: the only thing an enqueueing call does is the relaxed load
// of Tracer::enabled_ in ApiActivity's constructor; Entry::trace stays null
// and the runner tests that pointer (a field of the entry it already holds),
// so the worker touches no shared state. Nothing is allocated, no clock read.
// When on, each entry costs an allocation, a 128-byte name copy, two clock
// reads and one short critical section on Tracer::mu_.
//
// Collections. kilnActivityEnable starts collection n (enabled_ = n); an
// entry remembers the n that was current when it was enqueued, and its record
// is kept only if n is still the latest collection when it finishes. So a
// record never leaks from one profiling session into the next, and
// kilnActivityDisable (enabled_ = 0) stops new entries from being traced while
// the ones in flight still report. outstanding_ counts device records in
// flight; kilnActivityFlushAll waits for it to reach 0, which lets a profiler
// collect everything enqueued in its window without synchronizing streams in
// the CUDA sense (sticky errors stay with their streams).
//
// External correlation ids are per-thread stacks, like CUPTI's
// cuptiActivityPushExternalCorrelationId: a framework pushes the id of the
// operator it is entering and pops it on exit, and every record of work that
// thread enqueues in between carries the innermost id. Records are plain data
// copied into a deque under Tracer::mu_, never holding it while running
// anything, so the lock is the last in the runtime's lock order.
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "runtime_internal.h"

namespace kiln {
namespace {

constexpr int kExternalKinds = 2;  // kilnExternalCorrelationKind values

// Per thread, per kind: the external correlation ids pushed and not popped.
thread_local std::vector<uint64_t> t_external_ids[kExternalKinds];

bool ValidExternalKind(int kind) { return kind >= 0 && kind < kExternalKinds; }

void CopyName(char (&dst)[KILN_ACTIVITY_NAME_MAX], const char* name) {
  if (name == nullptr) name = "unnamed task";
  const size_t n = strnlen(name, KILN_ACTIVITY_NAME_MAX - 1);
  std::memcpy(dst, name, n);
  dst[n] = '\0';
}

}  // namespace

uint64_t CurrentThreadId() noexcept {
  thread_local const uint64_t tid = static_cast<uint64_t>(::syscall(SYS_gettid));
  return tid;
}

uint64_t CurrentExternalId(kilnExternalCorrelationKind kind) noexcept {
  const std::vector<uint64_t>& stack = t_external_ids[kind];
  return stack.empty() ? 0 : stack.back();
}

// --- Tracer --------------------------------------------------------------------

void Tracer::Enable(size_t max_records) {
  std::lock_guard<std::mutex> lock(mu_);
  if (++collection_ == 0) collection_ = 1;  // 0 means "disabled"
  records_.clear();
  dropped_ = 0;
  max_records_ = max_records != 0 ? max_records : KILN_ACTIVITY_DEFAULT_MAX_RECORDS;
  enabled_.store(collection_, std::memory_order_relaxed);
}

void Tracer::Write(uint32_t collection, const kilnActivityRecord& record) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  WriteLocked(collection, record);
}

void Tracer::WriteLocked(uint32_t collection, const kilnActivityRecord& record) noexcept {
  if (collection != collection_) return;  // an earlier collection's straggler
  if (records_.size() >= max_records_) {
    ++dropped_;
    return;
  }
  try {
    records_.push_back(record);
  } catch (...) {
    ++dropped_;
  }
}

void Tracer::FinishPendingLocked() noexcept {
  if (outstanding_.fetch_sub(1, std::memory_order_relaxed) == 1) flushed_.notify_all();
}

void Tracer::Complete(PendingActivity* p, int64_t start, int64_t end) noexcept {
  p->record.start = start;
  p->record.end = end;
  {
    std::lock_guard<std::mutex> lock(mu_);
    WriteLocked(p->collection, p->record);
    FinishPendingLocked();
  }
  delete p;
}

void Tracer::Discard(PendingActivity* p) noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    FinishPendingLocked();
  }
  delete p;
}

void Tracer::Flush() {
  std::unique_lock<std::mutex> lock(mu_);
  flushed_.wait(lock, [this] { return outstanding_.load(std::memory_order_relaxed) == 0; });
}

size_t Tracer::Drain(kilnActivityRecord* out, size_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t n = std::min(capacity, records_.size());
  std::copy_n(records_.begin(), n, out);
  records_.erase(records_.begin(), records_.begin() + static_cast<std::ptrdiff_t>(n));
  return n;
}

size_t Tracer::Available() {
  std::lock_guard<std::mutex> lock(mu_);
  return records_.size();
}

size_t Tracer::Dropped() {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

// --- ApiActivity ------------------------------------------------------------------

void ApiActivity::Begin(const char* api) noexcept {
  std::memset(&record_, 0, sizeof record_);
  record_.kind = kilnActivityKindApi;
  record_.device = -1;
  record_.correlationId = tracer_->NextCorrelationId();
  record_.externalId = CurrentExternalId(kilnExternalCorrelationKindDefault);
  record_.userExternalId = CurrentExternalId(kilnExternalCorrelationKindUser);
  record_.threadId = CurrentThreadId();
  record_.srcDevice = -1;
  record_.dstDevice = -1;
  CopyName(record_.name, api);
  record_.start = NowNs();
}

void ApiActivity::End() noexcept {
  if (!targeted_) return;  // failed before naming a stream or device: not worth a record
  record_.end = NowNs();
  tracer_->Write(collection_, record_);
}

void ApiActivity::SetStreamSlow(const Stream* s) noexcept {
  record_.device = s->device();
  record_.streamId = s->id();
  targeted_ = true;
}

void ApiActivity::SetDeviceSlow(int device) noexcept {
  record_.device = device;
  targeted_ = true;
}

void ApiActivity::AttachSlow(Entry& e, const Stream* s, kilnActivityKind kind, const char* name,
                             size_t bytes, int src_device, int dst_device) noexcept {
  SetStreamSlow(s);
  record_.bytes = bytes;
  record_.srcDevice = src_device;
  record_.dstDevice = dst_device;
  auto* p = new (std::nothrow) PendingActivity;
  if (p == nullptr) return;  // out of host memory: this entry goes untraced
  p->collection = collection_;
  p->record = record_;
  p->record.kind = kind;
  CopyName(p->record.name, name);
  tracer_->StartPending();
  e.trace = p;
}

}  // namespace kiln

using kiln::ApiCall;
using kiln::Fail;
using kiln::Runtime;

extern "C" {

KILN_API kilnError_t kilnActivityEnable(size_t maxRecords) {
  return ApiCall("kilnActivityEnable", [&](Runtime& rt) {
    rt.tracer.Enable(maxRecords);
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnActivityDisable(void) {
  return ApiCall("kilnActivityDisable", [&](Runtime& rt) {
    rt.tracer.Disable();
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnActivityFlushAll(void) {
  return ApiCall("kilnActivityFlushAll", [&](Runtime& rt) {
    if (kiln::t_running_stream != nullptr)
      return Fail(kilnErrorNotPermitted,
                  "called from inside a task; the flush would wait for that task itself");
    rt.tracer.Flush();
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnActivityGetRecords(kilnActivityRecord* records, size_t capacity,
                                            size_t* count) {
  return ApiCall("kilnActivityGetRecords", [&](Runtime& rt) {
    if (count == nullptr) return Fail(kilnErrorInvalidValue, "count is NULL");
    if (capacity == 0) {
      *count = rt.tracer.Available();
      return kilnSuccess;
    }
    if (records == nullptr)
      return Fail(kilnErrorInvalidValue, "records is NULL but capacity is %zu", capacity);
    *count = rt.tracer.Drain(records, capacity);
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnActivityGetDroppedCount(size_t* dropped) {
  return ApiCall("kilnActivityGetDroppedCount", [&](Runtime& rt) {
    if (dropped == nullptr) return Fail(kilnErrorInvalidValue, "dropped is NULL");
    *dropped = rt.tracer.Dropped();
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnActivityPushExternalCorrelationId(kilnExternalCorrelationKind kind,
                                                           unsigned long long id) {
  return ApiCall("kilnActivityPushExternalCorrelationId", [&](Runtime&) {
    if (!kiln::ValidExternalKind(kind))
      return Fail(kilnErrorInvalidValue,
                  "kind %d is not a kilnExternalCorrelationKind (allowed: 0 Default, 1 User)",
                  static_cast<int>(kind));
    kiln::t_external_ids[kind].push_back(id);  // bad_alloc becomes kilnErrorMemoryAllocation
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnActivityPopExternalCorrelationId(kilnExternalCorrelationKind kind,
                                                          unsigned long long* lastId) {
  return ApiCall("kilnActivityPopExternalCorrelationId", [&](Runtime&) {
    if (!kiln::ValidExternalKind(kind))
      return Fail(kilnErrorInvalidValue,
                  "kind %d is not a kilnExternalCorrelationKind (allowed: 0 Default, 1 User)",
                  static_cast<int>(kind));
    std::vector<uint64_t>& stack = kiln::t_external_ids[kind];
    if (stack.empty())
      return Fail(kilnErrorInvalidValue,
                  "the calling thread has no external correlation id of kind %d to pop (pops "
                  "must match pushes made by the same thread)",
                  static_cast<int>(kind));
    if (lastId != nullptr) *lastId = stack.back();
    stack.pop_back();
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnActivityGetTimestamp(long long* timestamp) {
  return ApiCall("kilnActivityGetTimestamp", [&](Runtime&) {
    if (timestamp == nullptr) return Fail(kilnErrorInvalidValue, "timestamp is NULL");
    *timestamp = kiln::NowNs();
    return kilnSuccess;
  });
}

}  // extern "C"
