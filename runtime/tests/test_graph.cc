// test_graph.cc — stream capture and graphs (Note [Stream capture]):
// capture records instead of running, launches replay in order, refusals
// invalidate the capture, lifetimes of captured tasks.
#include <atomic>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "test_util.h"

using kiln_test::Launch;
using kiln_test::LastMessage;

namespace {

struct Counted {
  std::atomic<int>* runs;
  std::atomic<int>* releases;
};

kilnError_t CountRun(void* user) {
  static_cast<Counted*>(user)->runs->fetch_add(1);
  return kilnSuccess;
}

void CountRelease(void* user) {
  auto* c = static_cast<Counted*>(user);
  c->releases->fetch_add(1);
  delete c;
}

}  // namespace

TEST(Graph, CaptureRecordsWithoutRunningAndLaunchesReplayInOrder) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  std::vector<int> order;
  ASSERT_KILN_OK(kilnStreamBeginCapture(s, 0));
  kilnStreamCaptureStatus status = kilnStreamCaptureStatusNone;
  ASSERT_KILN_OK(kilnStreamIsCapturing(s, &status));
  EXPECT_EQ(status, kilnStreamCaptureStatusActive);
  for (int i = 0; i < 3; ++i) ASSERT_KILN_OK(Launch(s, [&order, i] { order.push_back(i); }));
  kilnGraph_t graph = nullptr;
  ASSERT_KILN_OK(kilnStreamEndCapture(s, &graph));
  ASSERT_NE(graph, nullptr);
  ASSERT_KILN_OK(kilnStreamIsCapturing(s, &status));
  EXPECT_EQ(status, kilnStreamCaptureStatusNone);
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  EXPECT_TRUE(order.empty()) << "capture must not run the work";
  size_t nodes = 0;
  ASSERT_KILN_OK(kilnGraphGetNodeCount(graph, &nodes));
  EXPECT_EQ(nodes, 3u);
  kilnStream_t default0 = nullptr;
  ASSERT_KILN_OK(kilnStreamGetDefault(&default0, 0));
  ASSERT_KILN_OK(kilnGraphLaunch(graph, s));
  ASSERT_KILN_OK(Launch(s, [&order] { order.push_back(100); }));
  ASSERT_KILN_OK(kilnGraphLaunch(graph, s));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  ASSERT_KILN_OK(kilnGraphLaunch(graph, default0));  // any stream of the device
  ASSERT_KILN_OK(kilnStreamSynchronize(default0));
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 100, 0, 1, 2, 0, 1, 2}));
  ASSERT_KILN_OK(kilnGraphDestroy(graph));
  EXPECT_KILN_ERR(kilnGraphLaunch(graph, s), kilnErrorInvalidResourceHandle);
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(Graph, CapturedTasksAreReleasedOnceAfterTheLastLaunch) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  std::atomic<int> runs{0}, releases{0};
  ASSERT_KILN_OK(kilnStreamBeginCapture(s, 0));
  ASSERT_KILN_OK(kilnLaunchTask(s, CountRun, CountRelease, new Counted{&runs, &releases}, "counted"));
  kilnGraph_t graph = nullptr;
  ASSERT_KILN_OK(kilnStreamEndCapture(s, &graph));
  // Hold the stream so the launches are still queued when the graph is destroyed.
  std::atomic<bool> go{false};
  ASSERT_KILN_OK(Launch(s, [&go] { while (!go.load()) {} }));
  for (int i = 0; i < 5; ++i) ASSERT_KILN_OK(kilnGraphLaunch(graph, s));
  ASSERT_KILN_OK(kilnGraphDestroy(graph));
  EXPECT_EQ(releases.load(), 0) << "queued launches keep the graph alive";
  go.store(true);
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  EXPECT_EQ(runs.load(), 5);
  EXPECT_EQ(releases.load(), 1);
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(Graph, DefaultStreamCannotCaptureAndNestedCaptureIsIllegal) {
  kilnStream_t default0 = nullptr;
  ASSERT_KILN_OK(kilnStreamGetDefault(&default0, 0));
  EXPECT_KILN_ERR(kilnStreamBeginCapture(default0, 0), kilnErrorStreamCaptureUnsupported);
  EXPECT_NE(LastMessage().find("default stream"), std::string::npos) << LastMessage();
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  ASSERT_KILN_OK(kilnStreamBeginCapture(s, 0));
  EXPECT_KILN_ERR(kilnStreamBeginCapture(s, 0), kilnErrorIllegalState);
  kilnGraph_t graph = nullptr;
  ASSERT_KILN_OK(kilnStreamEndCapture(s, &graph));
  kilnGraph_t none = nullptr;
  EXPECT_KILN_ERR(kilnStreamEndCapture(s, &none), kilnErrorIllegalState);
  ASSERT_KILN_OK(kilnGraphLaunch(graph, s));  // empty graph: a no-op entry
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  ASSERT_KILN_OK(kilnGraphDestroy(graph));
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(Graph, SynchronizingTheCapturingStreamInvalidatesTheCapture) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  std::atomic<int> runs{0}, releases{0};
  ASSERT_KILN_OK(kilnStreamBeginCapture(s, 0));
  ASSERT_KILN_OK(kilnLaunchTask(s, CountRun, CountRelease, new Counted{&runs, &releases}, "counted"));
  EXPECT_KILN_ERR(kilnStreamSynchronize(s), kilnErrorStreamCaptureUnsupported);
  EXPECT_NE(LastMessage().find("operation not permitted when stream is capturing"), std::string::npos)
      << LastMessage();
  kilnStreamCaptureStatus status = kilnStreamCaptureStatusNone;
  ASSERT_KILN_OK(kilnStreamIsCapturing(s, &status));
  EXPECT_EQ(status, kilnStreamCaptureStatusInvalidated);
  // Later launches fail (and release their task) until the capture ends.
  EXPECT_KILN_ERR(kilnLaunchTask(s, CountRun, CountRelease, new Counted{&runs, &releases}, "late"),
                  kilnErrorStreamCaptureInvalidated);
  EXPECT_EQ(releases.load(), 1);
  kilnGraph_t graph = reinterpret_cast<kilnGraph_t>(0x1);
  EXPECT_KILN_ERR(kilnStreamEndCapture(s, &graph), kilnErrorStreamCaptureInvalidated);
  EXPECT_NE(LastMessage().find("kilnStreamSynchronize"), std::string::npos) << LastMessage();
  EXPECT_EQ(graph, nullptr);
  EXPECT_EQ(releases.load(), 2);
  EXPECT_EQ(runs.load(), 0);
  // The stream works normally again.
  ASSERT_KILN_OK(kilnLaunchTask(s, CountRun, CountRelease, new Counted{&runs, &releases}, "after"));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  EXPECT_EQ(runs.load(), 1);
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(Graph, OtherRefusalsInvalidateTheCapture) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  kilnEvent_t event = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&event));
  void* dev = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&dev, 64));
  char host[64] = {};
  kilnGraph_t graph = nullptr;
  struct Case {
    const char* what;
    std::function<kilnError_t()> call;
  };
  // A record on another stream that stays pending behind a gate.
  kilnStream_t other = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&other));
  auto gate = kiln_test::MakeGate();
  kiln_test::GateGuard guard{gate};
  ASSERT_KILN_OK(kiln_test::LaunchGate(other, gate));
  kilnEvent_t pending = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&pending));
  ASSERT_KILN_OK(kilnEventRecord(pending, other));
  const std::vector<Case> cases = {
      {"query", [&] { return kilnStreamQuery(s); }},
      {"device sync", [&] { return kilnDeviceSynchronize(); }},
      {"wait for uncaptured pending work", [&] { return kilnStreamWaitEvent(s, pending, 0); }},
      {"sync copy", [&] { return kilnMemcpyAsync(host, dev, 64, kilnMemcpyDeviceToHost, s); }},
      {"pageable copy", [&] { return kilnMemcpyAsync(dev, host, 64, kilnMemcpyHostToDevice, s); }},
      {"destroy", [&] { return kilnStreamDestroy(s); }},
  };
  for (const Case& c : cases) {
    ASSERT_KILN_OK(kilnStreamBeginCapture(s, 0)) << c.what;
    EXPECT_KILN_ERR(c.call(), kilnErrorStreamCaptureUnsupported) << c.what;
    EXPECT_KILN_ERR(kilnStreamEndCapture(s, &graph), kilnErrorStreamCaptureInvalidated) << c.what;
  }
  gate->Open();
  ASSERT_KILN_OK(kilnStreamSynchronize(other));
  ASSERT_KILN_OK(kilnEventDestroy(pending));
  ASSERT_KILN_OK(kilnStreamDestroy(other));
  // A wait for a completed record is a no-op, allowed; a device copy and a
  // memset are captured.
  ASSERT_KILN_OK(kilnEventRecord(event, nullptr));
  ASSERT_KILN_OK(kilnEventSynchronize(event));
  void* dev2 = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&dev2, 64));
  ASSERT_KILN_OK(kilnStreamBeginCapture(s, 0));
  ASSERT_KILN_OK(kilnStreamWaitEvent(s, event, 0));
  ASSERT_KILN_OK(kilnMemsetAsync(dev, 7, 64, s));
  ASSERT_KILN_OK(kilnMemcpyAsync(dev2, dev, 64, kilnMemcpyDeviceToDevice, s));
  ASSERT_KILN_OK(kilnStreamEndCapture(s, &graph));
  size_t nodes = 0;
  ASSERT_KILN_OK(kilnGraphGetNodeCount(graph, &nodes));
  EXPECT_EQ(nodes, 2u);
  ASSERT_KILN_OK(kilnGraphLaunch(graph, s));
  ASSERT_KILN_OK(kilnMemcpyAsync(host, dev2, 64, kilnMemcpyDeviceToHost, s));
  EXPECT_EQ(host[0], 7);
  EXPECT_EQ(host[63], 7);
  ASSERT_KILN_OK(kilnGraphDestroy(graph));
  ASSERT_KILN_OK(kilnFree(dev));
  ASSERT_KILN_OK(kilnFree(dev2));
  ASSERT_KILN_OK(kilnEventDestroy(event));
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(Graph, AFailingTaskFailsTheLaunchWithItsNameAndStopsTheGraph) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  int after = 0;
  ASSERT_KILN_OK(kilnStreamBeginCapture(s, 0));
  ASSERT_KILN_OK(Launch(
      s,
      [] {
        kilnTaskSetErrorMessage("bad index");
        return kilnErrorLaunchFailure;
      },
      "failing op"));
  ASSERT_KILN_OK(Launch(s, [&after] { ++after; }));
  kilnGraph_t graph = nullptr;
  ASSERT_KILN_OK(kilnStreamEndCapture(s, &graph));
  ASSERT_KILN_OK(kilnGraphLaunch(graph, s));
  EXPECT_KILN_ERR(kilnStreamSynchronize(s), kilnErrorLaunchFailure);
  EXPECT_EQ(LastMessage(), "failing op: bad index");
  EXPECT_EQ(after, 0);
  ASSERT_KILN_OK(kilnGraphDestroy(graph));
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(Graph, LaunchOnAnotherDeviceIsRefused) {
  int count = 0;
  ASSERT_KILN_OK(kilnGetDeviceCount(&count));
  if (count < 2) GTEST_SKIP() << "needs 2 kiln devices (KILN_DEVICE_COUNT >= 2)";
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  ASSERT_KILN_OK(kilnStreamBeginCapture(s, 0));
  kilnGraph_t graph = nullptr;
  ASSERT_KILN_OK(kilnStreamEndCapture(s, &graph));
  kilnStream_t default1 = nullptr;
  ASSERT_KILN_OK(kilnStreamGetDefault(&default1, 1));
  EXPECT_KILN_ERR(kilnGraphLaunch(graph, default1), kilnErrorInvalidValue);
  ASSERT_KILN_OK(kilnGraphDestroy(graph));
  EXPECT_KILN_ERR(kilnGraphDestroy(graph), kilnErrorInvalidResourceHandle);
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}
