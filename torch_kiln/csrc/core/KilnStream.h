// KilnStream.h — PyTorch streams on kiln devices (the kiln analogue of
// c10/cuda/CUDAStream.h).
//
// A KilnStream is a c10::Stream of device type PrivateUse1 ("kiln") plus the
// runtime stream (kilnStream_t) it names. Work launched by the torch layer
// goes to the calling thread's *current* stream of the target device, which
// is the device's default stream unless the user selected another one
// (torch.kiln.set_stream / `with torch.kiln.stream(s)`).
//
// See Note [Kiln stream ids] in KilnStream.cc for how ids map to runtime
// streams. The default and pool streams are never destroyed (like CUDA's pool
// streams), so such a KilnStream value stays valid for the life of the
// process. An external stream (getStreamFromExternal, torch.kiln.ExternalStream)
// wraps a runtime stream someone else created; it stays valid while its owner
// keeps the runtime stream alive, and work on it after that fails with the
// runtime's "stream has been destroyed" error.
//
// Thread-safety: all functions are thread-safe; the current stream is per
// thread and per device.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <utility>

#include <c10/core/Stream.h>
#include <kiln/runtime.h>

namespace c10::kiln {

// Streams handed out round-robin per priority level by getStreamFromPool.
constexpr int kStreamsPerPool = 4;
// Priority levels: 0 (normal) and -1 (high), as CUDA reports for its range.
constexpr int kStreamPriorityLevels = 2;
// Stream ids from here up are runtime handles of external streams (no valid
// handle is below it: the first page is never mapped).
constexpr StreamId kMinExternalStreamId = 4096;

class KilnStream {
 public:
  // Throws if `stream` is not a kiln stream.
  explicit KilnStream(Stream stream);

  bool operator==(const KilnStream& other) const noexcept {
    return stream_ == other.stream_;
  }
  bool operator!=(const KilnStream& other) const noexcept {
    return stream_ != other.stream_;
  }

  operator Stream() const noexcept { return stream_; }
  Stream unwrap() const noexcept { return stream_; }

  DeviceType device_type() const noexcept { return stream_.device_type(); }
  DeviceIndex device_index() const noexcept { return stream_.device_index(); }
  Device device() const noexcept { return stream_.device(); }
  StreamId id() const noexcept { return stream_.id(); }

  // The runtime handle of this stream (created on first use).
  kilnStream_t stream() const;

  // True for a stream wrapping a runtime handle from outside the torch layer
  // (its id is the handle, Note [Kiln stream ids]).
  bool is_external() const noexcept { return id() >= kMinExternalStreamId; }

  // Lower number = higher priority (0 normal, -1 high).
  int priority() const;

  // True if all work launched on the stream has finished. Raises a pending
  // task error of the stream (and clears it).
  bool query() const;
  // Blocks until all work launched on the stream has finished; raises a
  // pending task error of the stream (and clears it).
  void synchronize() const;

  // (least, greatest) priorities, i.e. (0, -1).
  static std::pair<int, int> priority_range();

 private:
  Stream stream_;
};

// The default stream of `device` (-1: current device).
KilnStream getDefaultKilnStream(DeviceIndex device = -1);
// The calling thread's current stream of `device` (-1: current device).
KilnStream getCurrentKilnStream(DeviceIndex device = -1);
// Makes `stream` current for its device on the calling thread.
void setCurrentKilnStream(KilnStream stream);
// A stream from the device's pool, round-robin within a priority level.
KilnStream getStreamFromPool(int priority = 0, DeviceIndex device = -1);

// The stream of a runtime handle created outside the torch layer (say by a
// library calling kilnStreamCreate), like c10::cuda::getStreamFromExternal.
// NULL names the default stream of the current device, as in the runtime API.
// A handle of the torch layer's own streams gives that stream (same id).
// `device` (-1: the stream's own) must be the device the stream belongs to.
// Throws c10::ValueError if the runtime does not know the handle (never
// created, or destroyed) or it belongs to another device. The caller keeps the
// runtime stream alive while the KilnStream is used.
KilnStream getStreamFromExternal(kilnStream_t handle, DeviceIndex device = -1);

// The id (c10::Stream::id()) of the stream of `device` whose runtime stream
// has kilnStreamGetId `runtime_id`, or nullopt if the torch layer has not
// created such a stream. The profiler names device tracks with it, so a trace
// shows the stream ids Python sees (torch.Stream.stream_id).
std::optional<StreamId> streamIdOfRuntimeStream(DeviceIndex device, uint64_t runtime_id);

std::ostream& operator<<(std::ostream& out, const KilnStream& stream);

} // namespace c10::kiln

template <>
struct std::hash<c10::kiln::KilnStream> {
  size_t operator()(const c10::kiln::KilnStream& s) const noexcept {
    return std::hash<c10::Stream>{}(s.unwrap());
  }
};
