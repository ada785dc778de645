// KilnException.h — turning runtime status codes into PyTorch errors.
//
// See Note [Runtime errors become c10 errors].
#pragma once

#include <c10/util/Exception.h>
#include <kiln/runtime.h>

namespace c10::kiln {

// Note [Runtime errors become c10 errors]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The runtime (runtime/include/kiln/runtime.h) never throws: every call returns
// a kilnError_t, and kilnGetLastErrorMessage() describes the failure. The torch
// layer converts a failing status into an exception in exactly one place,
// KILN_CHECK, so every runtime failure reaches Python the same way:
//   - kilnErrorMemoryAllocation  -> c10::OutOfMemoryError (torch.OutOfMemoryError)
//   - kilnErrorInvalidValue      -> c10::ValueError (ValueError)
//   - kilnErrorInterrupted       -> the exception the host-wait interrupt
//                                   handler throws (Python's KeyboardInterrupt;
//                                   see Note [Ctrl-C during a host wait])
//   - everything else            -> c10::Error (RuntimeError)
// The message is the runtime's own sentence (what was asked, what is allowed),
// prefixed by "Kiln error: " and followed by the status name. Code that must not throw (PyTorch's noexcept
// contracts, destructors) uses KILN_WARN instead.
[[noreturn]] void throwRuntimeError(kilnError_t error);

// Throws the exception that made the calling thread abandon a host wait (a
// kilnErrorInterrupted), if it has one; returns otherwise. Installed by the
// Python bindings (python/HostWaitInterrupts.cc), which keep that exception;
// the core layer includes no Python.
using HostWaitInterruptThrower = void (*)();
void setHostWaitInterruptThrower(HostWaitInterruptThrower thrower);

// Whether `e` is an interrupt of the program (Python's KeyboardInterrupt or
// SystemExit raised inside a kernel written in Python, e.g. a Python meta
// kernel that ran a signal handler) that a fallback must not swallow. The
// Python bindings install the test; without them, false.
using InterruptTest = bool (*)(const std::exception& e);
void setInterruptTest(InterruptTest test);
bool isInterrupt(const std::exception& e);

// Warns (once per call site is not guaranteed; it warns each time) instead of
// throwing; for destructors and noexcept paths.
void warnRuntimeError(kilnError_t error, const char* expression) noexcept;

} // namespace c10::kiln

#define KILN_CHECK(EXPR)                                      \
  do {                                                        \
    const kilnError_t kiln_check_status_ = (EXPR);            \
    if (C10_UNLIKELY(kiln_check_status_ != kilnSuccess)) {    \
      ::c10::kiln::throwRuntimeError(kiln_check_status_);        \
    }                                                         \
  } while (0)

#define KILN_WARN(EXPR)                                       \
  do {                                                        \
    const kilnError_t kiln_warn_status_ = (EXPR);             \
    if (C10_UNLIKELY(kiln_warn_status_ != kilnSuccess)) {     \
      ::c10::kiln::warnRuntimeError(kiln_warn_status_, #EXPR); \
    }                                                         \
  } while (0)
