// copy.cc — memcpy, peer copies and memset, ordered on streams.
//
// Every device range is checked against the allocation table before anything
// is enqueued (ClassifyRange), so an out-of-range copy is a clear
// kilnErrorInvalidValue at the call instead of a corrupted neighbour
// allocation found much later by a worker thread.
//
// Note [Pageable and pinned copies]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// CUDA's rules, which PyTorch's non_blocking=True relies on:
//   - the destination is pageable host memory: the call returns after the
//     copy is done (the caller will read the bytes next, and pageable memory
//     gives no promise it stays valid). Such a copy does not need staging.
//   - otherwise, the source is pageable host memory: it is copied into a
//     staging buffer before the call returns, so the caller may overwrite or
//     free it at once; the stream later copies staging → destination.
//   - otherwise (device and pinned memory only): fully asynchronous; the
//     caller must keep both sides alive until the stream has run the copy.
// A synchronous copy skipped because of a sticky error returns that error
// (and so clears it): the caller must learn that the bytes did not arrive. In
// blocking mode every copy runs at once, so nothing is staged.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "runtime_internal.h"

namespace kiln {
namespace {

const char* KindName(kilnMemcpyKind kind) {
  switch (kind) {
    case kilnMemcpyHostToHost: return "kilnMemcpyHostToHost";
    case kilnMemcpyHostToDevice: return "kilnMemcpyHostToDevice";
    case kilnMemcpyDeviceToHost: return "kilnMemcpyDeviceToHost";
    case kilnMemcpyDeviceToDevice: return "kilnMemcpyDeviceToDevice";
    case kilnMemcpyDefault: return "kilnMemcpyDefault";
  }
  return "an unknown kind";
}

bool ValidKind(int kind) { return kind >= kilnMemcpyHostToHost && kind <= kilnMemcpyDefault; }

std::string Describe(const Range& r) {
  switch (r.kind) {
    case MemoryKind::kDevice: return StrFormat("memory of kiln device %d", r.device);
    case MemoryKind::kPinned: return "pinned host memory";
    case MemoryKind::kPageable: return "host memory (not a live kiln device allocation)";
  }
  return "?";
}

// Checks that each side is device memory exactly when `kind` says so.
kilnError_t CheckSide(const char* role, const void* p, const Range& r, bool want_device,
                      kilnMemcpyKind kind) {
  const bool is_device = r.kind == MemoryKind::kDevice;
  if (is_device == want_device) return kilnSuccess;
  return Fail(kilnErrorInvalidValue, "%s %p is %s, but %s needs %s there%s", role, p,
              Describe(r).c_str(), KindName(kind), want_device ? "device memory" : "host memory",
              want_device ? " (was it freed?)" : "; use kilnMemcpyDefault to infer the direction");
}

kilnError_t CheckKind(kilnMemcpyKind kind, const void* dst, const Range& d, const void* src,
                      const Range& s) {
  if (kind == kilnMemcpyDefault) return kilnSuccess;
  const bool src_device = kind == kilnMemcpyDeviceToHost || kind == kilnMemcpyDeviceToDevice;
  const bool dst_device = kind == kilnMemcpyHostToDevice || kind == kilnMemcpyDeviceToDevice;
  if (kilnError_t err = CheckSide("dst", dst, d, dst_device, kind)) return err;
  return CheckSide("src", src, s, src_device, kind);
}

// Validates the common arguments and classifies both ranges (count > 0).
kilnError_t ClassifyCopy(Runtime& rt, void* dst, const void* src, size_t count, Range* d, Range* s) {
  if (dst == nullptr || src == nullptr)
    return Fail(kilnErrorInvalidValue, "dst (%p) and src (%p) must not be NULL for a copy of %zu bytes",
                dst, src, count);
  if (kilnError_t err = ClassifyRange(rt, "dst", dst, count, d)) return err;
  return ClassifyRange(rt, "src", src, count, s);
}

const char* MemoryName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kDevice: return "Device";
    case MemoryKind::kPinned: return "Pinned";
    case MemoryKind::kPageable: return "Pageable";
  }
  return "?";
}

// The activity kind and CUDA-style name of a copy ("Memcpy HtoD (Pageable ->
// Device)"), for its activity record (Note [Activity tracing]).
kilnActivityKind CopyActivityKind(const Range& d, const Range& s, const char** direction) {
  const bool from_device = s.kind == MemoryKind::kDevice;
  const bool to_device = d.kind == MemoryKind::kDevice;
  if (from_device && to_device) {
    *direction = s.device == d.device ? "DtoD" : "PtoP";
    return s.device == d.device ? kilnActivityKindMemcpyDtoD : kilnActivityKindMemcpyPeer;
  }
  if (to_device) {
    *direction = "HtoD";
    return kilnActivityKindMemcpyHtoD;
  }
  if (from_device) {
    *direction = "DtoH";
    return kilnActivityKindMemcpyDtoH;
  }
  *direction = "HtoH";
  return kilnActivityKindMemcpyHtoH;
}

void AttachCopyActivity(ApiActivity& activity, Entry& e, const Stream* stream, size_t count,
                        const Range& d, const Range& s) {
  if (!activity.on()) return;
  const char* direction = "";
  const kilnActivityKind kind = CopyActivityKind(d, s, &direction);
  char name[64];
  std::snprintf(name, sizeof name, "Memcpy %s (%s -> %s)", direction, MemoryName(s.kind),
                MemoryName(d.kind));
  activity.Attach(e, stream, kind, name, count, s.kind == MemoryKind::kDevice ? s.device : -1,
                  d.kind == MemoryKind::kDevice ? d.device : -1);
}

// Enqueues a validated copy on `stream` per Note [Pageable and pinned copies];
// `always_wait` makes it synchronous whatever the memory (kilnMemcpy).
kilnError_t SubmitCopy(Runtime& rt, ApiActivity& activity, Stream* stream, void* dst,
                       const void* src, size_t count, const Range& d, const Range& s,
                       bool always_wait) {
  const bool wait = always_wait || d.kind == MemoryKind::kPageable;
  const bool stage = !wait && s.kind == MemoryKind::kPageable && !rt.config.launch_blocking;
  if (__builtin_expect(stream->capturing(), 0)) {
    // Note [Stream capture]: a synchronous copy would wait for the capture,
    // and a pageable source would be read once, at capture, not per launch.
    if (wait)
      return stream->RefuseIfCapturing(
          "a synchronous copy on the capturing stream (into pageable host memory, or kilnMemcpy)");
    if (s.kind == MemoryKind::kPageable)
      return stream->RefuseIfCapturing(
          "an asynchronous copy from pageable host memory on the capturing stream (copy from "
          "pinned memory, kilnMallocHost, to capture it)");
  }
  if (wait) {
    if (kilnError_t err = stream->CheckNotSelf()) return err;
    // The earlier work first, interruptibly; then the copy itself, which the
    // caller cannot abandon once enqueued (Note [Interruptible host waits]).
    if (kilnError_t err = stream->HostWaitFor(stream->submitted())) return err;
  }
  Entry e;
  e.kind = EntryKind::kCopy;
  e.dst = dst;
  e.src = src;
  e.count = count;
  CopyOutcome outcome = CopyOutcome::kPending;
  if (wait) e.outcome = &outcome;
  if (stage) {
    void* buffer = std::malloc(count);
    if (buffer == nullptr)
      return Fail(kilnErrorMemoryAllocation,
                  "could not stage %s of pageable host memory for an asynchronous copy; copy "
                  "from pinned memory (kilnMallocHost) to avoid staging",
                  FormatBytes(count).c_str());
    std::memcpy(buffer, src, count);
    e.src = buffer;
    e.staging = buffer;
  }
  AttachCopyActivity(activity, e, stream, count, d, s);
  uint64_t seq = 0;
  bool consumed = false;
  if (kilnError_t err = stream->Submit(e, &seq, &consumed)) {
    if (!consumed) {  // (a copy entry never fails once enqueued; this is defensive)
      activity.Detach(e);
      std::free(e.staging);
    }
    return err;
  }
  if (!wait) return kilnSuccess;
  stream->WaitFor(seq);
  if (outcome == CopyOutcome::kSkipped) {
    if (kilnError_t err = stream->TakeStickyError()) return err;
    return Fail(kilnErrorLaunchFailure,
                "the copy was skipped because an earlier task on its stream failed (the error "
                "was reported to another caller)");
  }
  return kilnSuccess;
}

}  // namespace
}  // namespace kiln

using kiln::ApiActivity;
using kiln::ApiCall;
using kiln::Fail;
using kiln::MemoryKind;
using kiln::Range;
using kiln::Runtime;
using kiln::Stream;

extern "C" {

KILN_API kilnError_t kilnMemcpyAsync(void* dst, const void* src, size_t count, kilnMemcpyKind kind,
                                     kilnStream_t stream) {
  return ApiCall("kilnMemcpyAsync", [&](Runtime& rt) {
    kiln::ApiActivity activity(rt, "kilnMemcpyAsync");
    if (!kiln::ValidKind(kind)) return Fail(kilnErrorInvalidValue, "kind %d is not a kilnMemcpyKind", static_cast<int>(kind));
    Stream* s = nullptr;
    if (kilnError_t err = kiln::ResolveStream(rt, stream, &s)) return err;
    if (count == 0) return kilnSuccess;
    Range d, sr;
    if (kilnError_t err = kiln::ClassifyCopy(rt, dst, src, count, &d, &sr)) return err;
    if (kilnError_t err = kiln::CheckKind(kind, dst, d, src, sr)) return err;
    return kiln::SubmitCopy(rt, activity, s, dst, src, count, d, sr, /*always_wait=*/false);
  });
}

KILN_API kilnError_t kilnMemcpy(void* dst, const void* src, size_t count, kilnMemcpyKind kind) {
  return ApiCall("kilnMemcpy", [&](Runtime& rt) {
    kiln::ApiActivity activity(rt, "kilnMemcpy");
    if (!kiln::ValidKind(kind)) return Fail(kilnErrorInvalidValue, "kind %d is not a kilnMemcpyKind", static_cast<int>(kind));
    if (count == 0) return kilnSuccess;
    Range d, sr;
    if (kilnError_t err = kiln::ClassifyCopy(rt, dst, src, count, &d, &sr)) return err;
    if (kilnError_t err = kiln::CheckKind(kind, dst, d, src, sr)) return err;
    // The default stream of the device that owns the device side (the
    // destination's for device to device); the current device's for host to host.
    int device = 0;
    if (d.kind == MemoryKind::kDevice) {
      device = d.device;
    } else if (sr.kind == MemoryKind::kDevice) {
      device = sr.device;
    } else if (kilnError_t err = kiln::CurrentDevice(rt, &device)) {
      return err;
    }
    Stream* s = nullptr;
    if (kilnError_t err = kiln::GetDefaultStream(rt, device, &s)) return err;
    return kiln::SubmitCopy(rt, activity, s, dst, src, count, d, sr, /*always_wait=*/true);
  });
}

KILN_API kilnError_t kilnMemcpyPeerAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                                         size_t count, kilnStream_t stream) {
  return ApiCall("kilnMemcpyPeerAsync", [&](Runtime& rt) {
    kiln::ApiActivity activity(rt, "kilnMemcpyPeerAsync");
    if (kilnError_t err = kiln::CheckDevice(rt, dstDevice)) return err;
    if (kilnError_t err = kiln::CheckDevice(rt, srcDevice)) return err;
    Stream* s = nullptr;
    if (kilnError_t err = kiln::ResolveStream(rt, stream, &s)) return err;
    if (s->device() != dstDevice && s->device() != srcDevice)
      return Fail(kilnErrorInvalidValue,
                  "the stream belongs to kiln device %d, but a copy from device %d to device %d "
                  "must run on a stream of one of them",
                  s->device(), srcDevice, dstDevice);
    if (count == 0) return kilnSuccess;
    Range d, sr;
    if (kilnError_t err = kiln::ClassifyCopy(rt, dst, src, count, &d, &sr)) return err;
    if (d.kind != MemoryKind::kDevice || d.device != dstDevice)
      return Fail(kilnErrorInvalidValue, "dst %p is %s, not memory of kiln device %d (dstDevice)", dst,
                  kiln::Describe(d).c_str(), dstDevice);
    if (sr.kind != MemoryKind::kDevice || sr.device != srcDevice)
      return Fail(kilnErrorInvalidValue, "src %p is %s, not memory of kiln device %d (srcDevice)", src,
                  kiln::Describe(sr).c_str(), srcDevice);
    return kiln::SubmitCopy(rt, activity, s, dst, src, count, d, sr, /*always_wait=*/false);
  });
}

KILN_API kilnError_t kilnMemsetAsync(void* devPtr, int value, size_t count, kilnStream_t stream) {
  return ApiCall("kilnMemsetAsync", [&](Runtime& rt) {
    kiln::ApiActivity activity(rt, "kilnMemsetAsync");
    Stream* s = nullptr;
    if (kilnError_t err = kiln::ResolveStream(rt, stream, &s)) return err;
    if (count == 0) return kilnSuccess;
    if (devPtr == nullptr)
      return Fail(kilnErrorInvalidValue, "devPtr is NULL for a memset of %zu bytes", count);
    Range r;
    if (kilnError_t err = kiln::ClassifyRange(rt, "devPtr", devPtr, count, &r)) return err;
    if (r.kind != MemoryKind::kDevice)
      return Fail(kilnErrorInvalidValue, "devPtr %p is %s; kilnMemsetAsync needs device memory (was it freed?)",
                  devPtr, kiln::Describe(r).c_str());
    kiln::Entry e;
    e.kind = kiln::EntryKind::kMemset;
    e.dst = devPtr;
    e.value = value;
    e.count = count;
    activity.Attach(e, s, kilnActivityKindMemset, "Memset (Device)", count, -1, r.device);
    bool consumed = false;
    const kilnError_t err = s->Submit(e, nullptr, &consumed);
    if (!consumed) activity.Detach(e);
    return err;
  });
}

}  // extern "C"
