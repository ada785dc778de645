// test_stream.cc — stream creation, default streams, ordering, queries,
// synchronisation, destruction, handle validation and task launch.
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "test_util.h"

using kiln_test::GateGuard;
using kiln_test::Launch;
using kiln_test::LaunchGate;
using kiln_test::LastMessage;
using kiln_test::MakeGate;

TEST(Stream, ThousandTasksRunInLaunchOrder) {
  kilnStream_t stream = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&stream));
  std::vector<int> order;  // touched only by the stream's tasks until the sync
  order.reserve(1000);
  for (int i = 0; i < 1000; ++i) ASSERT_KILN_OK(Launch(stream, [&order, i] { order.push_back(i); }));
  ASSERT_KILN_OK(kilnStreamSynchronize(stream));
  ASSERT_EQ(order.size(), 1000u);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(order[i], i);
  ASSERT_KILN_OK(kilnStreamDestroy(stream));
}

TEST(Stream, DefaultStreamIsStablePerDeviceAndDistinctAcrossDevices) {
  kilnStream_t a = nullptr, b = nullptr, c = nullptr;
  ASSERT_KILN_OK(kilnStreamGetDefault(&a, 0));
  ASSERT_KILN_OK(kilnStreamGetDefault(&b, 0));
  ASSERT_KILN_OK(kilnStreamGetDefault(&c, 1));
  EXPECT_NE(a, nullptr);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  int device = -1;
  ASSERT_KILN_OK(kilnStreamGetDevice(c, &device));
  EXPECT_EQ(device, 1);
  EXPECT_KILN_ERR(kilnStreamGetDefault(&a, 7), kilnErrorInvalidDevice);
  EXPECT_KILN_ERR(kilnStreamGetDefault(&a, -1), kilnErrorInvalidDevice);
}

TEST(Stream, NullStreamIsTheCurrentDevicesDefaultStreamAtCallTime) {
  kilnStream_t default1 = nullptr;
  ASSERT_KILN_OK(kilnStreamGetDefault(&default1, 1));
  ASSERT_KILN_OK(kilnSetDevice(1));
  int device = -1;
  ASSERT_KILN_OK(kilnStreamGetDevice(nullptr, &device));
  EXPECT_EQ(device, 1);
  // Work on NULL and on device 1's default stream runs on the same queue.
  std::thread::id via_null, via_handle;
  ASSERT_KILN_OK(Launch(nullptr, [&] { via_null = std::this_thread::get_id(); }));
  ASSERT_KILN_OK(Launch(default1, [&] { via_handle = std::this_thread::get_id(); }));
  ASSERT_KILN_OK(kilnStreamSynchronize(default1));
  EXPECT_EQ(via_null, via_handle);
  EXPECT_NE(via_null, std::this_thread::get_id());
  ASSERT_KILN_OK(kilnSetDevice(0));
  ASSERT_KILN_OK(kilnStreamGetDevice(nullptr, &device));
  EXPECT_EQ(device, 0);
}

TEST(Stream, DefaultStreamsCannotBeDestroyed) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamGetDefault(&s, 0));
  EXPECT_KILN_ERR(kilnStreamDestroy(s), kilnErrorInvalidResourceHandle);
  EXPECT_NE(LastMessage().find("default stream"), std::string::npos) << LastMessage();
  EXPECT_KILN_ERR(kilnStreamDestroy(nullptr), kilnErrorInvalidResourceHandle);
  int ran = 0;
  ASSERT_KILN_OK(Launch(s, [&ran] { ran = 1; }));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  EXPECT_EQ(ran, 1) << "the default stream must still work";
}

TEST(Stream, CreatedStreamsBelongToTheCurrentDevice) {
  ASSERT_KILN_OK(kilnSetDevice(1));
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  ASSERT_KILN_OK(kilnSetDevice(0));
  int device = -1;
  ASSERT_KILN_OK(kilnStreamGetDevice(s, &device));
  EXPECT_EQ(device, 1);
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(Stream, PrioritiesAreClampedToTheRangeAndFlagsMustBeZero) {
  const struct {
    int asked, got;
  } cases[] = {{-5, -1}, {-1, -1}, {0, 0}, {3, 0}};
  for (const auto& c : cases) {
    kilnStream_t s = nullptr;
    ASSERT_KILN_OK(kilnStreamCreateWithPriority(&s, 0, c.asked));
    int priority = 99;
    ASSERT_KILN_OK(kilnStreamGetPriority(s, &priority));
    EXPECT_EQ(priority, c.got) << "asked for " << c.asked;
    ASSERT_KILN_OK(kilnStreamDestroy(s));
  }
  kilnStream_t s = nullptr;
  EXPECT_KILN_ERR(kilnStreamCreateWithPriority(&s, 1, 0), kilnErrorInvalidValue);
  int priority = 99;
  ASSERT_KILN_OK(kilnStreamGetPriority(nullptr, &priority));
  EXPECT_EQ(priority, 0);
}

TEST(Stream, QueryIsNotReadyWhileWorkIsPendingThenSuccess) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  EXPECT_KILN_OK(kilnStreamQuery(s));
  auto gate = MakeGate();
  int after = 0;
  {
    GateGuard guard{gate};
    ASSERT_KILN_OK(LaunchGate(s, gate));
    ASSERT_KILN_OK(Launch(s, [&after] { after = 1; }));
    EXPECT_KILN_ERR(kilnStreamQuery(s), kilnErrorNotReady);
    EXPECT_KILN_ERR(kilnStreamQuery(s), kilnErrorNotReady);
  }
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  EXPECT_EQ(after, 1);
  EXPECT_KILN_OK(kilnStreamQuery(s));
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(Stream, StreamsRunIndependently) {
  kilnStream_t blocked = nullptr, free_stream = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&blocked));
  ASSERT_KILN_OK(kilnStreamCreate(&free_stream));
  auto gate = MakeGate();
  int ran = 0;
  {
    GateGuard guard{gate};
    ASSERT_KILN_OK(LaunchGate(blocked, gate));
    ASSERT_KILN_OK(Launch(free_stream, [&ran] { ran = 1; }));
    ASSERT_KILN_OK(kilnStreamSynchronize(free_stream));  // would hang if streams shared a queue
    EXPECT_EQ(ran, 1);
    EXPECT_KILN_ERR(kilnStreamQuery(blocked), kilnErrorNotReady);
  }
  ASSERT_KILN_OK(kilnStreamSynchronize(blocked));
  ASSERT_KILN_OK(kilnStreamDestroy(blocked));
  ASSERT_KILN_OK(kilnStreamDestroy(free_stream));
}

TEST(Stream, DestroyWaitsForPendingWork) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  std::atomic<int> count{0};
  for (int i = 0; i < 100; ++i) {
    ASSERT_KILN_OK(Launch(s, [&count] {
      volatile unsigned sink = 0;
      for (unsigned k = 0; k < 2000; ++k) sink = sink + k;
      count.fetch_add(1);
    }));
  }
  ASSERT_KILN_OK(kilnStreamDestroy(s));
  EXPECT_EQ(count.load(), 100);
}

TEST(Stream, DestroyedAndForeignHandlesAreRejected) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  ASSERT_KILN_OK(kilnStreamDestroy(s));
  EXPECT_KILN_ERR(kilnStreamDestroy(s), kilnErrorInvalidResourceHandle);
  EXPECT_NE(LastMessage().find("destroyed"), std::string::npos) << LastMessage();
  EXPECT_KILN_ERR(kilnStreamQuery(s), kilnErrorInvalidResourceHandle);
  EXPECT_KILN_ERR(kilnStreamSynchronize(s), kilnErrorInvalidResourceHandle);
  int released = 0;
  EXPECT_KILN_ERR(kilnLaunchTask(
                      s, [](void*) { return kilnSuccess; },
                      [](void* u) { ++*static_cast<int*>(u); }, &released, "late"),
                  kilnErrorInvalidResourceHandle);
  EXPECT_EQ(released, 1);

  int not_a_stream[64] = {};
  auto bogus = reinterpret_cast<kilnStream_t>(&not_a_stream[8]);
  EXPECT_KILN_ERR(kilnStreamQuery(bogus), kilnErrorInvalidResourceHandle);
  EXPECT_NE(LastMessage().find("is not a stream"), std::string::npos) << LastMessage();
  EXPECT_KILN_ERR(kilnStreamDestroy(bogus), kilnErrorInvalidResourceHandle);
  EXPECT_KILN_ERR(kilnStreamSynchronize(reinterpret_cast<kilnStream_t>(uintptr_t{0xdead0})),
                  kilnErrorInvalidResourceHandle);
}

TEST(Stream, LaunchRejectsNullFunctionAndStillReleases) {
  int released = 0;
  EXPECT_KILN_ERR(kilnLaunchTask(nullptr, nullptr, [](void* u) { ++*static_cast<int*>(u); }, &released,
                                 "no fn"),
                  kilnErrorInvalidValue);
  EXPECT_EQ(released, 1);
  EXPECT_KILN_OK(kilnLaunchTask(nullptr, [](void*) { return kilnSuccess; }, nullptr, nullptr, nullptr));
  EXPECT_KILN_OK(kilnStreamSynchronize(nullptr));
}

TEST(Stream, ReleaseRunsExactlyOnceAfterTheTaskOnTheWorker) {
  struct Data {
    std::atomic<int> runs{0};
    std::atomic<int> releases{0};
    std::atomic<bool> released_after_run{true};
  } data;
  for (int i = 0; i < 100; ++i) {
    ASSERT_KILN_OK(kilnLaunchTask(
        nullptr,
        [](void* u) {
          static_cast<Data*>(u)->runs.fetch_add(1);
          return kilnSuccess;
        },
        [](void* u) {
          auto* d = static_cast<Data*>(u);
          if (d->releases.fetch_add(1) + 1 > d->runs.load()) d->released_after_run = false;
        },
        &data, "counted"));
  }
  ASSERT_KILN_OK(kilnStreamSynchronize(nullptr));
  EXPECT_EQ(data.runs.load(), 100);
  EXPECT_EQ(data.releases.load(), 100);
  EXPECT_TRUE(data.released_after_run.load());
}

TEST(Stream, ConcurrentLaunchersKeepTheirOwnOrder) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  static constexpr int kThreads = 4, kPerThread = 2000;
  std::vector<int> seen;  // written by the stream's tasks only
  seen.reserve(kThreads * kPerThread);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i)
        if (Launch(s, [&seen, t, i] { seen.push_back(t * kPerThread + i); }) != kilnSuccess) ++failures;
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  EXPECT_EQ(failures.load(), 0);
  ASSERT_EQ(seen.size(), static_cast<size_t>(kThreads * kPerThread));
  std::vector<int> last(kThreads, -1);
  for (int v : seen) {
    const int t = v / kPerThread, i = v % kPerThread;
    ASSERT_EQ(i, last[t] + 1) << "thread " << t << "'s launches ran out of order";
    last[t] = i;
  }
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(Stream, ManyStreamsCanBeCreatedUsedAndDestroyed) {
  std::atomic<int> ran{0};
  for (int round = 0; round < 10; ++round) {
    std::vector<kilnStream_t> streams(20);
    for (auto& s : streams) ASSERT_KILN_OK(kilnStreamCreate(&s));
    for (auto& s : streams) ASSERT_KILN_OK(Launch(s, [&ran] { ran.fetch_add(1); }));
    for (auto& s : streams) ASSERT_KILN_OK(kilnStreamDestroy(s));
  }
  EXPECT_EQ(ran.load(), 200);
}

TEST(Stream, SynchronizeFromManyThreadsAtOnce) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  std::atomic<int> done{0};
  for (int i = 0; i < 500; ++i) ASSERT_KILN_OK(Launch(s, [&done] { done.fetch_add(1); }));
  std::vector<std::thread> waiters;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t) {
    waiters.emplace_back([&] {
      if (kilnStreamSynchronize(s) != kilnSuccess || done.load() != 500) ++bad;
    });
  }
  for (auto& t : waiters) t.join();
  EXPECT_EQ(bad.load(), 0);
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(Stream, ATaskMayLaunchOntoItsOwnStream) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  std::vector<int> order;
  std::atomic<int> inner_status{-1};
  ASSERT_KILN_OK(Launch(s, [&, s] {
    order.push_back(1);
    inner_status = Launch(s, [&order] { order.push_back(3); });
    order.push_back(2);
  }));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));  // the inner task was launched during the first wait
  EXPECT_EQ(inner_status.load(), kilnSuccess);
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(Stream, WaitingForItsOwnStreamFromATaskIsNotPermitted) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  void* p = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&p, 64));
  kilnError_t sync = kilnSuccess, device_sync = kilnSuccess, free_err = kilnSuccess,
              destroy = kilnSuccess;
  std::string message;
  ASSERT_KILN_OK(Launch(s, [&, s, p] {
    sync = kilnStreamSynchronize(s);
    message = kilnGetLastErrorMessage();
    device_sync = kilnDeviceSynchronize();
    free_err = kilnFree(p);
    destroy = kilnStreamDestroy(s);
  }));
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  EXPECT_EQ(sync, kilnErrorNotPermitted);
  EXPECT_NE(message.find("inside a task"), std::string::npos) << message;
  EXPECT_EQ(device_sync, kilnErrorNotPermitted);
  EXPECT_EQ(free_err, kilnErrorNotPermitted);
  EXPECT_EQ(destroy, kilnErrorNotPermitted);
  ASSERT_KILN_OK(kilnFree(p));  // still live: the rejected free changed nothing
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(Stream, LaunchBlockingIsOffByDefault) {
  int blocking = -1;
  ASSERT_KILN_OK(kilnGetLaunchBlocking(&blocking));
  EXPECT_EQ(blocking, 0);
  std::thread::id ran_on;
  ASSERT_KILN_OK(Launch(nullptr, [&ran_on] { ran_on = std::this_thread::get_id(); }));
  ASSERT_KILN_OK(kilnStreamSynchronize(nullptr));
  EXPECT_NE(ran_on, std::this_thread::get_id()) << "tasks run on the stream's worker thread";
}

// kilnStreamGetSubmittedCount: one more per entry enqueued, whatever its kind.
TEST(Stream, SubmittedCountGrowsByOnePerEntryOfAnyKind) {
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  unsigned long long before = 0, after = 0;
  ASSERT_KILN_OK(kilnStreamGetSubmittedCount(s, &before));
  ASSERT_KILN_OK(kiln_test::Launch(s, [] {}, "a task"));
  ASSERT_KILN_OK(kilnStreamGetSubmittedCount(s, &after));
  EXPECT_EQ(after, before + 1);
  kilnEvent_t e = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&e));
  ASSERT_KILN_OK(kilnEventRecord(e, s));
  ASSERT_KILN_OK(kilnStreamWaitEvent(s, e, 0));
  ASSERT_KILN_OK(kilnStreamGetSubmittedCount(s, &before));
  EXPECT_EQ(before, after + 2) << "an event record and a wait are entries too";
  ASSERT_KILN_OK(kilnStreamSynchronize(s));
  ASSERT_KILN_OK(kilnStreamGetSubmittedCount(s, &after));
  EXPECT_EQ(after, before) << "a synchronization enqueues nothing";
  EXPECT_KILN_ERR(kilnStreamGetSubmittedCount(s, nullptr), kilnErrorInvalidValue);
  ASSERT_KILN_OK(kilnEventDestroy(e));
  ASSERT_KILN_OK(kilnStreamDestroy(s));
  EXPECT_KILN_ERR(kilnStreamGetSubmittedCount(s, &after), kilnErrorInvalidResourceHandle);
}
