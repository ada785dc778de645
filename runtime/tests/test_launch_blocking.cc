// test_launch_blocking.cc — KILN_LAUNCH_BLOCKING=1: every task runs on the
// launching thread at launch, and a failing task fails its own launch.
// The bodies run in a child process with that environment (test_util.h).
#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

using kiln_test::ExpectChildPasses;
using kiln_test::Launch;
using kiln_test::LastMessage;

TEST(ChildLaunchBlocking, TasksRunOnTheCallingThreadBeforeLaunchReturns) {
  int blocking = 0;
  ASSERT_KILN_OK(kilnGetLaunchBlocking(&blocking));
  ASSERT_EQ(blocking, 1);
  kilnStream_t s = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&s));
  std::thread::id ran_on;
  bool ran = false;
  int released = 0;
  struct Box {
    std::thread::id* ran_on;
    bool* ran;
    int* released;
  } box{&ran_on, &ran, &released};
  ASSERT_KILN_OK(kilnLaunchTask(
      s,
      [](void* u) {
        auto* b = static_cast<Box*>(u);
        *b->ran_on = std::this_thread::get_id();
        *b->ran = true;
        return kilnSuccess;
      },
      [](void* u) { ++*static_cast<Box*>(u)->released; }, &box, "inline"));
  EXPECT_TRUE(ran) << "the task must have run when kilnLaunchTask returns";
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_EQ(released, 1);
  EXPECT_KILN_OK(kilnStreamQuery(s));
  ASSERT_KILN_OK(kilnStreamDestroy(s));
}

TEST(ChildLaunchBlocking, AFailingTaskFailsItsLaunchAndIsNotSticky) {
  int released = 0;
  const kilnError_t err = kilnLaunchTask(
      nullptr,
      [](void*) {
        kilnTaskSetErrorMessage("index 5 is out of bounds for dimension 0 with size 3");
        return kilnErrorInvalidValue;
      },
      [](void* u) { ++*static_cast<int*>(u); }, &released, "aten::index");
  EXPECT_EQ(err, kilnErrorLaunchFailure) << kiln_test::Describe(err);
  EXPECT_EQ(LastMessage(), "aten::index: index 5 is out of bounds for dimension 0 with size 3");
  EXPECT_EQ(kilnGetLastErrorClass(), 0);
  EXPECT_EQ(released, 1);
  EXPECT_EQ(kilnLaunchTask(
                nullptr,
                [](void*) {
                  kilnTaskSetErrorMessage("index 5 is out of bounds");
                  kilnTaskSetErrorClass(7);
                  return kilnErrorInvalidValue;
                },
                nullptr, nullptr, "aten::index"),
            kilnErrorLaunchFailure);
  EXPECT_EQ(kilnGetLastErrorClass(), 7) << "the launch reports the task's class";
  EXPECT_KILN_OK(kilnStreamSynchronize(nullptr)) << "already reported at launch";
  EXPECT_KILN_OK(kilnDeviceSynchronize());
  bool ran = false;
  ASSERT_KILN_OK(Launch(nullptr, [&ran] { ran = true; }));
  EXPECT_TRUE(ran);
}

TEST(ChildLaunchBlocking, StreamOrderCopiesAndEventsStillWork) {
  kilnStream_t a = nullptr, b = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&a));
  ASSERT_KILN_OK(kilnStreamCreate(&b));
  unsigned char* dev = nullptr;
  ASSERT_KILN_OK(kilnMalloc(reinterpret_cast<void**>(&dev), 4097));
  std::vector<unsigned char> host(4097, 0x42);
  ASSERT_KILN_OK(kilnMemcpyAsync(dev, host.data(), host.size(), kilnMemcpyHostToDevice, a));
  EXPECT_EQ(dev[4096], 0x42) << "done at return in blocking mode";
  unsigned char* pinned = nullptr;
  ASSERT_KILN_OK(kilnMallocHost(reinterpret_cast<void**>(&pinned), 4097));
  ASSERT_KILN_OK(kilnMemcpyAsync(pinned, dev, 4097, kilnMemcpyDeviceToHost, b));
  EXPECT_EQ(pinned[17], 0x42);

  kilnEvent_t start = nullptr, end = nullptr;
  ASSERT_KILN_OK(kilnEventCreate(&start));
  ASSERT_KILN_OK(kilnEventCreate(&end));
  ASSERT_KILN_OK(kilnEventRecord(start, a));
  EXPECT_KILN_OK(kilnEventQuery(start));
  std::vector<int> order;
  for (int i = 0; i < 100; ++i) ASSERT_KILN_OK(Launch(a, [&order, i] { order.push_back(i); }));
  ASSERT_KILN_OK(kilnEventRecord(end, a));
  ASSERT_KILN_OK(kilnStreamWaitEvent(b, end, 0));
  float ms = -1;
  ASSERT_KILN_OK(kilnEventElapsedTime(&ms, start, end));
  EXPECT_GE(ms, 0.0f);
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);

  // A task may launch onto its own stream; the nested task runs at once.
  std::vector<int> nested;
  ASSERT_KILN_OK(Launch(a, [&nested, a] {
    nested.push_back(1);
    (void)Launch(a, [&nested] { nested.push_back(2); });
    nested.push_back(3);
  }));
  EXPECT_EQ(nested, (std::vector<int>{1, 2, 3}));

  ASSERT_KILN_OK(kilnEventDestroy(start));
  ASSERT_KILN_OK(kilnEventDestroy(end));
  ASSERT_KILN_OK(kilnFreeHost(pinned));
  ASSERT_KILN_OK(kilnFree(dev));
  ASSERT_KILN_OK(kilnStreamDestroy(a));
  ASSERT_KILN_OK(kilnStreamDestroy(b));
}

TEST(LaunchBlocking, TasksRunOnTheCallingThreadBeforeLaunchReturns) {
  ExpectChildPasses("ChildLaunchBlocking.TasksRunOnTheCallingThreadBeforeLaunchReturns",
                    {{"KILN_LAUNCH_BLOCKING", "1"}});
}

TEST(LaunchBlocking, AFailingTaskFailsItsLaunchAndIsNotSticky) {
  ExpectChildPasses("ChildLaunchBlocking.AFailingTaskFailsItsLaunchAndIsNotSticky",
                    {{"KILN_LAUNCH_BLOCKING", "1"}});
}

TEST(LaunchBlocking, StreamOrderCopiesAndEventsStillWork) {
  ExpectChildPasses("ChildLaunchBlocking.StreamOrderCopiesAndEventsStillWork",
                    {{"KILN_LAUNCH_BLOCKING", "1"}});
}

TEST(LaunchBlocking, ZeroMeansAsynchronous) {
  ExpectChildPasses("ChildLaunchBlocking.ReportsOff", {{"KILN_LAUNCH_BLOCKING", "0"}});
}

TEST(ChildLaunchBlocking, ReportsOff) {
  int blocking = -1;
  ASSERT_KILN_OK(kilnGetLaunchBlocking(&blocking));
  EXPECT_EQ(blocking, 0);
  std::thread::id ran_on;
  ASSERT_KILN_OK(Launch(nullptr, [&ran_on] { ran_on = std::this_thread::get_id(); }));
  ASSERT_KILN_OK(kilnStreamSynchronize(nullptr));
  EXPECT_NE(ran_on, std::this_thread::get_id());
}
