// Stream ids, pools and the per-thread current stream.
#include "core/KilnStream.h"

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include <c10/util/Exception.h>

#include "core/DeviceWarnings.h"
#include "core/KilnException.h"
#include "core/KilnFunctions.h"

namespace c10::kiln {

// Note [Kiln stream ids]
// ~~~~~~~~~~~~~~~~~~~~~~
// A c10::Stream carries (device, id). Kiln numbers a device's streams densely:
//   id 0                               the device's default stream
//   id 1 + level * kStreamsPerPool + i pool stream i of priority level `level`
//                                      (level 0: priority 0, level 1: -1)
// Pool streams are created in the runtime on first use and never destroyed,
// so a stream id stays meaningful for the life of the process and can be
// packed into a Python object and back. Unlike CUDA, a device has few streams
// because each runtime stream owns a worker thread.
//
// External streams (torch.kiln.ExternalStream) are runtime streams created
// outside the torch layer. As in CUDA (c10/cuda/CUDAStream.cpp, StreamIdType
// EXT), their id is the runtime handle itself: ids from kMinExternalStreamId
// up, which neither the dense ids above nor any valid handle overlap. Nothing
// is registered for them, so handling one costs nothing on the launch path;
// the runtime validates the handle on every call, so a stream destroyed by its
// owner fails cleanly ("stream ... has been destroyed"), never crashes.

namespace {

constexpr int kStreamsPerDevice = 1 + kStreamPriorityLevels * kStreamsPerPool;
constexpr int kMaxDevices = 64;

struct DeviceStreams {
  std::mutex mutex; // guards creation of handles
  std::array<std::atomic<kilnStream_t>, kStreamsPerDevice> handles{};
  std::array<std::atomic<uint32_t>, kStreamPriorityLevels> next_in_pool{};
};

DeviceStreams& deviceStreams(DeviceIndex device) {
  // Leaked on purpose: streams outlive every static destructor.
  static DeviceStreams* all = new DeviceStreams[kMaxDevices];
  return all[device];
}

// Per thread, per device: the id of the current stream (0 = default).
thread_local std::array<StreamId, kMaxDevices> current_stream_ids{};

DeviceIndex resolveDevice(DeviceIndex device) {
  if (device < 0) {
    return current_device();
  }
  check_device_index(device);
  return device;
}

int levelOfPriority(int priority) {
  return priority < 0 ? 1 : 0;
}

int priorityOfId(StreamId id) {
  if (id == 0) {
    return 0;
  }
  return ((id - 1) / kStreamsPerPool) == 0 ? 0 : -1;
}

kilnStream_t createHandle(DeviceIndex device, StreamId id) {
  if (id == 0) {
    kilnStream_t handle = nullptr;
    KILN_CHECK(kilnStreamGetDefault(&handle, device));
    return handle;
  }
  const DeviceIndex previous = exchange_device(device);
  kilnStream_t handle = nullptr;
  const kilnError_t status =
      kilnStreamCreateWithPriority(&handle, 0, priorityOfId(id));
  KILN_WARN(kilnSetDevice(previous));
  KILN_CHECK(status);
  return handle;
}

} // namespace

KilnStream::KilnStream(Stream stream) : stream_(stream) {
  TORCH_CHECK(
      stream_.device_type() == DeviceType::PrivateUse1,
      "Expected a kiln stream, got a stream on ", stream_.device());
  TORCH_CHECK(
      (stream_.id() >= 0 && stream_.id() < kStreamsPerDevice) ||
          stream_.id() >= kMinExternalStreamId,
      "Invalid kiln stream id ", stream_.id(), " (allowed 0 to ",
      kStreamsPerDevice - 1, ", or the id of a torch.kiln.ExternalStream)");
}

kilnStream_t KilnStream::stream() const {
  if (C10_UNLIKELY(is_external())) {
    return reinterpret_cast<kilnStream_t>(static_cast<intptr_t>(id()));
  }
  auto& streams = deviceStreams(device_index());
  auto& slot = streams.handles[static_cast<size_t>(id())];
  kilnStream_t handle = slot.load(std::memory_order_acquire);
  if (C10_LIKELY(handle != nullptr)) {
    return handle;
  }
  std::lock_guard<std::mutex> lock(streams.mutex);
  handle = slot.load(std::memory_order_acquire);
  if (handle == nullptr) {
    handle = createHandle(device_index(), id());
    slot.store(handle, std::memory_order_release);
  }
  return handle;
}

int KilnStream::priority() const {
  if (is_external()) {
    int priority = 0;
    KILN_CHECK(kilnStreamGetPriority(stream(), &priority));
    return priority;
  }
  return priorityOfId(id());
}

bool KilnStream::query() const {
  const kilnError_t status = kilnStreamQuery(stream());
  if (status == kilnErrorNotReady) {
    return false;
  }
  KILN_CHECK(status);
  return true;
}

void KilnStream::synchronize() const {
  const kilnError_t status = kilnStreamSynchronize(stream());
  flushDeviceWarnings();
  KILN_CHECK(status);
}

std::pair<int, int> KilnStream::priority_range() {
  return {0, -1};
}

KilnStream getDefaultKilnStream(DeviceIndex device) {
  device = resolveDevice(device);
  return KilnStream(Stream(Stream::UNSAFE, Device(DeviceType::PrivateUse1, device), 0));
}

KilnStream getCurrentKilnStream(DeviceIndex device) {
  device = resolveDevice(device);
  return KilnStream(Stream(
      Stream::UNSAFE, Device(DeviceType::PrivateUse1, device),
      current_stream_ids[static_cast<size_t>(device)]));
}

void setCurrentKilnStream(KilnStream stream) {
  check_device_index(stream.device_index());
  current_stream_ids[static_cast<size_t>(stream.device_index())] = stream.id();
}

KilnStream getStreamFromPool(int priority, DeviceIndex device) {
  device = resolveDevice(device);
  const int level = levelOfPriority(priority);
  auto& streams = deviceStreams(device);
  const uint32_t index =
      streams.next_in_pool[static_cast<size_t>(level)].fetch_add(1) % kStreamsPerPool;
  const StreamId id = 1 + level * kStreamsPerPool + static_cast<StreamId>(index);
  return KilnStream(Stream(Stream::UNSAFE, Device(DeviceType::PrivateUse1, device), id));
}

KilnStream getStreamFromExternal(kilnStream_t handle, DeviceIndex device) {
  int stream_device = -1;
  const kilnError_t status = kilnStreamGetDevice(handle, &stream_device);
  TORCH_CHECK_VALUE(
      status == kilnSuccess, "torch.kiln.ExternalStream: ", static_cast<const void*>(handle),
      " is not a live kiln runtime stream (", kilnGetLastErrorMessage(),
      "). Pass a kilnStream_t from kilnStreamCreate or kilnStreamGetDefault, or another "
      "stream's .kiln_stream, and keep that stream alive while it is used.");
  if (device >= 0) {
    check_device_index(device);
    TORCH_CHECK_VALUE(
        device == stream_device, "torch.kiln.ExternalStream: stream ",
        static_cast<const void*>(handle), " belongs to kiln:", stream_device, ", not kiln:",
        static_cast<int>(device), ". Pass device=", stream_device, " or leave device unset.");
  }
  const auto d = static_cast<DeviceIndex>(stream_device);
  const Device kiln_device(DeviceType::PrivateUse1, d);
  // The torch layer's own streams keep their ids, so the wrapper equals them.
  if (handle == nullptr || handle == getDefaultKilnStream(d).stream()) {
    return KilnStream(Stream(Stream::UNSAFE, kiln_device, 0));
  }
  auto& streams = deviceStreams(d);
  for (int id = 1; id < kStreamsPerDevice; ++id) {
    if (streams.handles[static_cast<size_t>(id)].load(std::memory_order_acquire) == handle) {
      return KilnStream(Stream(Stream::UNSAFE, kiln_device, id));
    }
  }
  const auto id = static_cast<StreamId>(reinterpret_cast<intptr_t>(handle));
  TORCH_CHECK_VALUE(id >= kMinExternalStreamId, "torch.kiln.ExternalStream: ",
                    static_cast<const void*>(handle), " cannot be a kiln stream handle");
  return KilnStream(Stream(Stream::UNSAFE, kiln_device, id));
}

std::optional<StreamId> streamIdOfRuntimeStream(DeviceIndex device, uint64_t runtime_id) {
  if (device < 0 || device >= kMaxDevices) {
    return std::nullopt;
  }
  auto& streams = deviceStreams(device);
  for (int id = 0; id < kStreamsPerDevice; ++id) {
    const kilnStream_t handle = streams.handles[static_cast<size_t>(id)].load(std::memory_order_acquire);
    unsigned long long handle_id = 0;
    if (handle != nullptr && kilnStreamGetId(handle, &handle_id) == kilnSuccess &&
        handle_id == runtime_id) {
      return static_cast<StreamId>(id);
    }
  }
  return std::nullopt;
}

std::ostream& operator<<(std::ostream& out, const KilnStream& stream) {
  return out << stream.unwrap();
}

} // namespace c10::kiln
