// test_util.cc — child-process plumbing for the conformance tests.
//
// Why posix_spawn of our own binary rather than fork(): the runtime refuses
// to work in a child forked after initialisation (by design, see the fork
// tests), and the environment is read once per process. A freshly exec'd
// process is exactly what a user gets when they set a variable and start
// Python, so that is what the environment tests use.
#include "test_util.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

extern char** environ;

namespace kiln_test {
namespace {

std::string& SelfExecutable() {
  static std::string path;
  return path;
}

}  // namespace

std::string Describe(kilnError_t err) {
  return std::string(kilnGetErrorName(err)) + ": " + kilnGetLastErrorMessage();
}

testing::AssertionResult StatusIs(const char* expr_text, const char* expected_text, kilnError_t actual,
                                  kilnError_t expected) {
  if (actual == expected) return testing::AssertionSuccess();
  return testing::AssertionFailure() << expr_text << " returned " << kilnGetErrorName(actual)
                                     << ", expected " << kilnGetErrorName(expected)
                                     << "\n  last error message: " << kilnGetLastErrorMessage();
}

void SetSelfExecutable(const std::string& path) { SelfExecutable() = path; }

ChildResult RunChild(const std::string& test_name, const EnvOverrides& env) {
  ChildResult result;
  std::vector<std::string> vars;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const std::string name = kv.substr(0, kv.find('='));
    bool replaced = name == "KILN_TEST_CHILD";
    for (const auto& o : env) replaced = replaced || o.first == name;
    if (!replaced) vars.push_back(kv);
  }
  for (const auto& o : env)
    if (o.second) vars.push_back(o.first + "=" + *o.second);
  vars.push_back("KILN_TEST_CHILD=1");

  const std::string exe = SelfExecutable();
  const std::string filter = "--gtest_filter=" + test_name;
  std::vector<char*> argv = {const_cast<char*>(exe.c_str()), const_cast<char*>(filter.c_str()),
                             nullptr};
  std::vector<char*> envp;
  for (auto& v : vars) envp.push_back(v.data());
  envp.push_back(nullptr);

  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) {
    result.output = "pipe() failed";
    return result;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDERR_FILENO);
  posix_spawn_file_actions_addclose(&actions, pipe_fds[0]);
  posix_spawn_file_actions_addclose(&actions, pipe_fds[1]);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(pipe_fds[1]);
  if (rc != 0) {
    close(pipe_fds[0]);
    result.output = "posix_spawn(" + exe + ") failed: " + std::strerror(rc);
    return result;
  }
  char buffer[4096];
  for (;;) {
    const ssize_t n = read(pipe_fds[0], buffer, sizeof buffer);
    if (n > 0) {
      result.output.append(buffer, static_cast<size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  close(pipe_fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  else if (WIFSIGNALED(status)) result.exit_code = 128 + WTERMSIG(status);
  return result;
}

void ExpectChildPasses(const std::string& test_name, const EnvOverrides& env) {
  const ChildResult r = RunChild(test_name, env);
  EXPECT_EQ(r.exit_code, 0) << "child test " << test_name << " failed:\n" << r.output;
  EXPECT_NE(r.output.find("[  PASSED  ] 1 test."), std::string::npos)
      << "child test " << test_name << " did not run exactly one test:\n" << r.output;
}

std::string ChildParam(const char* name) {
  const char* v = std::getenv(name);
  EXPECT_NE(v, nullptr) << name << " must be set by the parent test";
  return v != nullptr ? v : "";
}

bool UnderSanitizer() {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
  return true;
#else
  return false;
#endif
#else
  return false;
#endif
}

}  // namespace kiln_test
