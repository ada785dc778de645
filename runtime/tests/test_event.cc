// test_event.cc — events: record, query, synchronize, cross-stream and
// cross-device waits, re-recording, destruction while pending, timing.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "test_util.h"

using kiln_test::GateGuard;
using kiln_test::Launch;
using kiln_test::LaunchGate;
using kiln_test::LastMessage;
using kiln_test::MakeGate;

namespace {

// A task that keeps its stream busy for at least `ms` of steady-clock time
// (it measures, so the bound holds however the host schedules it).
kilnError_t LaunchBusy(kilnStream_t s, double ms) {
  return Launch(s, [ms] {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double, std::milli>(ms);
    while (std::chrono::steady_clock::now() < until) {
    }
  });
}

}  // namespace

TEST(Event, NeverRecordedEventIsComplete) {
  kilnEvent_t e = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&e));
  EXPECT_KILN_OK(kilnEventQuery(e));
  EXPECT_KILN_OK(kilnEventSynchronize(e));
  EXPECT_KILN_OK(kilnStreamWaitEvent(nullptr, e, 0));  // waits for nothing
  EXPECT_KILN_OK(kilnStreamSynchronize(nullptr));
  ASSERT_KILN_OK(kilnEventDestroy(e));
}

TEST(Event, QueryIsNotReadyUntilTheRecordedWorkFinishes) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  kilnEvent_t e = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&e));
  auto gate = MakeGate();
  {
    GateGuard guard{gate};
    ASSERT_KILN_OK(LaunchGate(s, gate));
    ASSERT_KILN_OK(kilnEventRecord(e, s));
    EXPECT_KILN_ERR(kilnEventQuery(e), kilnErrorNotReady);
    float ms = 0;
    EXPECT_KILN_ERR(kilnEventElapsedTime(&ms, e, e), kilnErrorNotReady);
  }
  ASSERT_KILN_OK(kilnEventSynchronize(e));
  EXPECT_KILN_OK(kilnEventQuery(e));
  EXPECT_KILN_OK(kilnStreamQuery(s)) << "the record was the stream's last work";
  ASSERT_KILN_OK(kilnEventDestroy(e));
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(Event, EventSynchronizeWaitsForTheWorkBeforeTheRecord) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  kilnEvent_t e = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&e));
  std::atomic<int> value{0};
  ASSERT_KILN_OK(LaunchBusy(s, 2));
  ASSERT_KILN_OK(Launch(s, [&value] { value = 42; }));
  ASSERT_KILN_OK(kilnEventRecord(e, s));
  ASSERT_KILN_OK(kilnEventSynchronize(e));
  EXPECT_EQ(value.load(), 42);
  ASSERT_KILN_OK(kilnEventDestroy(e));
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(Event, StreamWaitEventOrdersWorkAcrossStreams) {
  kilnStream_t a = nullptr, b = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&a));
  ASSERT_KILN_OK(kilnStreamCreate(&b));
  kilnEvent_t e = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&e));
  int produced = 0;  // written on a, read on b: ordered only by the event
  int seen = -1;
  auto gate = MakeGate();
  {
    GateGuard guard{gate};
    ASSERT_KILN_OK(LaunchGate(a, gate));  // the "slow" producer
    ASSERT_KILN_OK(Launch(a, [&produced] { produced = 42; }));
    ASSERT_KILN_OK(kilnEventRecord(e, a));
    ASSERT_KILN_OK(kilnStreamWaitEvent(b, e, 0));
    ASSERT_KILN_OK(Launch(b, [&] { seen = produced; }));
    EXPECT_KILN_ERR(kilnStreamQuery(b), kilnErrorNotReady) << "b must wait for a's record";
  }
  ASSERT_KILN_OK(kilnStreamSynchronize(b));
  EXPECT_EQ(seen, 42);
  ASSERT_KILN_OK(kilnStreamSynchronize(a));
  ASSERT_KILN_OK(kilnEventDestroy(e));
  ASSERT_KILN_OK(kilnStreamDestroy(a));
  ASSERT_KILN_OK(kilnStreamDestroy(b));
}

TEST(Event, StreamWaitEventWorksAcrossDevices) {
  kilnStream_t s0 = nullptr, s1 = nullptr;
  ASSERT_KILN_OK(kilnStreamGetDefault(&s0, 0));
  ASSERT_KILN_OK(kilnStreamGetDefault(&s1, 1));
  kilnEvent_t e = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&e));
  std::atomic<int> produced{0};
  int seen = -1;
  auto gate = MakeGate();
  {
    GateGuard guard{gate};
    ASSERT_KILN_OK(LaunchGate(s0, gate));
    ASSERT_KILN_OK(Launch(s0, [&produced] { produced = 7; }));
    ASSERT_KILN_OK(kilnEventRecord(e, s0));
    ASSERT_KILN_OK(kilnStreamWaitEvent(s1, e, 0));
    ASSERT_KILN_OK(Launch(s1, [&] { seen = produced.load(); }));
  }
  ASSERT_KILN_OK(kilnStreamSynchronize(s1));
  EXPECT_EQ(seen, 7);
  ASSERT_KILN_OK(kilnEventDestroy(e));
}

TEST(Event, AWaitRefersToTheRecordThatWasLatestWhenItWasMade) {
  kilnStream_t a = nullptr, b = nullptr, c = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&a));
  ASSERT_KILN_OK(kilnStreamCreate(&b));
  ASSERT_KILN_OK(kilnStreamCreate(&c));
  kilnEvent_t e = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&e));
  std::atomic<int> produced{0};
  int seen = -1;
  auto gate = MakeGate();
  {
    GateGuard guard{gate};
    ASSERT_KILN_OK(LaunchGate(a, gate));
    ASSERT_KILN_OK(Launch(a, [&produced] { produced = 5; }));
    ASSERT_KILN_OK(kilnEventRecord(e, a));        // record 1: pending behind the gate
    ASSERT_KILN_OK(kilnStreamWaitEvent(c, e, 0));  // c waits for record 1
    ASSERT_KILN_OK(Launch(c, [&] { seen = produced.load(); }));
    ASSERT_KILN_OK(kilnEventRecord(e, b));  // record 2 on an idle stream replaces record 1
    ASSERT_KILN_OK(kilnEventSynchronize(e));
    EXPECT_KILN_OK(kilnEventQuery(e)) << "the latest record has completed";
    EXPECT_KILN_ERR(kilnStreamQuery(c), kilnErrorNotReady) << "c still waits for record 1";
  }
  ASSERT_KILN_OK(kilnStreamSynchronize(c));
  EXPECT_EQ(seen, 5);
  ASSERT_KILN_OK(kilnEventDestroy(e));
  for (auto s : {a, b, c}) ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(Event, DestroyingAnEventWithAPendingRecordStillReleasesWaiters) {
  kilnStream_t a = nullptr, b = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&a));
  ASSERT_KILN_OK(kilnStreamCreate(&b));
  kilnEvent_t e = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&e));
  std::atomic<int> produced{0};
  int seen = -1;
  auto gate = MakeGate();
  {
    GateGuard guard{gate};
    ASSERT_KILN_OK(LaunchGate(a, gate));
    ASSERT_KILN_OK(Launch(a, [&produced] { produced = 9; }));
    ASSERT_KILN_OK(kilnEventRecord(e, a));
    ASSERT_KILN_OK(kilnStreamWaitEvent(b, e, 0));
    ASSERT_KILN_OK(Launch(b, [&] { seen = produced.load(); }));
    ASSERT_KILN_OK(kilnEventDestroy(e));
    EXPECT_KILN_ERR(kilnEventQuery(e), kilnErrorInvalidResourceHandle);
    // New events must not disturb the pending record of the destroyed one.
    kilnEvent_t others[4];
    for (auto& o : others) ASSERT_KILN_OK(kilnEventCreate(&o));
    for (auto& o : others) ASSERT_KILN_OK(kilnEventRecord(o, nullptr));
    for (auto& o : others) ASSERT_KILN_OK(kilnEventDestroy(o));
  }
  ASSERT_KILN_OK(kilnStreamSynchronize(b));
  EXPECT_EQ(seen, 9);
  ASSERT_KILN_OK(kilnStreamDestroy(a));
  ASSERT_KILN_OK(kilnStreamDestroy(b));
}

TEST(Event, DestroyedAndForeignHandlesAreRejected) {
  kilnEvent_t e = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&e));
  ASSERT_KILN_OK(kilnEventDestroy(e));
  EXPECT_KILN_ERR(kilnEventDestroy(e), kilnErrorInvalidResourceHandle);
  EXPECT_KILN_ERR(kilnEventRecord(e, nullptr), kilnErrorInvalidResourceHandle);
  EXPECT_KILN_ERR(kilnEventSynchronize(e), kilnErrorInvalidResourceHandle);
  EXPECT_KILN_ERR(kilnStreamWaitEvent(nullptr, e, 0), kilnErrorInvalidResourceHandle);
  int not_an_event[32] = {};
  auto bogus = reinterpret_cast<kilnEvent_t>(&not_an_event[4]);
  EXPECT_KILN_ERR(kilnEventQuery(bogus), kilnErrorInvalidResourceHandle);
  EXPECT_NE(LastMessage().find("not an event"), std::string::npos) << LastMessage();
  EXPECT_KILN_ERR(kilnEventQuery(nullptr), kilnErrorInvalidResourceHandle);
  // A stream handle is not an event.
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamGetDefault(&s, 0));
  EXPECT_KILN_ERR(kilnEventQuery(reinterpret_cast<kilnEvent_t>(s)), kilnErrorInvalidResourceHandle);
}

TEST(Event, FlagsAreChecked) {
  kilnEvent_t e = nullptr;
  EXPECT_KILN_ERR(kilnEventCreateWithFlags(&e, 0x8), kilnErrorInvalidValue);
  ASSERT_KILN_OK(kilnEventCreateWithFlags(&e, kilnEventBlockingSync | kilnEventDisableTiming));
  ASSERT_KILN_OK(kilnEventRecord(e, nullptr));
  ASSERT_KILN_OK(kilnEventSynchronize(e));
  EXPECT_KILN_ERR(kilnStreamWaitEvent(nullptr, e, 1), kilnErrorInvalidValue);
  ASSERT_KILN_OK(kilnEventDestroy(e));
}

TEST(Event, ElapsedTimeNeedsTwoRecordedTimingEvents) {
  kilnEvent_t timed = nullptr, untimed = nullptr, unrecorded = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&timed));
  ASSERT_KILN_OK(kilnEventCreateWithFlags(&untimed, kilnEventDisableTiming));
  ASSERT_KILN_OK(kilnEventCreate(&unrecorded));
  ASSERT_KILN_OK(kilnEventRecord(timed, nullptr));
  ASSERT_KILN_OK(kilnEventRecord(untimed, nullptr));
  ASSERT_KILN_OK(kilnStreamSynchronize(nullptr));
  float ms = -1;
  EXPECT_KILN_ERR(kilnEventElapsedTime(&ms, timed, untimed), kilnErrorInvalidResourceHandle);
  EXPECT_NE(LastMessage().find("kilnEventDisableTiming"), std::string::npos) << LastMessage();
  EXPECT_KILN_ERR(kilnEventElapsedTime(&ms, unrecorded, timed), kilnErrorInvalidResourceHandle);
  EXPECT_NE(LastMessage().find("never been recorded"), std::string::npos) << LastMessage();
  ASSERT_KILN_OK(kilnEventElapsedTime(&ms, timed, timed));
  EXPECT_EQ(ms, 0.0f);
  for (auto e : {timed, untimed, unrecorded}) ASSERT_KILN_OK(kilnEventDestroy(e));
}

TEST(Event, ElapsedTimeIsNonNegativeAndLargerForLongerWork) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  kilnEvent_t e[4];
  for (auto& x : e) ASSERT_KILN_OK(kilnEventCreate(&x));
  ASSERT_KILN_OK(kilnEventRecord(e[0], s));
  ASSERT_KILN_OK(kilnEventRecord(e[1], s));  // nothing between
  ASSERT_KILN_OK(kilnEventRecord(e[2], s));
  ASSERT_KILN_OK(LaunchBusy(s, 20));
  ASSERT_KILN_OK(kilnEventRecord(e[3], s));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  float empty = -1, busy = -1, backwards = 1;
  ASSERT_KILN_OK(kilnEventElapsedTime(&empty, e[0], e[1]));
  ASSERT_KILN_OK(kilnEventElapsedTime(&busy, e[2], e[3]));
  ASSERT_KILN_OK(kilnEventElapsedTime(&backwards, e[3], e[2]));
  EXPECT_GE(empty, 0.0f);
  EXPECT_GE(busy, 20.0f * 0.999f) << "the task ran for at least 20 ms between the records";
  EXPECT_GT(busy, empty);
  EXPECT_LT(backwards, 0.0f) << "end completed before start";
  EXPECT_FLOAT_EQ(backwards, -busy);
  for (auto& x : e) ASSERT_KILN_OK(kilnEventDestroy(x));
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(Event, EventSynchronizeOnARecordBehindTheCallingTaskIsNotPermitted) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  kilnEvent_t e = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&e));
  auto gate = MakeGate();
  kilnError_t inside = kilnSuccess;
  {
    GateGuard guard{gate};
    ASSERT_KILN_OK(Launch(s, [&inside, gate, e] {
      gate->Wait();  // the record below is enqueued by now
      inside = kilnEventSynchronize(e);
    }));
    ASSERT_KILN_OK(kilnEventRecord(e, s));
  }
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  EXPECT_EQ(inside, kilnErrorNotPermitted);
  ASSERT_KILN_OK(kilnEventDestroy(e));
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(Event, ManyEventsRecordedAndWaitedOnInALoop) {
  kilnStream_t a = nullptr, b = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&a));
  ASSERT_KILN_OK(kilnStreamCreate(&b));
  kilnEvent_t e = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&e));
  std::atomic<int> produced{0};
  std::atomic<int> mismatches{0};
  for (int i = 1; i <= 500; ++i) {
    ASSERT_KILN_OK(Launch(a, [&produced, i] { produced = i; }));
    ASSERT_KILN_OK(kilnEventRecord(e, a));
    ASSERT_KILN_OK(kilnStreamWaitEvent(b, e, 0));
    ASSERT_KILN_OK(Launch(b, [&produced, &mismatches, i] {
      if (produced.load() < i) ++mismatches;
    }));
  }
  ASSERT_KILN_OK(kilnStreamSynchronize(b));
  EXPECT_EQ(mismatches.load(), 0);
  ASSERT_KILN_OK(kilnEventDestroy(e));
  ASSERT_KILN_OK(kilnStreamDestroy(a));
  ASSERT_KILN_OK(kilnStreamDestroy(b));
}
