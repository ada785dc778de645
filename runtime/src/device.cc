// device.cc — device selection, properties and device-wide waits.
//
// The current device is per host thread (as in CUDA), so a thread that calls
// kilnSetDevice(1) does not move the streams of another thread. Device-wide
// waits (kilnDeviceSynchronize, kilnFree) snapshot the device's stream list
// under Device::mu and wait on each stream without holding it, so streams can
// be created and destroyed while another thread waits.
//
// Note [Blocking calls inside tasks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A task runs on its stream's worker thread (or, in blocking mode, on the
// launching thread while the stream is busy with it). If the task calls
// something that waits for that stream — kilnStreamSynchronize of its own
// stream, kilnDeviceSynchronize of its device, kilnFree/kilnFreeHost (which
// wait for every device), a synchronous copy on its stream, or
// kilnEventSynchronize of a record queued behind it — the wait could never
// end. Such calls check t_running_stream and fail with kilnErrorNotPermitted
// instead of deadlocking. Launching, recording and querying from a task are
// fine.
#include <cstring>

#include "runtime_internal.h"

namespace kiln {

thread_local int t_current_device = 0;

kilnError_t CheckDevice(const Runtime& rt, int device) {
  if (device >= 0 && device < rt.device_count) return kilnSuccess;
  const Config& c = rt.config;
  if (c.visible_devices_set) {
    if (rt.device_count == 0)
      return Fail(kilnErrorInvalidDevice,
                  "kiln device %d does not exist: there are no kiln devices "
                  "(KILN_VISIBLE_DEVICES='%s' makes none of the %d visible)",
                  device, c.visible_devices_value.c_str(), c.physical_device_count);
    return Fail(kilnErrorInvalidDevice,
                "kiln device %d does not exist: valid devices are 0 to %d "
                "(KILN_VISIBLE_DEVICES='%s' makes %d of the %d visible)",
                device, rt.device_count - 1, c.visible_devices_value.c_str(), rt.device_count,
                c.physical_device_count);
  }
  if (rt.device_count == 0)
    return Fail(kilnErrorInvalidDevice,
                "kiln device %d does not exist: there are no kiln devices "
                "(KILN_DEVICE_COUNT=0)",
                device);
  return Fail(kilnErrorInvalidDevice,
              "kiln device %d does not exist: valid devices are 0 to %d (%d devices; set "
              "KILN_DEVICE_COUNT for more)",
              device, rt.device_count - 1, rt.device_count);
}

kilnError_t CurrentDevice(const Runtime& rt, int* device) {
  *device = t_current_device;
  return CheckDevice(rt, *device);
}

kilnError_t GetDefaultStream(Runtime& rt, int device, Stream** out) {
  Device& dev = rt.devices[device];
  Stream* s = dev.default_stream.load(std::memory_order_acquire);
  if (s != nullptr) {
    *out = s;
    return kilnSuccess;
  }
  std::lock_guard<std::mutex> lock(dev.mu);
  s = dev.default_stream.load(std::memory_order_relaxed);
  if (s == nullptr) {
    dev.streams.reserve(dev.streams.size() + 1);  // so the insert below cannot throw
    Stream* fresh = rt.stream_pool.Acquire();
    if (kilnError_t err = fresh->Activate(device, kStreamPriorityLowest, /*is_default=*/true,
                                          rt.config.launch_blocking)) {
      rt.stream_pool.Release(fresh);
      return err;
    }
    dev.streams.insert(dev.streams.begin(), fresh);
    dev.default_stream.store(fresh, std::memory_order_release);
    s = fresh;
  }
  *out = s;
  return kilnSuccess;
}

namespace {

std::vector<Stream*> SnapshotStreams(Device& dev) {
  std::lock_guard<std::mutex> lock(dev.mu);
  return dev.streams;
}

}  // namespace

void WaitDevice(Runtime& rt, int device) {
  for (Stream* s : SnapshotStreams(rt.devices[device])) s->WaitFor(s->submitted());
}

void WaitAllDevices(Runtime& rt) {
  for (int d = 0; d < rt.device_count; ++d) WaitDevice(rt, d);
}

bool WaitBeforeFree(Runtime& rt) {
  if (!g_unloading.load(std::memory_order_acquire)) {
    WaitAllDevices(rt);
    return true;
  }
  for (int d = 0; d < rt.device_count; ++d)
    for (Stream* s : SnapshotStreams(rt.devices[d]))
      if (!s->Idle()) return false;
  return true;
}

kilnError_t CheckNotInsideTaskOf(int device) {
  const Stream* s = t_running_stream;
  if (s == nullptr || (device >= 0 && s->device() != device)) return kilnSuccess;
  return Fail(kilnErrorNotPermitted,
              "called from inside a task running on a stream of kiln device %d; this call "
              "waits for that device's work, which includes the calling task itself, so it "
              "would never return (do it on the host thread after the task)",
              s->device());
}

}  // namespace kiln

using kiln::ApiCall;
using kiln::Fail;
using kiln::Runtime;

extern "C" {

KILN_API kilnError_t kilnGetDeviceCount(int* count) {
  return ApiCall("kilnGetDeviceCount", [&](Runtime& rt) {
    if (count == nullptr) return Fail(kilnErrorInvalidValue, "count is NULL");
    *count = rt.device_count;
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnGetDevice(int* device) {
  return ApiCall("kilnGetDevice", [&](Runtime& rt) {
    if (device == nullptr) return Fail(kilnErrorInvalidValue, "device is NULL");
    int d = 0;
    if (kilnError_t err = kiln::CurrentDevice(rt, &d)) return err;
    *device = d;
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnSetDevice(int device) {
  return ApiCall("kilnSetDevice", [&](Runtime& rt) {
    if (kilnError_t err = kiln::CheckDevice(rt, device)) return err;
    kiln::t_current_device = device;
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnGetDeviceProperties(kilnDeviceProp* prop, int device) {
  return ApiCall("kilnGetDeviceProperties", [&](Runtime& rt) {
    if (prop == nullptr) return Fail(kilnErrorInvalidValue, "prop is NULL");
    if (kilnError_t err = kiln::CheckDevice(rt, device)) return err;
    std::memset(prop, 0, sizeof *prop);
    std::strncpy(prop->name, "Kiln reference device", sizeof prop->name - 1);
    prop->totalGlobalMem = static_cast<size_t>(rt.devices[device].capacity);
    prop->multiProcessorCount = rt.host_cores;
    prop->streamPriorityLowest = kiln::kStreamPriorityLowest;
    prop->streamPriorityHighest = kiln::kStreamPriorityHighest;
    prop->pciBusID = rt.devices[device].physical_index;
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnDeviceSynchronize(void) {
  return ApiCall("kilnDeviceSynchronize", [&](Runtime& rt) {
    kiln::ApiActivity activity(rt, "kilnDeviceSynchronize");
    int d = 0;
    if (kilnError_t err = kiln::CurrentDevice(rt, &d)) return err;
    activity.SetDevice(d);
    if (kilnError_t err = kiln::CheckNotInsideTaskOf(d)) return err;
    if (kilnError_t err = kiln::RefuseIfDeviceCapturing(rt, d, "kilnDeviceSynchronize")) return err;
    const std::vector<kiln::Stream*> streams = kiln::SnapshotStreams(rt.devices[d]);
    for (kiln::Stream* s : streams)
      if (kilnError_t err = s->HostWaitFor(s->submitted())) return err;
    for (kiln::Stream* s : streams)
      if (kilnError_t err = s->TakeStickyError()) return err;
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  return ApiCall("kilnMemGetInfo", [&](Runtime& rt) {
    if (free_bytes == nullptr || total_bytes == nullptr)
      return Fail(kilnErrorInvalidValue, "free_bytes and total_bytes must not be NULL");
    int d = 0;
    if (kilnError_t err = kiln::CurrentDevice(rt, &d)) return err;
    const kiln::Device& dev = rt.devices[d];
    std::lock_guard<std::mutex> lock(rt.mem_mu);
    *free_bytes = static_cast<size_t>(dev.capacity - dev.used);
    *total_bytes = static_cast<size_t>(dev.capacity);
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnDeviceGetStreamPriorityRange(int* least, int* greatest) {
  return ApiCall("kilnDeviceGetStreamPriorityRange", [&](Runtime&) {
    // CUDA allows either pointer to be NULL here; so do we.
    if (least != nullptr) *least = kiln::kStreamPriorityLowest;
    if (greatest != nullptr) *greatest = kiln::kStreamPriorityHighest;
    return kilnSuccess;
  });
}

}  // extern "C"
