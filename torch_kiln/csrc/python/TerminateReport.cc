// TerminateReport.cc — see TerminateReport.h.
//
// Note [Reporting std::terminate]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// When C++ code on one of Kiln's threads (a stream worker "kiln-stream", kccl's
// completion thread "kccl-complete") or any other thread calls std::terminate —
// an exception escaping a noexcept function, a forced unwind (pthread_exit, as
// CPython does to a thread that takes the GIL during interpreter finalization)
// crossing a destructor, a joinable std::thread destroyed — libstdc++ prints
// only "terminate called without an active exception" and aborts; Python's
// faulthandler then shows no frame, because the thread runs no Python. That
// says nothing about where. Kiln's handler first writes, to stderr with
// async-signal-tolerant write(2) calls, the thread's name and id and the C++
// backtrace (c10::get_backtrace, symbolized where the binary has symbols),
// then hands over to the previous handler, which prints the active exception
// (if any) and aborts. The process still ends exactly as before.
#include "python/TerminateReport.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <exception>
#include <string>

#include <c10/util/Backtrace.h>

namespace torch_kiln {
namespace {

std::terminate_handler g_previous = nullptr;
std::atomic<bool> g_reporting{false};

void writeAll(const std::string& text) {
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0) {
    const ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n <= 0) {
      return;
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
}

[[noreturn]] void reportTerminate() {
  if (!g_reporting.exchange(true)) { // a second terminate while reporting: skip to the end
    char name[32] = "?";
    (void)pthread_getname_np(pthread_self(), name, sizeof(name));
    std::string text = "torch_kiln: std::terminate called on thread '" + std::string(name) +
        "' (tid " + std::to_string(static_cast<long>(::syscall(SYS_gettid))) + ")";
    text += std::current_exception() ? " with an active exception (below)\n"
                                     : " without an active exception\n";
    try {
      text += "C++ backtrace:\n" + c10::get_backtrace(/*frames_to_skip=*/1);
    } catch (...) {
      text += "(no backtrace: building it failed)\n";
    }
    writeAll(text);
  }
  if (g_previous != nullptr) {
    g_previous();
  }
  std::abort();
}

} // namespace

void installTerminateReport() {
  static const bool installed = [] {
    g_previous = std::set_terminate(reportTerminate);
    return true;
  }();
  (void)installed;
}

} // namespace torch_kiln
