// KilnFunctions.h — device management for the torch layer: count, current
// device, synchronization. Thin, checked wrappers over the runtime's C API.
//
// Thread-safety: all functions are thread-safe; the current device is
// per thread (as CUDA's), default kiln:0.
#pragma once

#include <c10/core/Device.h>

namespace c10::kiln {

// Number of kiln devices (KILN_DEVICE_COUNT, default 2). Never throws: if the
// runtime cannot start (for example KILN_DEVICE_COUNT is invalid) it warns
// once with the reason and returns 0, as PyTorch requires of deviceCount().
DeviceIndex device_count() noexcept;

// Like device_count(), but throws the runtime's initialisation error.
DeviceIndex device_count_ensure_non_zero();

// Throws c10::Error naming the index and the device count if `index` is not a
// valid kiln device index (0 <= index < device_count()).
void check_device_index(DeviceIndex index);

DeviceIndex current_device();
void set_device(DeviceIndex index);
// Sets `index` as current and returns the previous current device.
DeviceIndex exchange_device(DeviceIndex index);
// As exchange_device, but a negative or out-of-range index is a no-op that
// returns the current device.
DeviceIndex maybe_exchange_device(DeviceIndex index);

// Waits for all streams of device `index` (-1: current device); raises the
// first pending task error on them.
void device_synchronize(DeviceIndex index = -1);

// --- Sync debug mode (torch.kiln.set_sync_debug_mode; CUDA's
// c10::cuda::warning_state). See Note [Sync debug mode] in KilnFunctions.cc.
enum class SyncDebugMode : int { Default = 0, Warn = 1, Error = 2 };
void set_sync_debug_mode(SyncDebugMode mode);
SyncDebugMode get_sync_debug_mode();
// Whether the mode is "warn" or "error" (one relaxed load).
bool syncDebugModeIsOn();
// Called before an operation makes the host wait for the device: in "warn"
// mode warns, in "error" mode raises c10::Error, naming `what` (an ATen op
// name, or a call such as "torch.kiln.Stream.synchronize()").
void warn_or_error_on_sync(const char* what);

} // namespace c10::kiln
