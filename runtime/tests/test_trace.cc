// test_trace.cc — activity tracing (kilnActivity*, kilnStreamGetId): what is
// recorded, with which times, ids and names; collections, flushing, limits;
// external correlation ids. See "Activity tracing" in <kiln/runtime.h>.
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

using kiln_test::ExpectChildPasses;
using kiln_test::GateGuard;
using kiln_test::Launch;
using kiln_test::LaunchGate;
using kiln_test::LastMessage;
using kiln_test::MakeGate;

namespace {

using Records = std::vector<kilnActivityRecord>;

// Every record available now, oldest first.
Records DrainAll() {
  size_t available = 0;
  EXPECT_KILN_OK(kilnActivityGetRecords(nullptr, 0, &available));
  Records out(available);
  size_t got = 0;
  if (available > 0) {
    EXPECT_KILN_OK(kilnActivityGetRecords(out.data(), out.size(), &got));
  }
  out.resize(got);
  return out;
}

Records OfKind(const Records& records, kilnActivityKind kind) {
  Records out;
  for (const auto& r : records)
    if (r.kind == kind) out.push_back(r);
  return out;
}

const kilnActivityRecord* Named(const Records& records, kilnActivityKind kind, const char* name) {
  for (const auto& r : records)
    if (r.kind == kind && std::strcmp(r.name, name) == 0) return &r;
  return nullptr;
}

// The Api record sharing `r`'s correlation id.
const kilnActivityRecord* ApiOf(const Records& records, const kilnActivityRecord& r) {
  for (const auto& a : records)
    if (a.kind == kilnActivityKindApi && a.correlationId == r.correlationId) return &a;
  return nullptr;
}

unsigned long long StreamId(kilnStream_t s) {
  unsigned long long id = 0;
  EXPECT_KILN_OK(kilnStreamGetId(s, &id));
  return id;
}

long long Now() {
  long long t = 0;
  EXPECT_KILN_OK(kilnActivityGetTimestamp(&t));
  return t;
}

unsigned long long ThisThreadId() { return static_cast<unsigned long long>(::syscall(SYS_gettid)); }

void SleepMs(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// Tracing is process-wide: every test starts a fresh collection and leaves
// tracing off.
class Trace : public testing::Test {
 protected:
  void SetUp() override { ASSERT_KILN_OK(kilnActivityEnable(0)); }
  void TearDown() override {
    EXPECT_KILN_OK(kilnActivityDisable());
    EXPECT_KILN_OK(kilnActivityFlushAll());
    DrainAll();
  }
};

}  // namespace

TEST_F(Trace, ATaskRecordNamesItsStreamDeviceAndTimesOnTheDeviceClock) {
  ASSERT_KILN_OK(kilnSetDevice(1));
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  ASSERT_KILN_OK(kilnSetDevice(0));
  const long long before = Now();
  ASSERT_KILN_OK(Launch(s, [] { SleepMs(3); }, "aten::mm"));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  const long long after = Now();

  const Records records = DrainAll();
  const Records tasks = OfKind(records, kilnActivityKindTask);
  ASSERT_EQ(tasks.size(), 1u);
  const kilnActivityRecord& t = tasks[0];
  EXPECT_STREQ(t.name, "aten::mm");
  EXPECT_EQ(t.device, 1);
  EXPECT_EQ(t.streamId, StreamId(s));
  EXPECT_NE(t.streamId, 0u);
  EXPECT_GE(t.start, before);
  EXPECT_LE(t.end, after);
  EXPECT_GE(t.end - t.start, 3'000'000) << "the task slept 3 ms";
  EXPECT_EQ(t.bytes, 0u);
  EXPECT_EQ(t.externalId, 0u);
  EXPECT_EQ(t.userExternalId, 0u);
  EXPECT_EQ(t.threadId, ThisThreadId()) << "the thread that enqueued it";

  // Its launch: an Api record on this thread with the same correlation id,
  // which began before the task did.
  const kilnActivityRecord* api = ApiOf(records, t);
  ASSERT_NE(api, nullptr);
  EXPECT_STREQ(api->name, "kilnLaunchTask");
  EXPECT_EQ(api->threadId, ThisThreadId());
  EXPECT_EQ(api->device, 1);
  EXPECT_EQ(api->streamId, t.streamId);
  EXPECT_LE(api->start, t.start);
  EXPECT_LE(api->start, api->end);
  EXPECT_NE(t.correlationId, 0u);

  // The synchronization is an Api record too, with no device record.
  const kilnActivityRecord* sync = Named(records, kilnActivityKindApi, "kilnStreamSynchronize");
  ASSERT_NE(sync, nullptr);
  EXPECT_EQ(sync->streamId, t.streamId);
  EXPECT_GE(sync->end, t.end) << "it returned after the task finished";
  for (const auto& r : records) {
    if (r.kind != kilnActivityKindApi) {
      EXPECT_NE(r.correlationId, sync->correlationId);
    }
  }
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST_F(Trace, TasksOfOneStreamAreRecordedInOrderWithoutOverlap) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  for (int i = 0; i < 50; ++i) ASSERT_KILN_OK(Launch(s, [] {}, "tiny"));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  const Records tasks = OfKind(DrainAll(), kilnActivityKindTask);
  ASSERT_EQ(tasks.size(), 50u);
  std::set<unsigned long long> correlations;
  for (size_t i = 0; i < tasks.size(); ++i) {
    EXPECT_LE(tasks[i].start, tasks[i].end);
    if (i > 0) {
      EXPECT_GE(tasks[i].start, tasks[i - 1].end) << "a stream runs one entry at a time";
      EXPECT_GT(tasks[i].correlationId, tasks[i - 1].correlationId);
    }
    correlations.insert(tasks[i].correlationId);
  }
  EXPECT_EQ(correlations.size(), 50u) << "correlation ids are unique";
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST_F(Trace, RecordTimestampsAreOnTheEventClock) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  kilnEvent_t a = nullptr, b = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&a));
  ASSERT_KILN_OK(kilnEventCreate(&b));
  ASSERT_KILN_OK(kilnEventRecord(a, s));
  ASSERT_KILN_OK(Launch(s, [] { SleepMs(5); }, "sleep"));
  ASSERT_KILN_OK(kilnEventRecord(b, s));
  ASSERT_KILN_OK(kilnEventSynchronize(b));
  float ms = 0;
  ASSERT_KILN_OK(kilnEventElapsedTime(&ms, a, b));

  const Records records = DrainAll();
  const Records marks = OfKind(records, kilnActivityKindEventRecord);
  ASSERT_EQ(marks.size(), 2u);
  const Records tasks = OfKind(records, kilnActivityKindTask);
  ASSERT_EQ(tasks.size(), 1u);
  EXPECT_STREQ(marks[0].name, "Event Record");
  EXPECT_EQ(marks[0].start, marks[0].end) << "an event record is an instant";
  EXPECT_LE(marks[0].end, tasks[0].start);
  EXPECT_GE(marks[1].start, tasks[0].end);
  // The records' timestamps and the events' are readings of one clock: the
  // events' elapsed time matches the distance between their records.
  const double record_ms = static_cast<double>(marks[1].start - marks[0].start) / 1e6;
  EXPECT_NEAR(record_ms, ms, 0.5);
  EXPECT_GE(ms, 5.0f);
  ASSERT_KILN_OK(kilnEventDestroy(a));
  ASSERT_KILN_OK(kilnEventDestroy(b));
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST_F(Trace, CopiesAndMemsetsRecordTheirDirectionBytesAndDevices) {
  constexpr size_t kBytes = 4096;
  void* d0 = nullptr;
  void* d0b = nullptr;
  void* d1 = nullptr;
  void* pinned = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&d0, kBytes));
  ASSERT_KILN_OK(kilnMalloc(&d0b, kBytes));
  ASSERT_KILN_OK(kilnSetDevice(1));
  ASSERT_KILN_OK(kilnMalloc(&d1, kBytes));
  ASSERT_KILN_OK(kilnSetDevice(0));
  ASSERT_KILN_OK(kilnMallocHost(&pinned, kBytes));
  std::vector<char> host(kBytes, 7);

  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamGetDefault(&s, 0));
  ASSERT_KILN_OK(kilnMemcpyAsync(d0, host.data(), kBytes, kilnMemcpyHostToDevice, s));
  ASSERT_KILN_OK(kilnMemsetAsync(d0b, 0, kBytes / 2, s));
  ASSERT_KILN_OK(kilnMemcpyAsync(d0b, d0, kBytes, kilnMemcpyDeviceToDevice, s));
  ASSERT_KILN_OK(kilnMemcpyPeerAsync(d1, 1, d0, 0, kBytes, s));
  ASSERT_KILN_OK(kilnMemcpyAsync(pinned, d0b, kBytes, kilnMemcpyDeviceToHost, s));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));  // the peer copy wrote d1
  ASSERT_KILN_OK(kilnMemcpy(host.data(), d1, kBytes, kilnMemcpyDeviceToHost));
  ASSERT_KILN_OK(kilnDeviceSynchronize());

  const Records records = DrainAll();
  struct Expect {
    kilnActivityKind kind;
    const char* name;
    size_t bytes;
    int src, dst, device;
  };
  const Expect expected[] = {
      {kilnActivityKindMemcpyHtoD, "Memcpy HtoD (Pageable -> Device)", kBytes, -1, 0, 0},
      {kilnActivityKindMemset, "Memset (Device)", kBytes / 2, -1, 0, 0},
      {kilnActivityKindMemcpyDtoD, "Memcpy DtoD (Device -> Device)", kBytes, 0, 0, 0},
      {kilnActivityKindMemcpyPeer, "Memcpy PtoP (Device -> Device)", kBytes, 0, 1, 0},
      {kilnActivityKindMemcpyDtoH, "Memcpy DtoH (Device -> Pinned)", kBytes, 0, -1, 0},
      // kilnMemcpy runs on the default stream of the device that owns the
      // device side: device 1.
      {kilnActivityKindMemcpyDtoH, "Memcpy DtoH (Device -> Pageable)", kBytes, 1, -1, 1},
  };
  for (const Expect& e : expected) {
    const kilnActivityRecord* r = Named(records, e.kind, e.name);
    ASSERT_NE(r, nullptr) << "no record named " << e.name;
    EXPECT_EQ(r->bytes, e.bytes) << e.name;
    EXPECT_EQ(r->srcDevice, e.src) << e.name;
    EXPECT_EQ(r->dstDevice, e.dst) << e.name;
    EXPECT_EQ(r->device, e.device) << e.name;
    EXPECT_LE(r->start, r->end) << e.name;
    const kilnActivityRecord* api = ApiOf(records, *r);
    ASSERT_NE(api, nullptr) << e.name;
    EXPECT_EQ(api->bytes, e.bytes) << e.name;
  }
  EXPECT_NE(Named(records, kilnActivityKindApi, "kilnMemcpyPeerAsync"), nullptr);
  EXPECT_NE(Named(records, kilnActivityKindApi, "kilnMemsetAsync"), nullptr);
  const kilnActivityRecord* sync_copy = Named(records, kilnActivityKindApi, "kilnMemcpy");
  const kilnActivityRecord* sync_copy_work =
      Named(records, kilnActivityKindMemcpyDtoH, "Memcpy DtoH (Device -> Pageable)");
  ASSERT_NE(sync_copy, nullptr);
  ASSERT_NE(sync_copy_work, nullptr);
  EXPECT_GE(sync_copy->end, sync_copy_work->end) << "kilnMemcpy returns after its copy";
  EXPECT_EQ(OfKind(records, kilnActivityKindMemcpyHtoH).size(), 0u);

  ASSERT_KILN_OK(kilnFree(d0));
  ASSERT_KILN_OK(kilnFree(d0b));
  ASSERT_KILN_OK(kilnFree(d1));
  ASSERT_KILN_OK(kilnFreeHost(pinned));
}

TEST_F(Trace, RecordsCarryTheEnqueueingThreadsInnermostExternalIds) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  ASSERT_KILN_OK(kilnActivityPushExternalCorrelationId(kilnExternalCorrelationKindUser, 100));
  ASSERT_KILN_OK(kilnActivityPushExternalCorrelationId(kilnExternalCorrelationKindDefault, 7));
  ASSERT_KILN_OK(Launch(s, [] {}, "A"));
  ASSERT_KILN_OK(kilnActivityPushExternalCorrelationId(kilnExternalCorrelationKindDefault, 8));
  ASSERT_KILN_OK(Launch(s, [] {}, "B"));
  // Another thread's ids never leak into this thread's records, and this
  // thread's into its.
  std::thread other([s] {
    EXPECT_KILN_OK(kilnActivityPushExternalCorrelationId(kilnExternalCorrelationKindDefault, 55));
    EXPECT_KILN_OK(Launch(s, [] {}, "other"));
    unsigned long long popped = 0;
    EXPECT_KILN_OK(kilnActivityPopExternalCorrelationId(kilnExternalCorrelationKindDefault, &popped));
    EXPECT_EQ(popped, 55u);
  });
  other.join();
  unsigned long long popped = 0;
  ASSERT_KILN_OK(kilnActivityPopExternalCorrelationId(kilnExternalCorrelationKindDefault, &popped));
  EXPECT_EQ(popped, 8u);
  ASSERT_KILN_OK(Launch(s, [] {}, "C"));
  ASSERT_KILN_OK(kilnActivityPopExternalCorrelationId(kilnExternalCorrelationKindDefault, nullptr));
  ASSERT_KILN_OK(kilnActivityPopExternalCorrelationId(kilnExternalCorrelationKindUser, &popped));
  EXPECT_EQ(popped, 100u);
  ASSERT_KILN_OK(Launch(s, [] {}, "D"));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));

  const Records records = DrainAll();
  struct Expect {
    const char* name;
    unsigned long long external, user;
  };
  for (const Expect& e : {Expect{"A", 7, 100}, Expect{"B", 8, 100}, Expect{"other", 55, 0},
                          Expect{"C", 7, 100}, Expect{"D", 0, 0}}) {
    const kilnActivityRecord* t = Named(records, kilnActivityKindTask, e.name);
    ASSERT_NE(t, nullptr) << e.name;
    EXPECT_EQ(t->externalId, e.external) << e.name;
    EXPECT_EQ(t->userExternalId, e.user) << e.name;
    const kilnActivityRecord* api = ApiOf(records, *t);
    ASSERT_NE(api, nullptr) << e.name;
    EXPECT_EQ(api->externalId, e.external) << e.name;
    EXPECT_EQ(api->userExternalId, e.user) << e.name;
  }
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(TraceCorrelation, PushAndPopValidateTheirArguments) {
  EXPECT_KILN_ERR(kilnActivityPopExternalCorrelationId(kilnExternalCorrelationKindDefault, nullptr),
                  kilnErrorInvalidValue);
  EXPECT_NE(LastMessage().find("no external correlation id"), std::string::npos) << LastMessage();
  EXPECT_KILN_ERR(kilnActivityPushExternalCorrelationId(static_cast<kilnExternalCorrelationKind>(2), 1),
                  kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnActivityPopExternalCorrelationId(static_cast<kilnExternalCorrelationKind>(-1), nullptr),
                  kilnErrorInvalidValue);
  // Pushing works with tracing off; the kinds are separate stacks.
  ASSERT_KILN_OK(kilnActivityPushExternalCorrelationId(kilnExternalCorrelationKindDefault, 1));
  EXPECT_KILN_ERR(kilnActivityPopExternalCorrelationId(kilnExternalCorrelationKindUser, nullptr),
                  kilnErrorInvalidValue);
  unsigned long long id = 0;
  ASSERT_KILN_OK(kilnActivityPopExternalCorrelationId(kilnExternalCorrelationKindDefault, &id));
  EXPECT_EQ(id, 1u);
}

TEST(TraceOff, NothingIsRecordedWhileTracingIsDisabled) {
  ASSERT_KILN_OK(kilnActivityEnable(0));
  ASSERT_KILN_OK(kilnActivityDisable());
  EXPECT_KILN_OK(kilnActivityDisable()) << "disabling twice is fine";
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamGetDefault(&s, 0));
  void* d = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&d, 64));
  char host[64] = {};
  for (int i = 0; i < 10; ++i) ASSERT_KILN_OK(Launch(s, [] {}, "untraced"));
  ASSERT_KILN_OK(kilnMemcpyAsync(d, host, sizeof host, kilnMemcpyHostToDevice, s));
  ASSERT_KILN_OK(kilnMemcpy(host, d, sizeof host, kilnMemcpyDeviceToHost));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  size_t count = 1;
  ASSERT_KILN_OK(kilnActivityGetRecords(nullptr, 0, &count));
  EXPECT_EQ(count, 0u);
  ASSERT_KILN_OK(kilnFree(d));
}

TEST_F(Trace, OnlyWorkEnqueuedWhileEnabledIsRecordedEvenIfItFinishesLater) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  ASSERT_KILN_OK(kilnActivityDisable());
  auto gate = MakeGate();
  GateGuard guard{gate};
  ASSERT_KILN_OK(LaunchGate(s, gate));
  ASSERT_KILN_OK(Launch(s, [] {}, "before"));
  ASSERT_KILN_OK(kilnActivityEnable(0));
  ASSERT_KILN_OK(Launch(s, [] {}, "during"));
  ASSERT_KILN_OK(kilnActivityDisable());
  ASSERT_KILN_OK(Launch(s, [] {}, "after"));

  // Nothing ran yet, so nothing is in; a flush waits for "during".
  size_t count = 0;
  ASSERT_KILN_OK(kilnActivityGetRecords(nullptr, 0, &count));
  EXPECT_EQ(count, 1u) << "only the Api record of the traced launch";
  std::atomic<bool> flushed{false};
  std::thread flusher([&] {
    EXPECT_KILN_OK(kilnActivityFlushAll());
    flushed = true;
  });
  SleepMs(20);
  EXPECT_FALSE(flushed.load()) << "the traced task has not run yet";
  gate->Open();
  flusher.join();
  EXPECT_TRUE(flushed.load());

  const Records records = DrainAll();
  const Records tasks = OfKind(records, kilnActivityKindTask);
  ASSERT_EQ(tasks.size(), 1u);
  EXPECT_STREQ(tasks[0].name, "during");
  ASSERT_EQ(records.size(), 2u);
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST_F(Trace, EnablingAgainStartsAFreshCollection) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  auto gate = MakeGate();
  GateGuard guard{gate};
  ASSERT_KILN_OK(LaunchGate(s, gate));
  ASSERT_KILN_OK(Launch(s, [] {}, "first collection"));
  ASSERT_KILN_OK(kilnActivityEnable(0));  // discards the Api records and the pending task's
  ASSERT_KILN_OK(Launch(s, [] {}, "second collection"));
  gate->Open();
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  ASSERT_KILN_OK(kilnActivityFlushAll());
  const Records records = DrainAll();
  for (const auto& r : records)
    EXPECT_STRNE(r.name, "first collection") << "a record of an earlier collection leaked";
  EXPECT_NE(Named(records, kilnActivityKindTask, "second collection"), nullptr);
  EXPECT_EQ(Named(records, kilnActivityKindTask, "gate"), nullptr);
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST_F(Trace, RecordsPastTheLimitAreDroppedAndCounted) {
  ASSERT_KILN_OK(kilnActivityEnable(4));
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  for (int i = 0; i < 10; ++i) ASSERT_KILN_OK(Launch(s, [] {}, "t"));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  // 10 launches (an Api and a Task record each) and one synchronization.
  size_t dropped = 0;
  ASSERT_KILN_OK(kilnActivityGetDroppedCount(&dropped));
  EXPECT_EQ(dropped, 21u - 4u);
  EXPECT_EQ(DrainAll().size(), 4u);
  // Draining makes room again; a new collection resets the count.
  ASSERT_KILN_OK(Launch(s, [] {}, "t"));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  EXPECT_EQ(DrainAll().size(), 3u);
  ASSERT_KILN_OK(kilnActivityEnable(0));
  ASSERT_KILN_OK(kilnActivityGetDroppedCount(&dropped));
  EXPECT_EQ(dropped, 0u);
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST_F(Trace, GetRecordsDrainsOldestFirstInPieces) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  for (int i = 0; i < 5; ++i) ASSERT_KILN_OK(Launch(s, [] {}, "t"));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  size_t available = 0;
  ASSERT_KILN_OK(kilnActivityGetRecords(nullptr, 0, &available));
  ASSERT_EQ(available, 11u);
  kilnActivityRecord two[2];
  size_t got = 0;
  ASSERT_KILN_OK(kilnActivityGetRecords(two, 2, &got));
  EXPECT_EQ(got, 2u);
  const Records rest = DrainAll();
  EXPECT_EQ(rest.size(), 9u);
  // Drained records are gone; one worker writes its tasks' records in order.
  for (const auto& r : rest)
    for (const auto& t : two) EXPECT_FALSE(r.kind == t.kind && r.correlationId == t.correlationId);
  Records tasks = OfKind(rest, kilnActivityKindTask);
  for (const auto& t : two)
    if (t.kind == kilnActivityKindTask) tasks.insert(tasks.begin(), t);
  ASSERT_EQ(tasks.size(), 5u);
  for (size_t i = 1; i < tasks.size(); ++i) EXPECT_GT(tasks[i].correlationId, tasks[i - 1].correlationId);
  EXPECT_KILN_ERR(kilnActivityGetRecords(nullptr, 3, &got), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnActivityGetRecords(two, 2, nullptr), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnActivityGetDroppedCount(nullptr), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnActivityGetTimestamp(nullptr), kilnErrorInvalidValue);
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST_F(Trace, WorkSkippedAfterAStickyErrorLeavesOnlyItsApiRecord) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  ASSERT_KILN_OK(Launch(s, [] { return kilnErrorInvalidValue; }, "fails"));
  ASSERT_KILN_OK(Launch(s, [] {}, "skipped"));
  EXPECT_KILN_ERR(kilnStreamSynchronize(s), kilnErrorLaunchFailure);
  ASSERT_KILN_OK(kilnActivityFlushAll());
  const Records records = DrainAll();
  EXPECT_NE(Named(records, kilnActivityKindTask, "fails"), nullptr) << "it ran";
  EXPECT_EQ(Named(records, kilnActivityKindTask, "skipped"), nullptr) << "it never ran";
  EXPECT_EQ(OfKind(records, kilnActivityKindApi).size(), 3u) << "two launches and the sync";
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST_F(Trace, AnEventWaitRecordsHowLongTheStreamWasHeld) {
  kilnStream_t producer = nullptr, consumer = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&producer));
  ASSERT_KILN_OK(kilnStreamCreate(&consumer));
  kilnEvent_t ev = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&ev));
  auto gate = MakeGate();
  GateGuard guard{gate};
  ASSERT_KILN_OK(LaunchGate(producer, gate));
  ASSERT_KILN_OK(kilnEventRecord(ev, producer));
  std::atomic<bool> reached{false};
  ASSERT_KILN_OK(Launch(consumer, [&reached] { reached = true; }, "just before the wait"));
  ASSERT_KILN_OK(kilnStreamWaitEvent(consumer, ev, 0));
  ASSERT_KILN_OK(Launch(consumer, [] {}, "consumer"));
  while (!reached.load()) std::this_thread::yield();
  SleepMs(10);  // the consumer sits in the wait meanwhile
  const long long opened = Now();
  gate->Open();
  ASSERT_KILN_OK(kilnStreamSynchronize(consumer));
  const Records records = DrainAll();
  const kilnActivityRecord* wait = Named(records, kilnActivityKindEventWait, "Event Wait");
  ASSERT_NE(wait, nullptr);
  EXPECT_EQ(wait->streamId, StreamId(consumer));
  EXPECT_GE(wait->end, opened) << "the wait ends only after the producer passed the gate";
  EXPECT_GE(wait->end - wait->start, 1'000'000) << "held until the gate opened ~10 ms later";
  const kilnActivityRecord* task = Named(records, kilnActivityKindTask, "consumer");
  ASSERT_NE(task, nullptr);
  EXPECT_GE(task->start, wait->end);
  ASSERT_NE(Named(records, kilnActivityKindApi, "kilnStreamWaitEvent"), nullptr);
  ASSERT_KILN_OK(kilnEventDestroy(ev));
  ASSERT_KILN_OK(kilnStreamDestroy(producer));
  ASSERT_KILN_OK(kilnStreamDestroy(consumer));
}

TEST_F(Trace, SynchronizationCallsLeaveApiRecords) {
  ASSERT_KILN_OK(kilnSetDevice(1));
  ASSERT_KILN_OK(Launch(nullptr, [] { SleepMs(2); }, "work"));
  ASSERT_KILN_OK(kilnDeviceSynchronize());
  ASSERT_KILN_OK(kilnSetDevice(0));
  const Records records = DrainAll();
  const kilnActivityRecord* sync = Named(records, kilnActivityKindApi, "kilnDeviceSynchronize");
  ASSERT_NE(sync, nullptr);
  EXPECT_EQ(sync->device, 1);
  EXPECT_EQ(sync->streamId, 0u);
  EXPECT_EQ(sync->threadId, ThisThreadId());
  const kilnActivityRecord* work = Named(records, kilnActivityKindTask, "work");
  ASSERT_NE(work, nullptr);
  EXPECT_GE(sync->end, work->end);
}

TEST_F(Trace, FlushingFromInsideATaskIsRefused) {
  kilnError_t inside = kilnSuccess;
  ASSERT_KILN_OK(Launch(nullptr, [&inside] { inside = kilnActivityFlushAll(); }, "flusher"));
  ASSERT_KILN_OK(kilnStreamSynchronize(nullptr));
  EXPECT_EQ(inside, kilnErrorNotPermitted) << kiln_test::Describe(inside);
}

TEST(StreamId, IdsAreUniqueNonZeroAndNeverReused) {
  kilnStream_t d0 = nullptr, d1 = nullptr;
  ASSERT_KILN_OK(kilnStreamGetDefault(&d0, 0));
  ASSERT_KILN_OK(kilnStreamGetDefault(&d1, 1));
  std::set<unsigned long long> seen = {StreamId(d0), StreamId(d1)};
  unsigned long long via_null = 0;
  ASSERT_KILN_OK(kilnStreamGetId(nullptr, &via_null));
  EXPECT_EQ(via_null, StreamId(d0)) << "NULL is the current device's default stream";
  for (int i = 0; i < 5; ++i) {
    kilnStream_t s = nullptr;
    ASSERT_KILN_OK(kilnStreamCreate(&s));
    seen.insert(StreamId(s));
    ASSERT_KILN_OK(kilnStreamDestroy(s));  // the next create reuses the handle
  }
  EXPECT_EQ(seen.size(), 7u);
  EXPECT_EQ(seen.count(0), 0u);
  EXPECT_KILN_ERR(kilnStreamGetId(d0, nullptr), kilnErrorInvalidValue);
  kilnStream_t dead = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&dead));
  ASSERT_KILN_OK(kilnStreamDestroy(dead));
  unsigned long long id = 0;
  EXPECT_KILN_ERR(kilnStreamGetId(dead, &id), kilnErrorInvalidResourceHandle);
}

// KILN_LAUNCH_BLOCKING=1: work runs inside the enqueueing call, and is
// recorded the same way, its device record nested in its Api record.
TEST(ChildTraceBlocking, InlineWorkIsRecordedInsideItsCall) {
  ASSERT_KILN_OK(kilnActivityEnable(0));
  void* d = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&d, 256));
  char host[256] = {};
  ASSERT_KILN_OK(Launch(nullptr, [] { SleepMs(1); }, "inline"));
  ASSERT_KILN_OK(kilnMemcpyAsync(d, host, sizeof host, kilnMemcpyHostToDevice, nullptr));
  ASSERT_KILN_OK(kilnActivityDisable());
  const Records records = DrainAll();  // no flush needed: everything ran inline
  const kilnActivityRecord* task = Named(records, kilnActivityKindTask, "inline");
  ASSERT_NE(task, nullptr);
  const kilnActivityRecord* api = ApiOf(records, *task);
  ASSERT_NE(api, nullptr);
  EXPECT_LE(api->start, task->start);
  EXPECT_GE(api->end, task->end);
  EXPECT_GE(task->end - task->start, 1'000'000);
  EXPECT_NE(Named(records, kilnActivityKindMemcpyHtoD, "Memcpy HtoD (Pageable -> Device)"), nullptr);
  ASSERT_KILN_OK(kilnFree(d));
}

TEST(TraceBlocking, InlineWorkIsRecordedInsideItsCall) {
  ExpectChildPasses("ChildTraceBlocking.InlineWorkIsRecordedInsideItsCall",
                    {{"KILN_LAUNCH_BLOCKING", "1"}});
}

TEST_F(Trace, ARunningTaskCanRenameItsRecordButNotItsErrors) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  ASSERT_KILN_OK(Launch(s, [] { kilnTaskSetActivityName("kiln::fused(aten::add, aten::mul)"); },
                        "kiln::fused_elementwise"));
  kilnTaskSetActivityName("outside a task: ignored");
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  ASSERT_KILN_OK(kilnActivityFlushAll());
  const Records tasks = OfKind(DrainAll(), kilnActivityKindTask);
  ASSERT_EQ(tasks.size(), 1u);
  EXPECT_STREQ(tasks[0].name, "kiln::fused(aten::add, aten::mul)");
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}
