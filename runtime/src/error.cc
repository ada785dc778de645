// error.cc — error names, descriptions and the per-thread last error message.
//
// Why per thread: several host threads drive streams concurrently (DataLoader
// workers pinning memory, the main thread launching ops); a global "last
// error" would hand one thread another thread's message. As in CUDA the
// message belongs to the thread that made the failing call, and it is only
// replaced by that thread's next failing call.
//
// Why Fail() cannot throw: it runs on error paths inside noexcept API
// functions and on worker threads. If the message cannot be stored (out of
// host memory) the status code is still returned; the message is just lost.
#include <cstdarg>
#include <cstdio>
#include <exception>
#include <new>

#include "runtime_internal.h"

namespace kiln {

thread_local const char* t_api = "kiln";

namespace {

thread_local std::string t_last_error;
thread_local int t_last_error_class = 0;

std::string VFormat(const char* fmt, va_list args) {
  va_list copy;
  va_copy(copy, args);
  char small[256];
  const int n = std::vsnprintf(small, sizeof small, fmt, copy);
  va_end(copy);
  if (n < 0) return fmt;
  if (static_cast<size_t>(n) < sizeof small) return std::string(small, static_cast<size_t>(n));
  std::string out(static_cast<size_t>(n) + 1, '\0');
  std::vsnprintf(out.data(), out.size(), fmt, args);
  out.resize(static_cast<size_t>(n));
  return out;
}

void SetLastError(std::string message, int error_class = 0) noexcept {
  t_last_error.swap(message);
  t_last_error_class = error_class;
}

}  // namespace

std::string StrFormat(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::string s = VFormat(fmt, args);
  va_end(args);
  return s;
}

kilnError_t Fail(kilnError_t code, const char* fmt, ...) {
  t_last_error_class = 0;
  try {
    va_list args;
    va_start(args, fmt);
    std::string text = VFormat(fmt, args);
    va_end(args);
    std::string message = t_api;
    message += ": ";
    message += text;
    SetLastError(std::move(message));
  } catch (...) {
    // Out of host memory while describing an error: keep the code.
  }
  return code;
}

kilnError_t FailVerbatim(kilnError_t code, const std::string& message, int error_class) {
  try {
    SetLastError(message, error_class);
  } catch (...) {
    t_last_error_class = error_class;
  }
  return code;
}

kilnError_t FailFromException() {
  try {
    throw;
  } catch (const std::bad_alloc&) {
    return Fail(kilnErrorMemoryAllocation,
                "the host ran out of memory for the runtime's own bookkeeping");
  } catch (const std::exception& e) {
    return Fail(kilnErrorUnknown, "internal error: %s", e.what());
  } catch (...) {
    return Fail(kilnErrorUnknown, "internal error: unknown exception");
  }
}

kilnError_t FailForkedChild() {
  return Fail(kilnErrorInitializationError,
              "the kiln runtime cannot be used in a child process forked after it was "
              "initialised (the parent's device threads do not exist in the child); start "
              "worker processes with the 'spawn' start method instead, e.g. "
              "multiprocessing.set_start_method('spawn') or "
              "DataLoader(multiprocessing_context='spawn')");
}

std::string FormatBytes(uint64_t bytes) {
  static const char* const kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return StrFormat("%llu bytes", static_cast<unsigned long long>(bytes));
  double value = static_cast<double>(bytes) / 1024.0;
  int unit = 0;
  while (value >= 1024.0 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  return StrFormat("%llu bytes (%.2f %s)", static_cast<unsigned long long>(bytes), value,
                   kUnits[unit]);
}

}  // namespace kiln

extern "C" {

KILN_API const char* kilnGetErrorName(kilnError_t error) {
  switch (error) {
    case kilnSuccess: return "kilnSuccess";
    case kilnErrorInvalidValue: return "kilnErrorInvalidValue";
    case kilnErrorMemoryAllocation: return "kilnErrorMemoryAllocation";
    case kilnErrorInitializationError: return "kilnErrorInitializationError";
    case kilnErrorRuntimeUnloading: return "kilnErrorRuntimeUnloading";
    case kilnErrorInterrupted: return "kilnErrorInterrupted";
    case kilnErrorInvalidDevicePointer: return "kilnErrorInvalidDevicePointer";
    case kilnErrorInvalidDevice: return "kilnErrorInvalidDevice";
    case kilnErrorInvalidResourceHandle: return "kilnErrorInvalidResourceHandle";
    case kilnErrorNotReady: return "kilnErrorNotReady";
    case kilnErrorLaunchFailure: return "kilnErrorLaunchFailure";
    case kilnErrorNotPermitted: return "kilnErrorNotPermitted";
    case kilnErrorIllegalState: return "kilnErrorIllegalState";
    case kilnErrorStreamCaptureUnsupported: return "kilnErrorStreamCaptureUnsupported";
    case kilnErrorStreamCaptureInvalidated: return "kilnErrorStreamCaptureInvalidated";
    case kilnErrorStreamCaptureMerge: return "kilnErrorStreamCaptureMerge";
    case kilnErrorStreamCaptureUnmatched: return "kilnErrorStreamCaptureUnmatched";
    case kilnErrorStreamCaptureUnjoined: return "kilnErrorStreamCaptureUnjoined";
    case kilnErrorStreamCaptureImplicit: return "kilnErrorStreamCaptureImplicit";
    case kilnErrorCapturedEvent: return "kilnErrorCapturedEvent";
    case kilnErrorUnknown: return "kilnErrorUnknown";
  }
  return "kilnErrorUnrecognized";
}

KILN_API const char* kilnGetErrorString(kilnError_t error) {
  switch (error) {
    case kilnSuccess: return "no error";
    case kilnErrorInvalidValue: return "invalid argument";
    case kilnErrorMemoryAllocation: return "out of memory";
    case kilnErrorInitializationError: return "initialization error";
    case kilnErrorRuntimeUnloading: return "the runtime is shutting down";
    case kilnErrorInterrupted: return "host wait interrupted";
    case kilnErrorInvalidDevicePointer: return "invalid device pointer";
    case kilnErrorInvalidDevice: return "invalid device ordinal";
    case kilnErrorInvalidResourceHandle: return "invalid resource handle";
    case kilnErrorNotReady: return "device not ready";
    case kilnErrorLaunchFailure: return "unspecified launch failure";
    case kilnErrorNotPermitted: return "operation not permitted";
    case kilnErrorIllegalState: return "the operation cannot be performed in the present state";
    case kilnErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case kilnErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case kilnErrorStreamCaptureMerge: return "operation would result in a merge of separate capture sequences";
    case kilnErrorStreamCaptureUnmatched: return "capture was not ended in the same stream as it began";
    case kilnErrorStreamCaptureUnjoined: return "capturing stream has unjoined work";
    case kilnErrorStreamCaptureImplicit: return "operation would make the default stream depend on a capturing stream";
    case kilnErrorCapturedEvent: return "operation not permitted on an event last recorded in a capturing stream";
    case kilnErrorUnknown: return "unknown error";
  }
  return "unrecognized error code";
}

KILN_API const char* kilnGetLastErrorMessage(void) { return kiln::t_last_error.c_str(); }

KILN_API int kilnGetLastErrorClass(void) { return kiln::t_last_error_class; }

}  // extern "C"
