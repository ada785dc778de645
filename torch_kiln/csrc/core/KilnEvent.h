// KilnEvent.h — an owning, move-only wrapper of a runtime event (the kiln
// analogue of at::cuda::CUDAEvent), for C++ code such as the allocators.
// Python's torch.kiln.Event / torch.Event go through KilnGuardImpl instead.
//
// The runtime event is created lazily by the first record(), on the device of
// the recorded stream. An event never recorded counts as complete.
//
// Thread-safety: like CUDAEvent, one KilnEvent must not be used from two
// threads at once; different events are independent.
#pragma once

#include <utility>

#include <kiln/runtime.h>

#include "core/KilnException.h"
#include "core/KilnStream.h"

namespace c10::kiln {

class KilnEvent {
 public:
  explicit KilnEvent(unsigned int flags = kilnEventDisableTiming) noexcept
      : flags_(flags) {}
  ~KilnEvent() {
    if (event_ != nullptr) {
      KILN_WARN(kilnEventDestroy(event_));
    }
  }
  KilnEvent(const KilnEvent&) = delete;
  KilnEvent& operator=(const KilnEvent&) = delete;
  KilnEvent(KilnEvent&& other) noexcept { swap(other); }
  KilnEvent& operator=(KilnEvent&& other) noexcept {
    if (this != &other) {
      swap(other);
    }
    return *this;
  }

  bool isCreated() const noexcept { return event_ != nullptr; }
  kilnEvent_t event() const noexcept { return event_; }

  // Captures the work launched on `stream` so far.
  void record(const KilnStream& stream) {
    if (event_ == nullptr) {
      KILN_CHECK(kilnEventCreateWithFlags(&event_, flags_));
    }
    KILN_CHECK(kilnEventRecord(event_, stream.stream()));
  }

  // Makes later work on `stream` wait for this event's captured work.
  void block(const KilnStream& stream) const {
    if (event_ != nullptr) {
      KILN_CHECK(kilnStreamWaitEvent(stream.stream(), event_, 0));
    }
  }

  bool query() const {
    if (event_ == nullptr) {
      return true;
    }
    const kilnError_t status = kilnEventQuery(event_);
    if (status == kilnErrorNotReady) {
      return false;
    }
    KILN_CHECK(status);
    return true;
  }

  void synchronize() const {
    if (event_ != nullptr) {
      KILN_CHECK(kilnEventSynchronize(event_));
    }
  }

 private:
  void swap(KilnEvent& other) noexcept {
    std::swap(flags_, other.flags_);
    std::swap(event_, other.event_);
  }

  unsigned int flags_ = kilnEventDisableTiming;
  kilnEvent_t event_ = nullptr;
};

} // namespace c10::kiln
