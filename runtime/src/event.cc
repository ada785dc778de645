// event.cc — events: record, wait, query, synchronize and timing.
//
// Note [Event generations]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// An event is re-recorded all the time (PyTorch records one event per
// record_stream use), and a wait must refer to the record that was most recent
// when kilnStreamWaitEvent was called, not to whatever the event holds when
// the waiting stream gets there. So each kilnEventRecord takes a new
// generation number gen = ++next_gen, adds {gen, stream} to the event's
// pending list and enqueues a kRecord entry carrying gen. When the stream
// reaches that entry, CompleteEventRecord removes gen from the list, stamps
// the time if gen is still the latest record, and wakes waiters. A wait
// captures the latest gen at call time and is satisfied once that gen is no
// longer pending — exact even when records of one event on different streams
// complete out of order, and immune to re-records after the call.
//
// next_gen is never reset, also not when a destroyed event is reused from the
// pool, so a (event, gen) pair never names two records. A destroyed event
// whose records are still pending is not put back in the pool until the last
// of them completes (the entries point at it); kilnEventDestroy is therefore
// safe at any time, and streams waiting on the event are still released.
//
// Record and wait entries are control entries: they take effect even on a
// stream with a sticky error (see Note [Sticky stream errors]), so a record
// always completes and no stream can wait forever on it.
#include "runtime_internal.h"

namespace kiln {
namespace {

constexpr int64_t kEventSpinNs = 20'000;

// Under ev->mu: marks a dead event with no pending records as pooled and
// returns true if the caller must release it to the pool (after unlocking).
bool ShouldRecycleLocked(Event* ev) {
  if (ev->alive.load(std::memory_order_relaxed) || !ev->pending.empty() || ev->pooled) return false;
  ev->pooled = true;
  return true;
}

kilnError_t ResolveEvent(Runtime& rt, kilnEvent_t handle, const char* role, Event** out) {
  if (handle == nullptr) return Fail(kilnErrorInvalidResourceHandle, "%s is NULL", role);
  if (!rt.event_pool.Contains(handle))
    return Fail(kilnErrorInvalidResourceHandle, "%s %p is not an event from kilnEventCreate", role,
                static_cast<void*>(handle));
  auto* ev = reinterpret_cast<Event*>(handle);
  if (!ev->alive.load(std::memory_order_acquire))
    return Fail(kilnErrorInvalidResourceHandle, "%s %p has been destroyed", role,
                static_cast<void*>(handle));
  *out = ev;
  return kilnSuccess;
}

kilnError_t CreateEvent(Runtime& rt, kilnEvent_t* event, unsigned int flags) {
  if (event == nullptr) return Fail(kilnErrorInvalidValue, "event is NULL");
  constexpr unsigned kKnown = kilnEventBlockingSync | kilnEventDisableTiming;
  if ((flags & ~kKnown) != 0)
    return Fail(kilnErrorInvalidValue,
                "flags 0x%x contain unknown bits; allowed are kilnEventDefault, "
                "kilnEventBlockingSync and kilnEventDisableTiming",
                flags);
  Event* ev = rt.event_pool.Acquire();
  {
    std::lock_guard<std::mutex> lock(ev->mu);
    ev->latest_gen = 0;
    ev->latest_time_ns = 0;
    ev->captured = kiln::CapturedRecord();
    ev->pooled = false;
  }
  ev->flags.store(flags, std::memory_order_relaxed);
  ev->alive.store(true, std::memory_order_release);
  *event = reinterpret_cast<kilnEvent_t>(ev);
  return kilnSuccess;
}

struct Snapshot {
  unsigned flags;
  uint64_t latest;
  bool pending;
  int64_t time_ns;
  bool captured;  // the latest record was made on a capturing stream
};

bool LatestIsCapturedLocked(const Event* ev) {
  return ev->latest_gen != 0 && ev->captured.gen == ev->latest_gen;
}

Snapshot Snap(Event* ev) {
  std::lock_guard<std::mutex> lock(ev->mu);
  return Snapshot{ev->flags.load(std::memory_order_relaxed), ev->latest_gen,
                  ev->latest_gen != 0 && ev->IsPendingLocked(ev->latest_gen), ev->latest_time_ns,
                  LatestIsCapturedLocked(ev)};
}

// kilnErrorCapturedEvent for `api` on an event whose latest record was
// captured (Note [Cross-stream capture] in graph.cc): it has no time and
// never completes outside a launch of the graph.
kilnError_t FailCapturedEvent(kilnEvent_t event) {
  return Fail(kilnErrorCapturedEvent,
              "event %p was last recorded on a capturing stream, so it marks a point in a graph, "
              "not work that runs; record it outside the capture to query, synchronize or time it",
              static_cast<void*>(event));
}

// A completed event whose stream held a sticky error when the record ran
// reports that error (once, as a stream synchronize would, which it then
// clears): work the program waits for through the event was skipped.
kilnError_t TakeFailureBehind(Event* ev) {
  Stream* failed = nullptr;
  {
    std::lock_guard<std::mutex> lock(ev->mu);
    failed = ev->latest_failed_stream;
    ev->latest_failed_stream = nullptr;
  }
  return failed != nullptr ? failed->TakeStickyError() : kilnSuccess;
}

}  // namespace

void CompleteEventRecord(Event* ev, uint64_t gen, Stream* stream, uint64_t seq) {
  const int64_t now = NowNs();
  bool recycle;
  {
    std::lock_guard<std::mutex> lock(ev->mu);
    stream->AdvanceCompleted(seq);  // before anyone can see the record done
    ev->pending.Remove(gen);
    if (gen == ev->latest_gen) {
      ev->latest_time_ns = now;
      ev->latest_failed_stream = stream->HasStickyError() ? stream : nullptr;
    }
    recycle = ShouldRecycleLocked(ev);
  }
  ev->cv.notify_all();  // events are never freed: safe after unlock
  if (recycle) GetRuntime().event_pool.Release(ev);
}

void WaitEventGeneration(Event* ev, uint64_t gen) {
  std::unique_lock<std::mutex> lock(ev->mu);
  ev->cv.wait(lock, [&] { return !ev->IsPendingLocked(gen); });
}

// kilnEventSynchronize's wait: a host wait (Note [Interruptible host waits]).
kilnError_t HostWaitEventGeneration(Event* ev, uint64_t gen) {
  std::unique_lock<std::mutex> lock(ev->mu);
  return HostWait(lock, ev->cv, [&] { return !ev->IsPendingLocked(gen); });
}

}  // namespace kiln

using kiln::ApiCall;
using kiln::Event;
using kiln::Fail;
using kiln::Runtime;
using kiln::Stream;

extern "C" {

KILN_API kilnError_t kilnEventCreate(kilnEvent_t* event) {
  return ApiCall("kilnEventCreate", [&](Runtime& rt) { return kiln::CreateEvent(rt, event, 0); });
}

KILN_API kilnError_t kilnEventCreateWithFlags(kilnEvent_t* event, unsigned int flags) {
  return ApiCall("kilnEventCreateWithFlags",
                 [&](Runtime& rt) { return kiln::CreateEvent(rt, event, flags); });
}

KILN_API kilnError_t kilnEventDestroy(kilnEvent_t event) {
  return ApiCall("kilnEventDestroy", [&](Runtime& rt) {
    Event* ev = nullptr;
    if (kilnError_t err = kiln::ResolveEvent(rt, event, "event", &ev)) return err;
    bool recycle;
    {
      std::lock_guard<std::mutex> lock(ev->mu);
      if (!ev->alive.load(std::memory_order_relaxed))
        return Fail(kilnErrorInvalidResourceHandle, "event %p has been destroyed",
                    static_cast<void*>(event));
      ev->alive.store(false, std::memory_order_release);
      recycle = kiln::ShouldRecycleLocked(ev);
    }
    if (recycle) rt.event_pool.Release(ev);
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnEventRecord(kilnEvent_t event, kilnStream_t stream) {
  return ApiCall("kilnEventRecord", [&](Runtime& rt) {
    kiln::ApiActivity activity(rt, "kilnEventRecord");
    Event* ev = nullptr;
    Stream* s = nullptr;
    if (kilnError_t err = kiln::ResolveEvent(rt, event, "event", &ev)) return err;
    if (kilnError_t err = kiln::ResolveStream(rt, stream, &s)) return err;
    if (__builtin_expect(s->capturing(), 0)) {
      // Note [Cross-stream capture]: a mark in the capture, nothing queued.
      kiln::CapturedRecord record;
      bool captured = false;
      if (kilnError_t err = s->MarkCapturedRecord(&record, &captured)) return err;
      if (captured) {
        std::lock_guard<std::mutex> lock(ev->mu);
        if (!ev->alive.load(std::memory_order_relaxed))
          return Fail(kilnErrorInvalidResourceHandle, "event %p has been destroyed",
                      static_cast<void*>(event));
        record.gen = ++ev->next_gen;
        ev->latest_gen = record.gen;
        ev->latest_time_ns = 0;
        ev->latest_failed_stream = nullptr;
        ev->captured = std::move(record);
        return kilnSuccess;
      }
    }

    uint64_t gen, prev_gen;
    int64_t prev_time;
    {
      std::lock_guard<std::mutex> lock(ev->mu);
      if (!ev->alive.load(std::memory_order_relaxed))
        return Fail(kilnErrorInvalidResourceHandle, "event %p has been destroyed",
                    static_cast<void*>(event));
      gen = ev->next_gen + 1;
      ev->pending.Add(gen, s);  // first: if it throws, nothing changed
      ev->next_gen = gen;
      prev_gen = ev->latest_gen;
      prev_time = ev->latest_time_ns;
      ev->latest_gen = gen;
    }
    kiln::Entry e;
    e.kind = kiln::EntryKind::kRecord;
    e.event = ev;
    e.gen = gen;
    activity.Attach(e, s, kilnActivityKindEventRecord, "Event Record");
    // Not holding ev->mu: in blocking mode the record completes inside Submit.
    bool consumed = false;
    const kilnError_t err = s->Submit(e, nullptr, &consumed);
    if (!consumed) activity.Detach(e);
    if (err != kilnSuccess) {
      bool recycle;
      {
        std::lock_guard<std::mutex> lock(ev->mu);
        ev->pending.Remove(gen);
        if (ev->latest_gen == gen) {
          ev->latest_gen = prev_gen;
          ev->latest_time_ns = prev_time;
        }
        recycle = kiln::ShouldRecycleLocked(ev);
      }
      ev->cv.notify_all();
      if (recycle) rt.event_pool.Release(ev);
    }
    return err;
  });
}

KILN_API kilnError_t kilnStreamWaitEvent(kilnStream_t stream, kilnEvent_t event, unsigned int flags) {
  return ApiCall("kilnStreamWaitEvent", [&](Runtime& rt) {
    kiln::ApiActivity activity(rt, "kilnStreamWaitEvent");
    if (flags != 0) return Fail(kilnErrorInvalidValue, "flags must be 0 (got %u)", flags);
    Stream* s = nullptr;
    Event* ev = nullptr;
    if (kilnError_t err = kiln::ResolveStream(rt, stream, &s)) return err;
    if (kilnError_t err = kiln::ResolveEvent(rt, event, "event", &ev)) return err;
    activity.SetStream(s);
    uint64_t gen;
    kiln::CapturedRecord captured;
    {
      std::lock_guard<std::mutex> lock(ev->mu);
      gen = ev->latest_gen;
      if (kiln::LatestIsCapturedLocked(ev)) {
        captured = ev->captured;
      } else if (gen == 0 || !ev->IsPendingLocked(gen)) {
        return kilnSuccess;  // already complete
      }
    }
    // Note [Cross-stream capture]: join the capture, or order within it.
    if (captured.gen != 0) return s->WaitCapturedRecord(captured);
    if (kilnError_t err = s->RefuseIfCapturing(
            "kilnStreamWaitEvent on the capturing stream for a record made outside the capture "
            "that has not completed (a graph cannot wait for uncaptured work)"))
      return err;
    kiln::Entry e;
    e.kind = kiln::EntryKind::kWait;
    e.event = ev;
    e.gen = gen;
    activity.Attach(e, s, kilnActivityKindEventWait, "Event Wait");
    bool consumed = false;
    const kilnError_t err = s->Submit(e, nullptr, &consumed);
    if (!consumed) activity.Detach(e);
    return err;
  });
}

KILN_API kilnError_t kilnEventQuery(kilnEvent_t event) {
  return ApiCall("kilnEventQuery", [&](Runtime& rt) {
    Event* ev = nullptr;
    if (kilnError_t err = kiln::ResolveEvent(rt, event, "event", &ev)) return err;
    const kiln::Snapshot snap = kiln::Snap(ev);
    if (snap.captured) return kiln::FailCapturedEvent(event);
    if (snap.pending) return kilnErrorNotReady;
    return kiln::TakeFailureBehind(ev);
  });
}

KILN_API kilnError_t kilnEventSynchronize(kilnEvent_t event) {
  return ApiCall("kilnEventSynchronize", [&](Runtime& rt) {
    kiln::ApiActivity activity(rt, "kilnEventSynchronize");
    Event* ev = nullptr;
    if (kilnError_t err = kiln::ResolveEvent(rt, event, "event", &ev)) return err;
    uint64_t gen;
    bool complete = false;
    {
      std::lock_guard<std::mutex> lock(ev->mu);
      gen = ev->latest_gen;
      if (gen == 0) return kilnSuccess;  // never recorded
      if (kiln::LatestIsCapturedLocked(ev)) return kiln::FailCapturedEvent(event);
      const kiln::PendingRecords::Record* record = ev->pending.Find(gen);
      complete = record == nullptr;
      if (!complete) {
        activity.SetStream(record->stream);
        // See Note [Blocking calls inside tasks].
        if (record->stream == kiln::t_running_stream)
          return Fail(kilnErrorNotPermitted,
                      "event %p was recorded on the stream of the calling task, behind it; "
                      "waiting for it from inside that task would never end",
                      static_cast<void*>(event));
      }
    }
    // Already complete (the record may have run before this call): a failure
    // it was recorded behind is still reported, once, as after a wait.
    if (complete) return kiln::TakeFailureBehind(ev);
    auto done = [&] {
      std::lock_guard<std::mutex> lock(ev->mu);
      return !ev->IsPendingLocked(gen);
    };
    if (!kiln::SpinUntil(done, kiln::kEventSpinNs)) {
      if (kilnError_t err = kiln::HostWaitEventGeneration(ev, gen)) return err;
    }
    return kiln::TakeFailureBehind(ev);
  });
}

KILN_API kilnError_t kilnEventElapsedTime(float* ms, kilnEvent_t start, kilnEvent_t end) {
  return ApiCall("kilnEventElapsedTime", [&](Runtime& rt) {
    if (ms == nullptr) return Fail(kilnErrorInvalidValue, "ms is NULL");
    Event* evs[2] = {nullptr, nullptr};
    if (kilnError_t err = kiln::ResolveEvent(rt, start, "start event", &evs[0])) return err;
    if (kilnError_t err = kiln::ResolveEvent(rt, end, "end event", &evs[1])) return err;
    const char* roles[2] = {"start", "end"};
    kiln::Snapshot snaps[2] = {kiln::Snap(evs[0]), kiln::Snap(evs[1])};
    for (int i = 0; i < 2; ++i) {
      if (snaps[i].flags & kilnEventDisableTiming)
        return Fail(kilnErrorInvalidResourceHandle,
                    "the %s event %p was created with kilnEventDisableTiming and cannot be timed",
                    roles[i], static_cast<void*>(evs[i]));
      if (snaps[i].latest == 0)
        return Fail(kilnErrorInvalidResourceHandle,
                    "the %s event %p has never been recorded; record both events first", roles[i],
                    static_cast<void*>(evs[i]));
    }
    for (int i = 0; i < 2; ++i) {
      if (snaps[i].captured) return kiln::FailCapturedEvent(i == 0 ? start : end);
    }
    for (int i = 0; i < 2; ++i) {
      if (snaps[i].pending)
        return Fail(kilnErrorNotReady,
                    "the %s event %p has not completed yet; synchronize on it first", roles[i],
                    static_cast<void*>(evs[i]));
    }
    *ms = static_cast<float>(static_cast<double>(snaps[1].time_ns - snaps[0].time_ns) / 1e6);
    return kilnSuccess;
  });
}

}  // extern "C"
