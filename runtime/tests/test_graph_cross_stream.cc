// test_graph_cross_stream.cc — streams joining a capture through events
// (Note [Cross-stream capture] in graph.cc): fork and join record every
// member's work into one graph, in capture order; a capture with a stream not
// joined back, ended on a joined stream, merging two captures, or joined by a
// default stream fails as CUDA's does; events recorded in a capture cannot be
// queried, synchronized or timed.
#include <string>
#include <vector>

#include "test_util.h"

using kiln_test::Launch;
using kiln_test::LastMessage;

namespace {

struct Streams {
  kilnStream_t origin = nullptr, side = nullptr;
  kilnEvent_t fork = nullptr, join = nullptr;
  Streams() {
    EXPECT_KILN_OK(kilnStreamCreate(&origin));
    EXPECT_KILN_OK(kilnStreamCreate(&side));
    EXPECT_KILN_OK(kilnEventCreate(&fork));
    EXPECT_KILN_OK(kilnEventCreate(&join));
  }
  ~Streams() {
    EXPECT_KILN_OK(kilnEventDestroy(fork));
    EXPECT_KILN_OK(kilnEventDestroy(join));
    EXPECT_KILN_OK(kilnStreamDestroy(side));
    EXPECT_KILN_OK(kilnStreamDestroy(origin));
  }
  // origin -> side: side joins the capture of origin.
  kilnError_t Fork() {
    if (kilnError_t err = kilnEventRecord(fork, origin)) return err;
    return kilnStreamWaitEvent(side, fork, 0);
  }
  // side -> origin: origin is ordered after side's captured work.
  kilnError_t Join() {
    if (kilnError_t err = kilnEventRecord(join, side)) return err;
    return kilnStreamWaitEvent(origin, join, 0);
  }
};

kilnStreamCaptureStatus StatusOf(kilnStream_t s, unsigned long long* id = nullptr) {
  kilnStreamCaptureStatus status = kilnStreamCaptureStatusNone;
  EXPECT_KILN_OK(kilnStreamGetCaptureInfo(s, &status, id));
  return status;
}

}  // namespace

TEST(GraphCrossStream, ForkAndJoinRecordBothStreamsIntoOneGraph) {
  Streams st;
  std::vector<int> order;
  ASSERT_KILN_OK(kilnStreamBeginCapture(st.origin, 0));
  ASSERT_KILN_OK(Launch(st.origin, [&order] { order.push_back(1); }));
  ASSERT_KILN_OK(st.Fork());
  unsigned long long origin_id = 0, side_id = 0;
  EXPECT_EQ(StatusOf(st.origin, &origin_id), kilnStreamCaptureStatusActive);
  EXPECT_EQ(StatusOf(st.side, &side_id), kilnStreamCaptureStatusActive);
  EXPECT_NE(origin_id, 0u);
  EXPECT_EQ(origin_id, side_id) << "a joined stream reports the capture it joined";
  ASSERT_KILN_OK(Launch(st.side, [&order] { order.push_back(2); }));
  ASSERT_KILN_OK(Launch(st.origin, [&order] { order.push_back(3); }));
  ASSERT_KILN_OK(Launch(st.side, [&order] { order.push_back(4); }));
  ASSERT_KILN_OK(st.Join());
  ASSERT_KILN_OK(Launch(st.origin, [&order] { order.push_back(5); }));
  kilnGraph_t graph = nullptr;
  ASSERT_KILN_OK(kilnStreamEndCapture(st.origin, &graph));
  EXPECT_EQ(StatusOf(st.side), kilnStreamCaptureStatusNone) << "the end of the capture ends it for joined streams";
  size_t nodes = 0;
  ASSERT_KILN_OK(kilnGraphGetNodeCount(graph, &nodes));
  EXPECT_EQ(nodes, 5u);
  ASSERT_KILN_OK(kilnStreamSynchronize(st.side));
  ASSERT_KILN_OK(kilnStreamSynchronize(st.origin));
  EXPECT_TRUE(order.empty()) << "capture must not run the work";
  ASSERT_KILN_OK(kilnGraphLaunch(graph, st.origin));
  ASSERT_KILN_OK(kilnStreamSynchronize(st.origin));
  ASSERT_KILN_OK(kilnGraphLaunch(graph, st.side));  // any stream of the device
  ASSERT_KILN_OK(kilnStreamSynchronize(st.side));
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3, 4, 5, 1, 2, 3, 4, 5}));
  // The side stream runs its own work again once the capture ended.
  ASSERT_KILN_OK(Launch(st.side, [&order] { order.push_back(6); }));
  ASSERT_KILN_OK(kilnStreamSynchronize(st.side));
  EXPECT_EQ(order.back(), 6);
  ASSERT_KILN_OK(kilnGraphDestroy(graph));
}

TEST(GraphCrossStream, AJoinThroughAThirdStreamCounts) {
  Streams st;
  kilnStream_t third = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&third));
  kilnEvent_t e = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&e));
  std::vector<int> order;
  ASSERT_KILN_OK(kilnStreamBeginCapture(st.origin, 0));
  ASSERT_KILN_OK(st.Fork());
  ASSERT_KILN_OK(kilnEventRecord(e, st.side));  // side -> third
  ASSERT_KILN_OK(kilnStreamWaitEvent(third, e, 0));
  ASSERT_KILN_OK(Launch(third, [&order] { order.push_back(1); }));
  ASSERT_KILN_OK(Launch(st.side, [&order] { order.push_back(2); }));
  ASSERT_KILN_OK(kilnEventRecord(e, third));  // third -> side -> origin
  ASSERT_KILN_OK(kilnStreamWaitEvent(st.side, e, 0));
  ASSERT_KILN_OK(st.Join());
  kilnGraph_t graph = nullptr;
  ASSERT_KILN_OK(kilnStreamEndCapture(st.origin, &graph)) << LastMessage();
  ASSERT_KILN_OK(kilnGraphLaunch(graph, st.origin));
  ASSERT_KILN_OK(kilnStreamSynchronize(st.origin));
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  ASSERT_KILN_OK(kilnGraphDestroy(graph));
  ASSERT_KILN_OK(kilnEventDestroy(e));
  ASSERT_KILN_OK(kilnStreamDestroy(third));
}

TEST(GraphCrossStream, AStreamNotJoinedBackFailsTheCapture) {
  for (bool with_work : {true, false}) {
    Streams st;
    int runs = 0;
    ASSERT_KILN_OK(kilnStreamBeginCapture(st.origin, 0));
    ASSERT_KILN_OK(st.Fork());
    // Joining and doing nothing still needs a join back, as in CUDA.
    if (with_work) ASSERT_KILN_OK(Launch(st.side, [&runs] { ++runs; }));
    kilnGraph_t graph = reinterpret_cast<kilnGraph_t>(0x1);
    EXPECT_KILN_ERR(kilnStreamEndCapture(st.origin, &graph), kilnErrorStreamCaptureUnjoined) << with_work;
    EXPECT_EQ(graph, nullptr);
    EXPECT_NE(LastMessage().find("does not wait for"), std::string::npos) << LastMessage();
    EXPECT_EQ(StatusOf(st.origin), kilnStreamCaptureStatusNone);
    EXPECT_EQ(StatusOf(st.side), kilnStreamCaptureStatusNone);
    ASSERT_KILN_OK(Launch(st.side, [&runs] { ++runs; }));
    ASSERT_KILN_OK(kilnStreamSynchronize(st.side));
    EXPECT_EQ(runs, 1) << "only the work launched after the capture runs";
  }
}

TEST(GraphCrossStream, AJoinRecordedBeforeLaterSideWorkIsNotEnough) {
  Streams st;
  ASSERT_KILN_OK(kilnStreamBeginCapture(st.origin, 0));
  ASSERT_KILN_OK(st.Fork());
  ASSERT_KILN_OK(Launch(st.side, [] {}));
  ASSERT_KILN_OK(st.Join());
  ASSERT_KILN_OK(Launch(st.side, [] {}));  // after the join's record
  kilnGraph_t graph = nullptr;
  EXPECT_KILN_ERR(kilnStreamEndCapture(st.origin, &graph), kilnErrorStreamCaptureUnjoined);
}

TEST(GraphCrossStream, EndingOnAJoinedStreamIsUnmatchedAndInvalidates) {
  Streams st;
  ASSERT_KILN_OK(kilnStreamBeginCapture(st.origin, 0));
  ASSERT_KILN_OK(st.Fork());
  kilnGraph_t graph = nullptr;
  EXPECT_KILN_ERR(kilnStreamEndCapture(st.side, &graph), kilnErrorStreamCaptureUnmatched);
  EXPECT_EQ(StatusOf(st.side), kilnStreamCaptureStatusInvalidated);
  EXPECT_KILN_ERR(kilnStreamBeginCapture(st.side, 0), kilnErrorIllegalState);
  EXPECT_KILN_ERR(st.Join(), kilnErrorStreamCaptureInvalidated);
  EXPECT_KILN_ERR(kilnStreamEndCapture(st.origin, &graph), kilnErrorStreamCaptureInvalidated);
  EXPECT_EQ(StatusOf(st.side), kilnStreamCaptureStatusNone);
}

TEST(GraphCrossStream, WaitingForAJoinedStreamIsRefused) {
  Streams st;
  ASSERT_KILN_OK(kilnStreamBeginCapture(st.origin, 0));
  ASSERT_KILN_OK(st.Fork());
  EXPECT_KILN_ERR(kilnStreamSynchronize(st.side), kilnErrorStreamCaptureUnsupported);
  EXPECT_KILN_ERR(kilnStreamDestroy(st.side), kilnErrorStreamCaptureUnsupported);
  EXPECT_KILN_ERR(Launch(st.origin, [] {}), kilnErrorStreamCaptureInvalidated);
  EXPECT_KILN_ERR(st.Join(), kilnErrorStreamCaptureInvalidated);
  kilnGraph_t graph = nullptr;
  EXPECT_KILN_ERR(kilnStreamEndCapture(st.origin, &graph), kilnErrorStreamCaptureInvalidated);
  EXPECT_NE(LastMessage().find("kilnStreamSynchronize"), std::string::npos) << LastMessage();
}

TEST(GraphCrossStream, CapturedEventsCannotBeQueriedSynchronizedOrTimed) {
  Streams st;
  kilnEvent_t done = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&done));
  ASSERT_KILN_OK(kilnEventRecord(done, st.origin));
  ASSERT_KILN_OK(kilnEventSynchronize(done));
  ASSERT_KILN_OK(kilnStreamBeginCapture(st.origin, 0));
  ASSERT_KILN_OK(kilnEventRecord(st.fork, st.origin));
  EXPECT_KILN_ERR(kilnEventQuery(st.fork), kilnErrorCapturedEvent);
  EXPECT_KILN_ERR(kilnEventSynchronize(st.fork), kilnErrorCapturedEvent);
  float ms = 0;
  EXPECT_KILN_ERR(kilnEventElapsedTime(&ms, done, st.fork), kilnErrorCapturedEvent);
  EXPECT_NE(LastMessage().find("capturing stream"), std::string::npos) << LastMessage();
  EXPECT_EQ(StatusOf(st.origin), kilnStreamCaptureStatusActive) << "these do not invalidate";
  kilnGraph_t graph = nullptr;
  ASSERT_KILN_OK(kilnStreamEndCapture(st.origin, &graph));
  // Its capture has ended: waiting for the record is an error, and a new
  // record outside capture makes the event usable again.
  EXPECT_KILN_ERR(kilnStreamWaitEvent(st.side, st.fork, 0), kilnErrorCapturedEvent);
  EXPECT_EQ(StatusOf(st.side), kilnStreamCaptureStatusNone);
  ASSERT_KILN_OK(kilnEventRecord(st.fork, st.origin));
  ASSERT_KILN_OK(kilnEventSynchronize(st.fork));
  ASSERT_KILN_OK(kilnStreamWaitEvent(st.side, st.fork, 0));
  ASSERT_KILN_OK(kilnGraphDestroy(graph));
  ASSERT_KILN_OK(kilnEventDestroy(done));
}

TEST(GraphCrossStream, TheDefaultStreamCannotJoin) {
  Streams st;
  kilnStream_t default0 = nullptr;
  ASSERT_KILN_OK(kilnStreamGetDefault(&default0, 0));
  ASSERT_KILN_OK(kilnStreamBeginCapture(st.origin, 0));
  ASSERT_KILN_OK(kilnEventRecord(st.fork, st.origin));
  EXPECT_KILN_ERR(kilnStreamWaitEvent(default0, st.fork, 0), kilnErrorStreamCaptureImplicit);
  EXPECT_EQ(StatusOf(default0), kilnStreamCaptureStatusNone);
  EXPECT_EQ(StatusOf(st.origin), kilnStreamCaptureStatusInvalidated);
  kilnGraph_t graph = nullptr;
  EXPECT_KILN_ERR(kilnStreamEndCapture(st.origin, &graph), kilnErrorStreamCaptureInvalidated);
  EXPECT_NE(LastMessage().find("default stream"), std::string::npos) << LastMessage();
}

TEST(GraphCrossStream, TwoCapturesCannotMerge) {
  Streams a, b;
  ASSERT_KILN_OK(kilnStreamBeginCapture(a.origin, 0));
  ASSERT_KILN_OK(kilnStreamBeginCapture(b.origin, 0));
  ASSERT_KILN_OK(kilnEventRecord(a.fork, a.origin));
  EXPECT_KILN_ERR(kilnStreamWaitEvent(b.origin, a.fork, 0), kilnErrorStreamCaptureMerge);
  kilnGraph_t graph = nullptr;
  EXPECT_KILN_ERR(kilnStreamEndCapture(a.origin, &graph), kilnErrorStreamCaptureInvalidated);
  EXPECT_KILN_ERR(kilnStreamEndCapture(b.origin, &graph), kilnErrorStreamCaptureInvalidated);
}

TEST(GraphCrossStream, AStreamOfAnotherDeviceCannotJoin) {
  int count = 0;
  ASSERT_KILN_OK(kilnGetDeviceCount(&count));
  if (count < 2) GTEST_SKIP() << "needs 2 kiln devices (KILN_DEVICE_COUNT >= 2)";
  Streams st;
  ASSERT_KILN_OK(kilnSetDevice(1));
  kilnStream_t other = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&other));
  ASSERT_KILN_OK(kilnSetDevice(0));
  ASSERT_KILN_OK(kilnStreamBeginCapture(st.origin, 0));
  ASSERT_KILN_OK(kilnEventRecord(st.fork, st.origin));
  EXPECT_KILN_ERR(kilnStreamWaitEvent(other, st.fork, 0), kilnErrorInvalidValue);
  EXPECT_NE(LastMessage().find("kiln device 1"), std::string::npos) << LastMessage();
  kilnGraph_t graph = nullptr;
  EXPECT_KILN_ERR(kilnStreamEndCapture(st.origin, &graph), kilnErrorStreamCaptureInvalidated);
  ASSERT_KILN_OK(kilnStreamDestroy(other));
}
