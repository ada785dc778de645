// KilnException.h — turning runtime status codes into PyTorch errors.
//
// See Note [Runtime errors become c10 errors].
#pragma once

#include <exception>
#include <string>

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
//   - kilnErrorLaunchFailure     -> the class of the kernel's own exception,
//                                   see Note [Kernel errors keep their type]
//   - everything else            -> c10::Error (RuntimeError)
// The message is the runtime's own sentence (what was asked, what is allowed),
// prefixed by "Kiln error: " and followed by the status name. Code that must
// not throw (PyTorch's noexcept contracts, destructors) uses KILN_WARN instead.
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

// Note [Kernel errors keep their type]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A kernel that fails on a stream worker raises a c10 exception of some class
// (c10::IndexError for an index out of range, c10::NotImplementedError for a
// dtype its dispatch does not cover, ...), which PyTorch's bindings turn into
// the matching Python type. The failure surfaces later, on another thread, as
// a runtime status (Note [Sticky stream errors] in runtime/src/stream.cc), so
// the task records the class as the runtime's *error class* of its failure
// (kilnTaskSetErrorClass, a number the runtime only carries), and the call
// that reports the failure re-raises that class: the same bad index raises
// IndexError whether the kernel ran at once (a first call's layout check,
// KILN_LAUNCH_BLOCKING=1) or asynchronously, with the same message, "Kiln
// error: <op>: inputs (<dtypes and shapes>): <the kernel's message>
// (kilnErrorLaunchFailure)". A kernel run synchronously in place of an
// asynchronous launch raises its error through throwKernelFailure for that
// reason (KilnOpExecutor.cc). Errors the executor raises at the call before
// any kernel ran (the meta kernel's checks) are CPU's own, unchanged.
enum class KernelErrorClass : int {
  kError = 0, // c10::Error and anything else: RuntimeError
  kIndexError = 1,
  kValueError = 2,
  kTypeError = 3,
  kNotImplementedError = 4,
  kLinAlgError = 5,
  kOutOfMemoryError = 6,
  kBufferError = 7,
};

// The class of a kernel's exception.
KernelErrorClass kernelErrorClassOf(const std::exception& e) noexcept;

// The message of a kernel's exception, without C++ backtrace.
std::string kernelErrorMessageOf(const std::exception& e);

// Raises what a failed task `task_name` reports at synchronization: the
// runtime's message "<task_name>: <task_message>" as throwRuntimeError words
// it, with the exception class `error_class`.
[[noreturn]] void throwKernelFailure(const std::string& task_name,
                                     const std::string& task_message,
                                     KernelErrorClass error_class);

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
