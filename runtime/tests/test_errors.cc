// test_errors.cc — error names and strings, the per-thread last message,
// argument checking of output pointers, and the version.
#include <string>
#include <thread>

#include "test_util.h"

using kiln_test::LastMessage;

TEST(Errors, EveryCodeHasItsEnumeratorNameAndADescription) {
  const struct {
    kilnError_t code;
    const char* name;
  } codes[] = {
      {kilnSuccess, "kilnSuccess"},
      {kilnErrorInvalidValue, "kilnErrorInvalidValue"},
      {kilnErrorMemoryAllocation, "kilnErrorMemoryAllocation"},
      {kilnErrorInitializationError, "kilnErrorInitializationError"},
      {kilnErrorInvalidDevicePointer, "kilnErrorInvalidDevicePointer"},
      {kilnErrorInvalidDevice, "kilnErrorInvalidDevice"},
      {kilnErrorInvalidResourceHandle, "kilnErrorInvalidResourceHandle"},
      {kilnErrorNotReady, "kilnErrorNotReady"},
      {kilnErrorLaunchFailure, "kilnErrorLaunchFailure"},
      {kilnErrorNotPermitted, "kilnErrorNotPermitted"},
      {kilnErrorUnknown, "kilnErrorUnknown"},
  };
  for (const auto& c : codes) {
    EXPECT_STREQ(kilnGetErrorName(c.code), c.name);
    ASSERT_NE(kilnGetErrorString(c.code), nullptr);
    EXPECT_GT(std::string(kilnGetErrorString(c.code)).size(), 3u) << c.name;
  }
  EXPECT_STREQ(kilnGetErrorString(kilnErrorMemoryAllocation), "out of memory");
  // The numbers follow CUDA's.
  EXPECT_EQ(kilnErrorInvalidDevicePointer, 17);
  EXPECT_EQ(kilnErrorInvalidDevice, 101);
  EXPECT_EQ(kilnErrorNotReady, 600);
}

TEST(Errors, UnknownCodesStillGetAString) {
  const auto bogus = static_cast<kilnError_t>(12345);
  ASSERT_NE(kilnGetErrorName(bogus), nullptr);
  ASSERT_NE(kilnGetErrorString(bogus), nullptr);
  EXPECT_GT(std::string(kilnGetErrorName(bogus)).size(), 0u);
  EXPECT_GT(std::string(kilnGetErrorString(bogus)).size(), 0u);
}

TEST(Errors, LastMessageNamesTheFailingFunction) {
  EXPECT_KILN_ERR(kilnSetDevice(42), kilnErrorInvalidDevice);
  const std::string message = LastMessage();
  EXPECT_EQ(message.rfind("kilnSetDevice: ", 0), 0u) << message;
  EXPECT_NE(message.find("42"), std::string::npos) << message;
}

TEST(Errors, LastMessageSurvivesSuccessfulCalls) {
  EXPECT_KILN_ERR(kilnSetDevice(42), kilnErrorInvalidDevice);
  const std::string before = LastMessage();
  int count = 0;
  ASSERT_KILN_OK(kilnGetDeviceCount(&count));
  EXPECT_EQ(LastMessage(), before);
}

TEST(Errors, LastMessageIsPerThread) {
  EXPECT_KILN_ERR(kilnSetDevice(42), kilnErrorInvalidDevice);
  std::string other_before, other_after;
  std::thread([&] {
    other_before = kilnGetLastErrorMessage();
    void* p = nullptr;
    (void)kilnFree(&p);  // a stack address: fails on this thread only
    other_after = kilnGetLastErrorMessage();
  }).join();
  EXPECT_EQ(other_before, "") << "a new thread starts with no message";
  EXPECT_NE(other_after.find("kilnFree"), std::string::npos) << other_after;
  EXPECT_NE(LastMessage().find("kilnSetDevice"), std::string::npos)
      << "another thread's failure must not replace this thread's message: " << LastMessage();
}

TEST(Errors, NullOutputPointersAreInvalidValue) {
  void* p = nullptr;
  kilnStream_t s = nullptr;
  kilnEvent_t e = nullptr;
  kilnPointerAttributes attrs;
  EXPECT_KILN_ERR(kilnGetDeviceCount(nullptr), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnGetDevice(nullptr), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnMalloc(nullptr, 16), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnMallocHost(nullptr, 16), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnPointerGetAttributes(nullptr, &p), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnStreamCreate(nullptr), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnStreamGetDefault(nullptr, 0), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnStreamGetDevice(nullptr, nullptr), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnStreamGetPriority(nullptr, nullptr), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnEventCreate(nullptr), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnRuntimeGetVersion(nullptr), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnGetLaunchBlocking(nullptr), kilnErrorInvalidValue);
  ASSERT_KILN_OK(kilnEventCreate(&e));
  EXPECT_KILN_ERR(kilnEventElapsedTime(nullptr, e, e), kilnErrorInvalidValue);
  ASSERT_KILN_OK(kilnEventDestroy(e));
  (void)s;
  (void)attrs;
}

TEST(Errors, TaskSetErrorMessageOutsideATaskDoesNothing) {
  EXPECT_KILN_ERR(kilnSetDevice(42), kilnErrorInvalidDevice);
  const std::string before = LastMessage();
  kilnTaskSetErrorMessage("not in a task");
  kilnTaskSetErrorMessage(nullptr);
  EXPECT_EQ(LastMessage(), before);
}

TEST(Errors, VersionIsTheHeadersVersion) {
  int version = 0;
  ASSERT_KILN_OK(kilnRuntimeGetVersion(&version));
  EXPECT_EQ(version, KILN_RUNTIME_VERSION);
}
