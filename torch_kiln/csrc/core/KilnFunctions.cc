// Device management and the single conversion point from runtime status codes
// to PyTorch exceptions (Note [Runtime errors become c10 errors]).
#include "core/KilnFunctions.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include <c10/util/Exception.h>

#include "core/DeviceWarnings.h"
#include "core/KilnException.h"

namespace c10::kiln {

namespace {

[[noreturn]] void throwWithClass(KernelErrorClass error_class, const std::string& message) {
  switch (error_class) {
    case KernelErrorClass::kIndexError:
      TORCH_CHECK_INDEX(false, message);
    case KernelErrorClass::kValueError:
      TORCH_CHECK_VALUE(false, message);
    case KernelErrorClass::kTypeError:
      TORCH_CHECK_TYPE(false, message);
    case KernelErrorClass::kNotImplementedError:
      TORCH_CHECK_NOT_IMPLEMENTED(false, message);
    case KernelErrorClass::kLinAlgError:
      TORCH_CHECK_LINALG(false, message);
    case KernelErrorClass::kOutOfMemoryError:
      TORCH_CHECK_WITH(OutOfMemoryError, false, message);
    case KernelErrorClass::kBufferError:
      TORCH_CHECK_WITH(BufferError, false, message);
    default:
      TORCH_CHECK(false, message);
  }
}

// The status name lets users search the runtime's documentation.
std::string wordedRuntimeError(const std::string& detail, kilnError_t error) {
  return "Kiln error: " + detail + " (" + kilnGetErrorName(error) + ")";
}

// Note [Ctrl-C during a host wait] (python/HostWaitInterrupts.cc).
std::atomic<HostWaitInterruptThrower> g_interrupt_thrower{nullptr};
std::atomic<InterruptTest> g_interrupt_test{nullptr};

} // namespace

void setHostWaitInterruptThrower(HostWaitInterruptThrower thrower) {
  g_interrupt_thrower.store(thrower, std::memory_order_release);
}

void setInterruptTest(InterruptTest test) {
  g_interrupt_test.store(test, std::memory_order_release);
}

bool isInterrupt(const std::exception& e) {
  const auto test = g_interrupt_test.load(std::memory_order_acquire);
  return test != nullptr && test(e);
}

void throwRuntimeError(kilnError_t error) {
  if (error == kilnErrorInterrupted) {
    if (const auto thrower = g_interrupt_thrower.load(std::memory_order_acquire)) {
      thrower(); // throws the pending KeyboardInterrupt, if this thread has one
    }
  }
  const char* detail = kilnGetLastErrorMessage();
  const std::string message = wordedRuntimeError(
      (detail && *detail) ? std::string(detail) : std::string(kilnGetErrorString(error)), error);
  switch (error) {
    case kilnErrorMemoryAllocation:
      TORCH_CHECK_WITH(OutOfMemoryError, false, message);
    case kilnErrorInvalidValue:
      TORCH_CHECK_VALUE(false, message);
    case kilnErrorLaunchFailure:
      // Note [Kernel errors keep their type]
      throwWithClass(static_cast<KernelErrorClass>(kilnGetLastErrorClass()), message);
    default:
      TORCH_CHECK(false, message);
  }
}

KernelErrorClass kernelErrorClassOf(const std::exception& e) noexcept {
  // Most derived classes first (none of these derives from another).
  if (dynamic_cast<const c10::IndexError*>(&e) != nullptr) {
    return KernelErrorClass::kIndexError;
  }
  if (dynamic_cast<const c10::ValueError*>(&e) != nullptr) {
    return KernelErrorClass::kValueError;
  }
  if (dynamic_cast<const c10::TypeError*>(&e) != nullptr) {
    return KernelErrorClass::kTypeError;
  }
  if (dynamic_cast<const c10::NotImplementedError*>(&e) != nullptr) {
    return KernelErrorClass::kNotImplementedError;
  }
  if (dynamic_cast<const c10::LinAlgError*>(&e) != nullptr) {
    return KernelErrorClass::kLinAlgError;
  }
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) {
    return KernelErrorClass::kOutOfMemoryError;
  }
  if (dynamic_cast<const c10::BufferError*>(&e) != nullptr) {
    return KernelErrorClass::kBufferError;
  }
  return KernelErrorClass::kError;
}

std::string kernelErrorMessageOf(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
    return error->what_without_backtrace();
  }
  return e.what();
}

void throwKernelFailure(const std::string& task_name, const std::string& task_message,
                        KernelErrorClass error_class) {
  // The runtime reports a task's failure as "<name>: <message>" (kilnLaunchTask
  // in runtime.h); throwRuntimeError words it the same way.
  throwWithClass(error_class,
                 wordedRuntimeError(task_name + ": " + task_message, kilnErrorLaunchFailure));
}

void warnRuntimeError(kilnError_t error, const char* expression) noexcept {
  try {
    const char* detail = kilnGetLastErrorMessage();
    TORCH_WARN(
        "Kiln error ignored in a context that cannot raise: ",
        (detail && *detail) ? detail : kilnGetErrorString(error),
        " [", kilnGetErrorName(error), " from ", expression, "]");
  } catch (...) {
  }
}

namespace {

// The runtime's count, or its initialisation error, computed once.
struct DeviceCountResult {
  kilnError_t status = kilnSuccess;
  int count = 0;
  std::string message;
};

const DeviceCountResult& deviceCountResult() {
  static const DeviceCountResult result = [] {
    DeviceCountResult r;
    r.status = kilnGetDeviceCount(&r.count);
    if (r.status != kilnSuccess) {
      r.message = kilnGetLastErrorMessage();
      r.count = 0;
    }
    return r;
  }();
  return result;
}

} // namespace

DeviceIndex device_count() noexcept {
  const auto& r = deviceCountResult();
  if (r.status != kilnSuccess) {
    static std::once_flag warned;
    std::call_once(warned, [&] {
      try {
        TORCH_WARN("Kiln devices are unavailable: ", r.message);
      } catch (...) {
      }
    });
  }
  return static_cast<DeviceIndex>(r.count);
}

DeviceIndex device_count_ensure_non_zero() {
  const auto& r = deviceCountResult();
  TORCH_CHECK(r.status == kilnSuccess, "Kiln devices are unavailable: ", r.message);
  if (r.count == 0) {
    const char* visible = std::getenv("KILN_VISIBLE_DEVICES");
    TORCH_CHECK(visible == nullptr, "No kiln devices: KILN_VISIBLE_DEVICES='", visible,
                "' makes none of the KILN_DEVICE_COUNT devices visible. Set it to a "
                "comma-separated list of device indices, or unset it for all of them.");
    TORCH_CHECK(false,
                "No kiln devices: KILN_DEVICE_COUNT is 0. Set KILN_DEVICE_COUNT to a "
                "positive number of devices (default 2).");
  }
  return static_cast<DeviceIndex>(r.count);
}

void check_device_index(DeviceIndex index) {
  const DeviceIndex count = device_count_ensure_non_zero();
  TORCH_CHECK(
      index >= 0 && index < count,
      "Invalid device kiln:", static_cast<int>(index), ": Kiln has ",
      static_cast<int>(count), count == 1 ? " device (kiln:0)" : " devices (kiln:0 to kiln:",
      count == 1 ? "" : std::to_string(count - 1), count == 1 ? "" : ")",
      ". Use an index in that range, or set KILN_DEVICE_COUNT to change the number of devices",
      std::getenv("KILN_VISIBLE_DEVICES") == nullptr ? "" : " (and KILN_VISIBLE_DEVICES which are visible)",
      ".");
}

DeviceIndex current_device() {
  int device = 0;
  KILN_CHECK(kilnGetDevice(&device));
  return static_cast<DeviceIndex>(device);
}

void set_device(DeviceIndex index) {
  check_device_index(index);
  KILN_CHECK(kilnSetDevice(index));
}

DeviceIndex exchange_device(DeviceIndex index) {
  const DeviceIndex previous = current_device();
  if (index != previous) {
    set_device(index);
  }
  return previous;
}

DeviceIndex maybe_exchange_device(DeviceIndex index) {
  const DeviceIndex previous = current_device();
  if (index < 0 || index >= device_count() || index == previous) {
    return previous;
  }
  KILN_CHECK(kilnSetDevice(index));
  return previous;
}

void device_synchronize(DeviceIndex index) {
  if (index < 0) {
    const kilnError_t status = kilnDeviceSynchronize();
    flushDeviceWarnings();
    KILN_CHECK(status);
    return;
  }
  check_device_index(index);
  const DeviceIndex previous = exchange_device(index);
  const kilnError_t status = kilnDeviceSynchronize();
  KILN_WARN(kilnSetDevice(previous));
  flushDeviceWarnings();
  KILN_CHECK(status);
}

// Note [Sync debug mode]
// ~~~~~~~~~~~~~~~~~~~~~~
// torch.kiln.set_sync_debug_mode("warn" | "error") is CUDA's sync debug mode:
// an operation that makes the host wait for the device warns or raises, on
// the calling thread and before it waits, so the Python traceback points at
// the user's line. Kiln names the operation (CUDA only says "called a
// synchronizing CUDA operation"). What counts is what get_sync_ops() counts
// (host reads: item(), nonzero, printing, blocking copies to the host and
// from pageable memory, sparse compute) plus torch.kiln.Stream.synchronize(),
// which CUDA's mode covers too; explicit device-wide waits
// (torch.kiln.synchronize(), Event.synchronize()) are not, as on CUDA. Kiln's
// one-time layout checks (Note [Verifying meta kernels]) are not either: they
// are an implementation detail no program can avoid, and an "error" mode
// that refused them would refuse every program. The mode is process-wide,
// as CUDA's.

namespace {
std::atomic<int> g_sync_debug_mode{0};
} // namespace

void set_sync_debug_mode(SyncDebugMode mode) {
  g_sync_debug_mode.store(static_cast<int>(mode), std::memory_order_relaxed);
}

SyncDebugMode get_sync_debug_mode() {
  return static_cast<SyncDebugMode>(g_sync_debug_mode.load(std::memory_order_relaxed));
}

bool syncDebugModeIsOn() {
  return g_sync_debug_mode.load(std::memory_order_relaxed) != 0;
}

void warn_or_error_on_sync(const char* what) {
  const int mode = g_sync_debug_mode.load(std::memory_order_relaxed);
  if (C10_LIKELY(mode == static_cast<int>(SyncDebugMode::Default))) {
    return;
  }
  TORCH_CHECK(mode != static_cast<int>(SyncDebugMode::Error),
              "called a synchronizing kiln operation: ", what,
              " makes the host wait for the device, and torch.kiln.set_sync_debug_mode(\"error\") "
              "forbids that. Avoid the synchronization (keep the value on the device, use "
              "non_blocking=True copies to pinned memory), or allow it with "
              "torch.kiln.set_sync_debug_mode(\"default\").");
  TORCH_WARN("called a synchronizing kiln operation: ", what,
             " makes the host wait for the device (torch.kiln.set_sync_debug_mode(\"warn\")).");
}

} // namespace c10::kiln
