// test_host_wait.cc — bounded launch queues (KILN_LAUNCH_QUEUE_DEPTH), the
// host-wait callback that lets a host abandon a wait (Ctrl-C), and
// kilnRuntimeShutdown (exit drops queued work). Tests that change the
// process-wide state (depth, shutdown) run in child processes; see
// test_util.h.
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "test_util.h"

using kiln_test::ChildParam;
using kiln_test::ExpectChildPasses;
using kiln_test::GateGuard;
using kiln_test::Launch;
using kiln_test::LastMessage;
using kiln_test::MakeGate;

namespace {

using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// A host-wait callback that asks to abandon the wait once `*stop` is set, and
// counts its calls.
struct StopFlag {
  std::atomic<bool> stop{false};
  std::atomic<int> calls{0};
};
int StopWhenFlagged(void* user) {
  auto* flag = static_cast<StopFlag*>(user);
  flag->calls.fetch_add(1);
  return flag->stop.load() ? 1 : 0;
}

// Removes the process-wide callback when a test ends, however it ends.
struct CallbackGuard {
  ~CallbackGuard() { kilnSetHostWaitCallback(nullptr, nullptr, 0); }
};

// Launches a gate on `s` and returns once the stream's worker is running it,
// so the stream's queue is empty and everything launched next waits behind a
// running task (no sleeping on the timing of the worker).
void LaunchRunningGate(kilnStream_t s, const kiln_test::GatePtr& gate) {
  auto started = std::make_shared<std::atomic<bool>>(false);
  ASSERT_KILN_OK(Launch(s, [gate, started] {
    started->store(true);
    gate->Wait();
  }, "gate"));
  while (!started->load()) std::this_thread::yield();
}

}  // namespace

// --- The launch queue ---------------------------------------------------------

// With KILN_LAUNCH_QUEUE_DEPTH=4: four entries queue behind a running gate, the
// fifth launch from the host waits until the stream starts one.
TEST(ChildLaunchQueue, HostLaunchWaitsForRoom) {
  ASSERT_EQ(ChildParam("KILN_LAUNCH_QUEUE_DEPTH"), "4");
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  auto gate = MakeGate();
  GateGuard guard{gate};
  LaunchRunningGate(s, gate);
  std::atomic<int> ran{0};
  for (int i = 0; i < 4; ++i) ASSERT_KILN_OK(Launch(s, [&ran] { ran.fetch_add(1); }));
  std::atomic<bool> fifth_returned{false};
  std::thread launcher([&] {
    EXPECT_KILN_OK(Launch(s, [&ran] { ran.fetch_add(1); }));
    fifth_returned.store(true);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(fifth_returned.load()) << "a launch onto a full queue returned at once";
  // Control entries never wait for room.
  kilnEvent_t ev = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&ev));
  ASSERT_KILN_OK(kilnEventRecord(ev, s));
  gate->Open();
  launcher.join();
  EXPECT_TRUE(fifth_returned.load());
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  EXPECT_EQ(ran.load(), 5);
  EXPECT_KILN_OK(kilnEventDestroy(ev));
  EXPECT_KILN_OK(kilnStreamDestroy(s));
}

// A task may launch more than the depth onto its own stream: a worker never
// waits for room (it would wait for itself).
TEST(ChildLaunchQueue, TaskLaunchingOntoItsOwnFullStreamDoesNotDeadlock) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  std::atomic<int> ran{0};
  ASSERT_KILN_OK(Launch(s, [&] {
    for (int i = 0; i < 20; ++i) EXPECT_KILN_OK(Launch(s, [&ran] { ran.fetch_add(1); }));
  }));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  // The nested launches were queued behind the task that launched them.
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  EXPECT_EQ(ran.load(), 20);
  EXPECT_KILN_OK(kilnStreamDestroy(s));
}

// Many small launches through a depth-2 queue all run, in order.
TEST(ChildLaunchQueue, EveryLaunchRunsInOrderThroughASmallQueue) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  std::vector<int> order;
  for (int i = 0; i < 2000; ++i) ASSERT_KILN_OK(Launch(s, [&order, i] { order.push_back(i); }));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  ASSERT_EQ(order.size(), 2000u);
  for (int i = 0; i < 2000; ++i) ASSERT_EQ(order[static_cast<size_t>(i)], i);
  EXPECT_KILN_OK(kilnStreamDestroy(s));
}

TEST(LaunchQueue, HostLaunchWaitsForRoom) {
  ExpectChildPasses("ChildLaunchQueue.HostLaunchWaitsForRoom",
                    {{"KILN_LAUNCH_QUEUE_DEPTH", std::string("4")}});
}
TEST(LaunchQueue, TaskLaunchingOntoItsOwnFullStreamDoesNotDeadlock) {
  ExpectChildPasses("ChildLaunchQueue.TaskLaunchingOntoItsOwnFullStreamDoesNotDeadlock",
                    {{"KILN_LAUNCH_QUEUE_DEPTH", std::string("4")}});
}
TEST(LaunchQueue, EveryLaunchRunsInOrderThroughASmallQueue) {
  ExpectChildPasses("ChildLaunchQueue.EveryLaunchRunsInOrderThroughASmallQueue",
                    {{"KILN_LAUNCH_QUEUE_DEPTH", std::string("2")}});
}

// --- The host-wait callback -----------------------------------------------------

TEST(HostWaitCallback, RejectsABadInterval) {
  StopFlag flag;
  EXPECT_KILN_ERR(kilnSetHostWaitCallback(StopWhenFlagged, &flag, 0), kilnErrorInvalidValue);
  EXPECT_NE(LastMessage().find("1..60000"), std::string::npos) << LastMessage();
  EXPECT_KILN_ERR(kilnSetHostWaitCallback(StopWhenFlagged, &flag, 60001), kilnErrorInvalidValue);
  EXPECT_KILN_OK(kilnSetHostWaitCallback(nullptr, nullptr, 0));  // removing needs no interval
}

// Each host wait returns kilnErrorInterrupted within about one interval of the
// callback asking to stop; the device work goes on and can be waited for again.
class InterruptibleWait : public testing::TestWithParam<const char*> {};

TEST_P(InterruptibleWait, IsAbandonedWhenTheCallbackAsks) {
  const std::string which = GetParam();
  StopFlag flag;
  CallbackGuard remove_callback;
  ASSERT_KILN_OK(kilnSetHostWaitCallback(StopWhenFlagged, &flag, 10));
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  auto gate = MakeGate();
  GateGuard guard{gate};
  LaunchRunningGate(s, gate);
  kilnEvent_t ev = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&ev));
  ASSERT_KILN_OK(kilnEventRecord(ev, s));
  void* dev = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&dev, 64));
  ASSERT_KILN_OK(kilnMemsetAsync(dev, 7, 64, s));
  unsigned char host[64];
  std::memset(host, 0, sizeof host);

  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    flag.stop.store(true);
  });
  const auto start = Clock::now();
  kilnError_t err = kilnSuccess;
  if (which == "StreamSynchronize") err = kilnStreamSynchronize(s);
  if (which == "EventSynchronize") err = kilnEventSynchronize(ev);
  if (which == "DeviceSynchronize") err = kilnDeviceSynchronize();
  if (which == "SynchronousCopy") err = kilnMemcpyAsync(host, dev, 64, kilnMemcpyDeviceToHost, s);
  const double waited = MsSince(start);
  stopper.join();
  EXPECT_KILN_ERR(err, kilnErrorInterrupted);
  EXPECT_NE(LastMessage().find("abandoned"), std::string::npos) << LastMessage();
  EXPECT_GE(waited, 40.0);
  EXPECT_LT(waited, 1000.0);
  EXPECT_GE(flag.calls.load(), 1);
  EXPECT_KILN_ERR(kilnStreamQuery(s), kilnErrorNotReady);  // the device work goes on

  flag.stop.store(false);
  gate->Open();
  EXPECT_KILN_OK(kilnStreamSynchronize(s));
  EXPECT_KILN_OK(kilnEventSynchronize(ev));
  // An abandoned synchronous copy was never enqueued: its destination is untouched.
  if (which == "SynchronousCopy") {
    EXPECT_EQ(host[0], 0);
  }
  EXPECT_KILN_OK(kilnFree(dev));
  EXPECT_KILN_OK(kilnEventDestroy(ev));
  EXPECT_KILN_OK(kilnStreamDestroy(s));
}

INSTANTIATE_TEST_SUITE_P(HostWaits, InterruptibleWait,
                         testing::Values("StreamSynchronize", "EventSynchronize",
                                         "DeviceSynchronize", "SynchronousCopy"),
                         [](const auto& p) { return std::string(p.param); });

// A wait that ends within one interval never calls the callback.
TEST(HostWaitCallback, IsNotCalledForShortWaits) {
  StopFlag flag;
  flag.stop.store(true);
  CallbackGuard remove_callback;
  ASSERT_KILN_OK(kilnSetHostWaitCallback(StopWhenFlagged, &flag, 1000));
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  for (int i = 0; i < 100; ++i) {
    ASSERT_KILN_OK(Launch(s, [] {}));
    ASSERT_KILN_OK(kilnStreamSynchronize(s));
  }
  EXPECT_EQ(flag.calls.load(), 0);
  EXPECT_KILN_OK(kilnStreamDestroy(s));
}

// A launch waiting for room in a full queue is a host wait too; abandoned, it
// enqueued nothing and released its task.
TEST(ChildLaunchQueue, LaunchWaitingForRoomCanBeAbandoned) {
  StopFlag flag;
  CallbackGuard remove_callback;
  ASSERT_KILN_OK(kilnSetHostWaitCallback(StopWhenFlagged, &flag, 10));
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  auto gate = MakeGate();
  GateGuard guard{gate};
  LaunchRunningGate(s, gate);
  ASSERT_KILN_OK(Launch(s, [] {}));  // fills the depth-1 queue
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    flag.stop.store(true);
  });
  std::atomic<bool> ran{false};
  EXPECT_KILN_ERR(Launch(s, [&ran] { ran.store(true); }), kilnErrorInterrupted);
  stopper.join();
  flag.stop.store(false);
  gate->Open();
  EXPECT_KILN_OK(kilnStreamSynchronize(s));
  EXPECT_FALSE(ran.load());
  EXPECT_KILN_OK(kilnStreamDestroy(s));
}

TEST(LaunchQueue, LaunchWaitingForRoomCanBeAbandoned) {
  ExpectChildPasses("ChildLaunchQueue.LaunchWaitingForRoomCanBeAbandoned",
                    {{"KILN_LAUNCH_QUEUE_DEPTH", std::string("1")}});
}

// --- Shutdown -------------------------------------------------------------------

// Queued work is dropped (its release functions still run), running work is
// waited for, later launches fail with kilnErrorRuntimeUnloading, and control
// entries and synchronization keep working.
TEST(ChildShutdown, DropsQueuedWorkAndRefusesMore) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  auto gate = MakeGate();
  GateGuard guard{gate};
  LaunchRunningGate(s, gate);
  std::atomic<int> ran{0};
  auto released = std::make_shared<std::atomic<int>>(0);
  struct Counted {
    Counted(std::atomic<int>* r, std::shared_ptr<std::atomic<int>> rel)
        : ran(r), released(std::move(rel)) {}
    ~Counted() { released->fetch_add(1); }
    std::atomic<int>* ran;
    std::shared_ptr<std::atomic<int>> released;
  };
  for (int i = 0; i < 10; ++i) {
    auto counted = std::make_shared<Counted>(&ran, released);
    ASSERT_KILN_OK(Launch(s, [counted] { counted->ran->fetch_add(1); }));
  }
  // The gate is still running: the shutdown times out but drops nothing yet
  // that has started, and reports it.
  unsigned long long dropped = 0;
  EXPECT_KILN_ERR(kilnRuntimeShutdown(0, 50, &dropped), kilnErrorNotReady);
  EXPECT_NE(LastMessage().find("still running"), std::string::npos) << LastMessage();
  EXPECT_KILN_ERR(Launch(s, [] {}), kilnErrorRuntimeUnloading);
  EXPECT_NE(LastMessage().find("exiting"), std::string::npos) << LastMessage();
  gate->Open();
  const auto start = Clock::now();
  EXPECT_KILN_OK(kilnRuntimeShutdown(0, 5000, &dropped));
  EXPECT_LT(MsSince(start), 1000.0);
  EXPECT_EQ(dropped, 10u);
  EXPECT_EQ(ran.load(), 0);
  EXPECT_EQ(released->load(), 10);
  // Copies and memsets are refused too; records, queries and waits still work.
  void* dev = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&dev, 16));
  EXPECT_KILN_ERR(kilnMemsetAsync(dev, 0, 16, s), kilnErrorRuntimeUnloading);
  char host[16] = {};
  EXPECT_KILN_ERR(kilnMemcpy(dev, host, 16, kilnMemcpyHostToDevice), kilnErrorRuntimeUnloading);
  kilnEvent_t ev = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&ev));
  EXPECT_KILN_OK(kilnEventRecord(ev, s));
  EXPECT_KILN_OK(kilnEventSynchronize(ev));
  EXPECT_KILN_OK(kilnStreamSynchronize(s));
  EXPECT_KILN_OK(kilnDeviceSynchronize());
  EXPECT_KILN_OK(kilnFree(dev));
}

// A host launch waiting for room when shutdown begins fails at once instead of
// waiting for the stalled stream.
TEST(ChildShutdown, WakesLaunchesWaitingForRoom) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  auto gate = MakeGate();
  GateGuard guard{gate};
  LaunchRunningGate(s, gate);
  ASSERT_KILN_OK(Launch(s, [] {}));  // fills the depth-1 queue
  std::atomic<int> result{-1};
  std::thread launcher([&] { result.store(Launch(s, [] {})); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(result.load(), -1);  // still waiting for room
  unsigned long long dropped = 0;
  EXPECT_KILN_ERR(kilnRuntimeShutdown(0, 20, &dropped), kilnErrorNotReady);  // the gate runs
  launcher.join();
  EXPECT_EQ(result.load(), kilnErrorRuntimeUnloading);
  gate->Open();
  EXPECT_KILN_OK(kilnRuntimeShutdown(0, 5000, &dropped));
  EXPECT_EQ(dropped, 1u);
}

// With a drain period, queued work that finishes within it runs normally
// (nothing dropped), while new work is refused from the start.
TEST(ChildShutdown, LetsQueuedWorkDrainFirst) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  auto gate = MakeGate();
  GateGuard guard{gate};
  LaunchRunningGate(s, gate);
  std::atomic<int> ran{0};
  for (int i = 0; i < 5; ++i) ASSERT_KILN_OK(Launch(s, [&ran] { ran.fetch_add(1); }));
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_KILN_ERR(Launch(s, [] {}), kilnErrorRuntimeUnloading);  // refused while draining
    gate->Open();
  });
  unsigned long long dropped = 99;
  EXPECT_KILN_OK(kilnRuntimeShutdown(5000, 1000, &dropped));
  opener.join();
  EXPECT_EQ(ran.load(), 5);
  EXPECT_EQ(dropped, 0u);
}

TEST(Shutdown, LetsQueuedWorkDrainFirst) {
  ExpectChildPasses("ChildShutdown.LetsQueuedWorkDrainFirst", {});
}

TEST(Shutdown, DropsQueuedWorkAndRefusesMore) {
  ExpectChildPasses("ChildShutdown.DropsQueuedWorkAndRefusesMore", {});
}
TEST(Shutdown, WakesLaunchesWaitingForRoom) {
  ExpectChildPasses("ChildShutdown.WakesLaunchesWaitingForRoom",
                    {{"KILN_LAUNCH_QUEUE_DEPTH", std::string("1")}});
}

TEST(Shutdown, IsRefusedInsideATask) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  kilnError_t inside = kilnSuccess;
  ASSERT_KILN_OK(Launch(s, [&inside] { inside = kilnRuntimeShutdown(0, 0, nullptr); }));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  EXPECT_EQ(inside, kilnErrorNotPermitted);
  EXPECT_KILN_OK(kilnStreamDestroy(s));
}
