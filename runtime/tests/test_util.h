// test_util.h — helpers for the runtime conformance tests.
//
// The tests use only the public C API (<kiln/runtime.h>); these helpers just
// make it pleasant from C++: status assertions that print the runtime's
// message, launching lambdas as tasks, gates that hold a stream at a known
// point (instead of sleeping), and running a test in a child process with a
// different environment.
#ifndef KILN_RUNTIME_TESTS_TEST_UTIL_H_
#define KILN_RUNTIME_TESTS_TEST_UTIL_H_

#include <gtest/gtest.h>
#include <kiln/runtime.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace kiln_test {

// Formats a status for assertion messages: "kilnErrorX: <last message>".
std::string Describe(kilnError_t err);

// Predicate formatter behind the status assertions below.
testing::AssertionResult StatusIs(const char* expr_text, const char* expected_text, kilnError_t actual,
                                  kilnError_t expected);

}  // namespace kiln_test

// Status assertions. On failure they print the code's name and the runtime's
// last error message; like gtest's own assertions they accept `<< "context"`.
#define ASSERT_KILN_OK(expr) ASSERT_PRED_FORMAT2(kiln_test::StatusIs, expr, kilnSuccess)
#define EXPECT_KILN_OK(expr) EXPECT_PRED_FORMAT2(kiln_test::StatusIs, expr, kilnSuccess)
#define EXPECT_KILN_ERR(expr, code) EXPECT_PRED_FORMAT2(kiln_test::StatusIs, expr, code)

namespace kiln_test {

// The last error message of this thread, as a std::string.
inline std::string LastMessage() { return kilnGetLastErrorMessage(); }

// Launches a C++ callable as a task. It may return void (success) or
// kilnError_t. The callable is destroyed by the task's release function.
template <class F>
kilnError_t Launch(kilnStream_t stream, F&& f, const char* name = "test task") {
  using Fn = std::decay_t<F>;
  auto* box = new Fn(std::forward<F>(f));
  kilnTaskFn_t run = [](void* user) -> kilnError_t {
    Fn& fn = *static_cast<Fn*>(user);
    if constexpr (std::is_void_v<decltype(fn())>) {
      fn();
      return kilnSuccess;
    } else {
      return fn();
    }
  };
  kilnTaskReleaseFn_t release = [](void* user) { delete static_cast<Fn*>(user); };
  return kilnLaunchTask(stream, run, release, box, name);
}

// A gate holds a stream at a known point: a task launched with LaunchGate
// blocks until Open(). Shared ownership keeps it alive for the task even if
// the test fails early; GateGuard opens it on scope exit so no worker stays
// blocked after a failed assertion.
class Gate {
 public:
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};
using GatePtr = std::shared_ptr<Gate>;

inline GatePtr MakeGate() { return std::make_shared<Gate>(); }
inline kilnError_t LaunchGate(kilnStream_t stream, const GatePtr& gate) {
  return Launch(stream, [gate] { gate->Wait(); }, "gate");
}

struct GateGuard {
  GatePtr gate;
  ~GateGuard() { gate->Open(); }
};

// --- Child processes --------------------------------------------------------
//
// The runtime reads its environment once, at the first call, so a test that
// needs KILN_DEVICE_COUNT=0 (or any other setting) must run in a fresh
// process. A test suite whose name starts with "Child" is such a body: the
// test binary's main() hides those suites unless KILN_TEST_CHILD=1 is set, and
// a parent test runs one of them with RunChild/ExpectChildPasses, which
// re-execute this binary (posix_spawn of /proc/self/exe) with
// --gtest_filter=<that one test> and the requested environment.

// name → value; std::nullopt unsets the variable in the child.
using EnvOverrides = std::vector<std::pair<std::string, std::optional<std::string>>>;

struct ChildResult {
  int exit_code = -1;  // exit status, or 128 + signal number
  std::string output;  // stdout and stderr, interleaved
};

// Path of the running test binary (set by main()).
void SetSelfExecutable(const std::string& path);

ChildResult RunChild(const std::string& test_name, const EnvOverrides& env);

// Runs `test_name` (e.g. "ChildEnv.DeviceCount") in a child and expects that
// exactly one test ran and passed.
void ExpectChildPasses(const std::string& test_name, const EnvOverrides& env);

// A value of this process's environment inside a child test, for parameters
// the parent passes down (KILN_TEST_*). Fails the test if it is missing.
std::string ChildParam(const char* name);

// True when built with AddressSanitizer or ThreadSanitizer.
bool UnderSanitizer();

}  // namespace kiln_test

#endif  // KILN_RUNTIME_TESTS_TEST_UTIL_H_
