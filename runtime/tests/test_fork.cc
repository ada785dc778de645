// test_fork.cc — a child forked after the runtime was initialised cannot use
// it: every call fails with kilnErrorInitializationError and says to use the
// 'spawn' start method. A child forked before initialisation is unaffected.
//
// The forked child reports a bit mask of failed checks through a pipe and
// runs no test framework code after fork(). (Not through its exit status: a
// memory checker may change that, e.g. valgrind counting the parent's worker
// threads, which do not exist in the child, as leaks.)
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "test_util.h"

namespace {

int released_in_child = 0;

// Runs in the forked child; returns a bit mask of failed checks.
int CheckForkedChildIsRefused() {
  int failed = 0;
  int count = -1;
  if (kilnGetDeviceCount(&count) != kilnErrorInitializationError) failed |= 1;
  if (std::strstr(kilnGetLastErrorMessage(), "'spawn'") == nullptr) failed |= 2;
  void* p = nullptr;
  if (kilnMalloc(&p, 64) != kilnErrorInitializationError) failed |= 4;
  if (kilnStreamSynchronize(nullptr) != kilnErrorInitializationError) failed |= 8;
  if (kilnLaunchTask(
          nullptr, [](void*) { return kilnSuccess; }, [](void*) { ++released_in_child; }, nullptr,
          "in child") != kilnErrorInitializationError)
    failed |= 16;
  if (released_in_child != 1) failed |= 32;
  if (kilnSetDevice(0) != kilnErrorInitializationError) failed |= 64;
  if (std::strstr(kilnGetLastErrorMessage(), "kilnSetDevice") == nullptr) failed |= 128;
  return failed;
}

// Runs `check` in a forked child and returns its bit mask of failed checks,
// or a value >= 1000 if the child died without reporting.
template <class Check>
int RunForked(Check check) {
  int fds[2];
  if (pipe(fds) != 0) return 2000;
  const pid_t pid = fork();
  if (pid < 0) return 3000;
  if (pid == 0) {
    close(fds[0]);
    const int failed = check();
    const ssize_t written = write(fds[1], &failed, sizeof failed);
    _exit(written == static_cast<ssize_t>(sizeof failed) ? 0 : 1);
  }
  close(fds[1]);
  int failed = 1000;
  if (read(fds[0], &failed, sizeof failed) != static_cast<ssize_t>(sizeof failed)) failed = 1000;
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
  }
  return failed;
}

}  // namespace

TEST(Fork, ChildForkedAfterInitialisationGetsInitializationError) {
  // Initialise, with worker threads running and memory allocated.
  void* p = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&p, 64));
  ASSERT_KILN_OK(kiln_test::Launch(nullptr, [] {}));
  ASSERT_KILN_OK(kilnStreamSynchronize(nullptr));

  EXPECT_EQ(RunForked(CheckForkedChildIsRefused), 0) << "bit mask of failed checks in the child";

  // The parent is unaffected.
  int count = 0;
  EXPECT_KILN_OK(kilnGetDeviceCount(&count));
  EXPECT_KILN_OK(kilnFree(p));
}

// Runs in a fresh process (no kiln call before the fork).
TEST(ChildFork, ForkBeforeInitialisationIsFine) {
  const int failed = RunForked([] {
    int count = 0;
    void* p = nullptr;
    int bits = 0;
    if (kilnGetDeviceCount(&count) != kilnSuccess || count != 2) bits |= 1;
    if (kilnMalloc(&p, 64) != kilnSuccess) bits |= 2;
    if (kilnMemsetAsync(p, 3, 64, nullptr) != kilnSuccess) bits |= 4;
    if (kilnStreamSynchronize(nullptr) != kilnSuccess || static_cast<unsigned char*>(p)[63] != 3) bits |= 8;
    if (kilnFree(p) != kilnSuccess) bits |= 16;
    return bits;
  });
  EXPECT_EQ(failed, 0) << "bit mask of failed checks in the child";
  int count = 0;
  EXPECT_KILN_OK(kilnGetDeviceCount(&count));  // and the parent initialises normally
  EXPECT_EQ(count, 2);
}

TEST(Fork, ChildForkedBeforeInitialisationCanUseTheRuntime) {
  kiln_test::ExpectChildPasses("ChildFork.ForkBeforeInitialisationIsFine", {});
}
