// test_sticky_errors.cc — a failing task makes its stream's error sticky:
// later work is skipped (but released), the error is reported once by the
// next synchronisation or query, and the stream works again afterwards.
#include <atomic>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

using kiln_test::GateGuard;
using kiln_test::Launch;
using kiln_test::LaunchGate;
using kiln_test::LastMessage;
using kiln_test::MakeGate;

namespace {

struct Counters {
  std::atomic<int> ran{0};
  std::atomic<int> released{0};
};

kilnError_t CountingTask(void* u) {
  static_cast<Counters*>(u)->ran.fetch_add(1);
  return kilnSuccess;
}

kilnError_t FailingTask(void* u) {
  static_cast<Counters*>(u)->ran.fetch_add(1);
  kilnTaskSetErrorMessage("boom: tensor of shape [2, 3] is not contiguous");
  return kilnErrorInvalidValue;
}

void CountRelease(void* u) { static_cast<Counters*>(u)->released.fetch_add(1); }

kilnError_t ClassifiedFailingTask(void*) {
  kilnTaskSetErrorMessage("index 9 is out of range");
  kilnTaskSetErrorClass(7);
  return kilnErrorLaunchFailure;
}

}  // namespace

TEST(StickyErrors, TheErrorClassATaskSetIsReportedWithItsError) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  ASSERT_KILN_OK(kilnLaunchTask(s, ClassifiedFailingTask, nullptr, nullptr, "aten::index"));
  EXPECT_KILN_ERR(kilnStreamSynchronize(s), kilnErrorLaunchFailure);
  EXPECT_EQ(LastMessage(), "aten::index: index 9 is out of range");
  EXPECT_EQ(kilnGetLastErrorClass(), 7);

  // Through an event recorded behind the failure, and the device.
  kilnEvent_t event = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&event));
  ASSERT_KILN_OK(kilnLaunchTask(s, ClassifiedFailingTask, nullptr, nullptr, "aten::index"));
  ASSERT_KILN_OK(kilnEventRecord(event, s));
  EXPECT_KILN_ERR(kilnEventSynchronize(event), kilnErrorLaunchFailure);
  EXPECT_EQ(kilnGetLastErrorClass(), 7);
  ASSERT_KILN_OK(kilnLaunchTask(s, ClassifiedFailingTask, nullptr, nullptr, "aten::index"));
  EXPECT_KILN_ERR(kilnDeviceSynchronize(), kilnErrorLaunchFailure);
  EXPECT_EQ(kilnGetLastErrorClass(), 7);

  // Other failures, and tasks that set no class, have class 0.
  EXPECT_KILN_ERR(kilnStreamSynchronize(reinterpret_cast<kilnStream_t>(&event)),
                  kilnErrorInvalidResourceHandle);
  EXPECT_EQ(kilnGetLastErrorClass(), 0);
  Counters failing;
  ASSERT_KILN_OK(kilnLaunchTask(s, ClassifiedFailingTask, nullptr, nullptr, "aten::index"));
  EXPECT_KILN_ERR(kilnStreamSynchronize(s), kilnErrorLaunchFailure);
  ASSERT_KILN_OK(kilnLaunchTask(s, FailingTask, CountRelease, &failing, "aten::add"));
  EXPECT_KILN_ERR(kilnStreamSynchronize(s), kilnErrorLaunchFailure);
  EXPECT_EQ(kilnGetLastErrorClass(), 0) << "a class belongs to its own failure only";
  kilnTaskSetErrorClass(3);  // outside a task: no effect
  EXPECT_EQ(kilnGetLastErrorClass(), 0);
  ASSERT_KILN_OK(kilnEventDestroy(event));
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(StickyErrors, FailingTaskSkipsLaterTasksUntilSynchronizeReportsItOnce) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  Counters before, failing, after;
  ASSERT_KILN_OK(kilnLaunchTask(s, CountingTask, CountRelease, &before, "before"));
  ASSERT_KILN_OK(kilnLaunchTask(s, FailingTask, CountRelease, &failing, "aten::add"));
  for (int i = 0; i < 10; ++i)
    ASSERT_KILN_OK(kilnLaunchTask(s, CountingTask, CountRelease, &after, "after"));

  EXPECT_KILN_ERR(kilnStreamSynchronize(s), kilnErrorLaunchFailure);
  EXPECT_EQ(LastMessage(), "aten::add: boom: tensor of shape [2, 3] is not contiguous");
  EXPECT_EQ(before.ran.load(), 1);
  EXPECT_EQ(failing.ran.load(), 1);
  EXPECT_EQ(after.ran.load(), 0) << "tasks after a failure must be skipped";
  EXPECT_EQ(before.released.load(), 1);
  EXPECT_EQ(failing.released.load(), 1);
  EXPECT_EQ(after.released.load(), 10) << "skipped tasks are still released, exactly once";

  EXPECT_KILN_OK(kilnStreamSynchronize(s)) << "the error is reported once";
  EXPECT_KILN_OK(kilnStreamQuery(s));
  Counters again;
  ASSERT_KILN_OK(kilnLaunchTask(s, CountingTask, CountRelease, &again, "again"));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  EXPECT_EQ(again.ran.load(), 1) << "the stream works again after reporting";
  EXPECT_EQ(again.released.load(), 1);
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(StickyErrors, QueryReportsTheErrorAndSkipsWorkLaunchedBeforeIt) {
  kilnStream_t s = nullptr, other = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  ASSERT_KILN_OK(kilnStreamCreate(&other));
  kilnEvent_t e = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&e));
  auto gate = MakeGate();
  Counters failing, queued, later;
  {
    GateGuard guard{gate};
    ASSERT_KILN_OK(LaunchGate(other, gate));
    ASSERT_KILN_OK(kilnEventRecord(e, other));
    ASSERT_KILN_OK(kilnLaunchTask(s, FailingTask, CountRelease, &failing, "first"));
    ASSERT_KILN_OK(kilnStreamWaitEvent(s, e, 0));  // holds s after the failure
    ASSERT_KILN_OK(kilnLaunchTask(s, CountingTask, CountRelease, &queued, "queued"));
    kilnError_t q;
    while ((q = kilnStreamQuery(s)) == kilnErrorNotReady) std::this_thread::yield();
    EXPECT_EQ(q, kilnErrorLaunchFailure);
    EXPECT_EQ(LastMessage(), "first: boom: tensor of shape [2, 3] is not contiguous");
    EXPECT_KILN_ERR(kilnStreamQuery(s), kilnErrorNotReady) << "reported once; work still pending";
    ASSERT_KILN_OK(kilnLaunchTask(s, CountingTask, CountRelease, &later, "later"));
  }
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  EXPECT_EQ(queued.ran.load(), 0) << "launched before the error was reported: skipped";
  EXPECT_EQ(queued.released.load(), 1);
  EXPECT_EQ(later.ran.load(), 1) << "launched after the error was reported: runs";
  ASSERT_KILN_OK(kilnEventDestroy(e));
  ASSERT_KILN_OK(kilnStreamDestroy(s));
  ASSERT_KILN_OK(kilnStreamDestroy(other));
}

TEST(StickyErrors, DeviceSynchronizeReportsAStreamsError) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  Counters failing;
  ASSERT_KILN_OK(kilnLaunchTask(s, FailingTask, CountRelease, &failing, "on device 0"));
  EXPECT_KILN_ERR(kilnDeviceSynchronize(), kilnErrorLaunchFailure);
  EXPECT_NE(LastMessage().find("on device 0: boom"), std::string::npos) << LastMessage();
  EXPECT_KILN_OK(kilnDeviceSynchronize());
  EXPECT_KILN_OK(kilnStreamSynchronize(s)) << "already reported by kilnDeviceSynchronize";
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(StickyErrors, ErrorsStayOnTheirStream) {
  kilnStream_t bad = nullptr, good = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&bad));
  ASSERT_KILN_OK(kilnStreamCreate(&good));
  Counters failing, fine;
  ASSERT_KILN_OK(kilnLaunchTask(bad, FailingTask, CountRelease, &failing, "bad"));
  EXPECT_KILN_ERR(kilnStreamSynchronize(bad), kilnErrorLaunchFailure);
  ASSERT_KILN_OK(kilnLaunchTask(bad, FailingTask, CountRelease, &failing, "bad again"));
  ASSERT_KILN_OK(kilnLaunchTask(good, CountingTask, CountRelease, &fine, "good"));
  EXPECT_KILN_OK(kilnStreamSynchronize(good));
  EXPECT_EQ(fine.ran.load(), 1);
  EXPECT_KILN_ERR(kilnStreamSynchronize(bad), kilnErrorLaunchFailure);
  EXPECT_EQ(LastMessage().rfind("bad again: ", 0), 0u) << LastMessage();
  ASSERT_KILN_OK(kilnStreamDestroy(bad));
  ASSERT_KILN_OK(kilnStreamDestroy(good));
}

TEST(StickyErrors, UnnamedTaskWithoutMessageStillGetsAUsefulMessage) {
  ASSERT_KILN_OK(kilnLaunchTask(nullptr, [](void*) { return kilnErrorInvalidValue; }, nullptr, nullptr,
                                nullptr));
  EXPECT_KILN_ERR(kilnStreamSynchronize(nullptr), kilnErrorLaunchFailure);
  const std::string m = LastMessage();
  EXPECT_NE(m.find("unnamed task"), std::string::npos) << m;
  EXPECT_NE(m.find("kilnErrorInvalidValue"), std::string::npos) << m;
}

TEST(StickyErrors, AnExceptionEscapingATaskIsAFailureNotACrash) {
  ASSERT_KILN_OK(Launch(
      nullptr, []() -> kilnError_t { throw std::runtime_error("shape mismatch"); }, "throws"));
  EXPECT_KILN_ERR(kilnStreamSynchronize(nullptr), kilnErrorLaunchFailure);
  EXPECT_NE(LastMessage().find("throws: "), std::string::npos) << LastMessage();
  EXPECT_NE(LastMessage().find("shape mismatch"), std::string::npos) << LastMessage();
}

TEST(StickyErrors, EventRecordsOnAFailedStreamStillCompleteSoWaitersDoNotHang) {
  kilnStream_t failed = nullptr, waiter = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&failed));
  ASSERT_KILN_OK(kilnStreamCreate(&waiter));
  kilnEvent_t e = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&e));
  Counters failing, dependent;
  ASSERT_KILN_OK(kilnLaunchTask(failed, FailingTask, CountRelease, &failing, "producer"));
  ASSERT_KILN_OK(kilnEventRecord(e, failed));
  ASSERT_KILN_OK(kilnStreamWaitEvent(waiter, e, 0));
  ASSERT_KILN_OK(kilnLaunchTask(waiter, CountingTask, CountRelease, &dependent, "consumer"));
  EXPECT_KILN_OK(kilnStreamSynchronize(waiter));  // must not hang
  EXPECT_EQ(dependent.ran.load(), 1);
  EXPECT_KILN_ERR(kilnStreamSynchronize(failed), kilnErrorLaunchFailure);
  EXPECT_KILN_OK(kilnEventSynchronize(e)) << "the stream already reported the failure";
  EXPECT_KILN_OK(kilnEventQuery(e));
  ASSERT_KILN_OK(kilnEventDestroy(e));
  ASSERT_KILN_OK(kilnStreamDestroy(failed));
  ASSERT_KILN_OK(kilnStreamDestroy(waiter));
}

TEST(StickyErrors, CopiesAfterAFailureAreSkippedAndASynchronousCopyReportsIt) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  unsigned char* dev = nullptr;
  ASSERT_KILN_OK(kilnMalloc(reinterpret_cast<void**>(&dev), 64));
  ASSERT_KILN_OK(kilnMemsetAsync(dev, 1, 64, s));
  Counters failing;
  ASSERT_KILN_OK(kilnLaunchTask(s, FailingTask, CountRelease, &failing, "writer"));
  ASSERT_KILN_OK(kilnMemsetAsync(dev, 2, 64, s));  // skipped
  std::vector<unsigned char> host(64, 0);
  // Into pageable memory: synchronous, so the caller must learn the bytes did not arrive.
  EXPECT_KILN_ERR(kilnMemcpyAsync(host.data(), dev, 64, kilnMemcpyDeviceToHost, s), kilnErrorLaunchFailure);
  EXPECT_NE(LastMessage().find("writer: boom"), std::string::npos) << LastMessage();
  EXPECT_EQ(host[0], 0) << "a skipped copy must not write";
  ASSERT_KILN_OK(kilnMemcpyAsync(host.data(), dev, 64, kilnMemcpyDeviceToHost, s));
  EXPECT_EQ(host[0], 1) << "the memset after the failure was skipped";
  ASSERT_KILN_OK(kilnFree(dev));
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(StickyErrors, DestroyingAStreamReportsAnUnreportedError) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  Counters failing;
  ASSERT_KILN_OK(kilnLaunchTask(s, FailingTask, CountRelease, &failing, "orphan"));
  EXPECT_KILN_ERR(kilnStreamDestroy(s), kilnErrorLaunchFailure);
  EXPECT_NE(LastMessage().find("orphan: boom"), std::string::npos) << LastMessage();
  EXPECT_KILN_ERR(kilnStreamQuery(s), kilnErrorInvalidResourceHandle) << "destroyed anyway";
  EXPECT_EQ(failing.released.load(), 1);
}

TEST(StickyErrors, EventRecordedBehindAFailureReportsItOnce) {
  kilnStream_t s = nullptr;
  kilnEvent_t synced = nullptr, queried = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  ASSERT_KILN_OK(kilnEventCreate(&synced));
  ASSERT_KILN_OK(kilnEventCreate(&queried));
  Counters failing;
  ASSERT_KILN_OK(kilnLaunchTask(s, FailingTask, CountRelease, &failing, "aten::index_select"));
  ASSERT_KILN_OK(kilnEventRecord(synced, s));
  EXPECT_KILN_ERR(kilnEventSynchronize(synced), kilnErrorLaunchFailure);
  EXPECT_EQ(LastMessage(), "aten::index_select: boom: tensor of shape [2, 3] is not contiguous");
  EXPECT_KILN_OK(kilnEventSynchronize(synced)) << "reported once";
  EXPECT_KILN_OK(kilnStreamSynchronize(s)) << "the event took the stream's error";

  ASSERT_KILN_OK(kilnLaunchTask(s, FailingTask, CountRelease, &failing, "aten::gather"));
  ASSERT_KILN_OK(kilnEventRecord(queried, s));
  kilnError_t q = kilnErrorNotReady;
  while (q == kilnErrorNotReady) q = kilnEventQuery(queried);
  EXPECT_EQ(q, kilnErrorLaunchFailure);
  EXPECT_KILN_OK(kilnEventQuery(queried));
  EXPECT_KILN_OK(kilnStreamSynchronize(s));

  EXPECT_KILN_OK(kilnEventDestroy(synced));
  EXPECT_KILN_OK(kilnEventDestroy(queried));
  EXPECT_KILN_OK(kilnStreamDestroy(s));
}
