// KilnProfilerStubs.cc — kiln's ProfilerStubs: device timing for PyTorch's
// legacy (marker) profiler, torch.autograd.profiler.profile(use_device="kiln")
// without Kineto. See Note [Legacy profiler on kiln].

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include <c10/core/DeviceGuard.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <torch/csrc/profiler/stubs/base.h>

#include <kiln/runtime.h>

#include "core/KilnException.h"
#include "core/KilnFunctions.h"
#include "core/KilnStream.h"

namespace at::kiln::profiler {
namespace {

using torch::profiler::impl::ProfilerStubs;
using torch::profiler::impl::ProfilerVoidEventStub;

// Note [Legacy profiler on kiln]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch.autograd.profiler.profile(use_device="kiln") with use_kineto=False
// (the default) runs PyTorch's KINETO_PRIVATEUSE1_FALLBACK state: Kineto
// records the CPU ops, and around each op PyTorch asks the PrivateUse1
// ProfilerStubs for a device event at the op's start and one at its end
// (record), then, after the profile, for the device time between the two
// (elapsed), which becomes the op's device time in key_averages(). Until a
// backend registers stubs, PyTorch's default ones throw "PrivateUse1 used in
// profiler but not enabled" from inside every op's profiler callback, so each
// op warns, its end is never recorded and its CPU times come out negative.
//
// These stubs are the CUDA legacy profiler's design on kiln's runtime:
//   - record() records a timed kiln event on the calling thread's current
//     stream of its current device. Events complete in stream order, so the
//     two events of an op bracket the device work it launched on that stream;
//     their difference is that work's device time (0 for an op that launched
//     nothing; work on other streams is not counted, as with CUDA).
//   - elapsed() is the events' kilnEventElapsedTime in microseconds. If one is
//     still pending (profile.__exit__ synchronizes only the current device),
//     it polls rather than calling kilnEventSynchronize: that call would take
//     and clear a failed stream's sticky error, which belongs to the user's
//     next synchronization, not to the profiler's bookkeeping.
//   - mark/rangePush/rangePop are no-ops: they serve PyTorch's NVTX-style
//     annotation modes, and kiln's ranges come from the Kineto plugin
//     (record_function ranges on the device tracks, Note [Kiln profiling data
//     flow]).
//   - Nothing here throws into the profiler callbacks: a runtime failure
//     warns once and leaves the event empty, which PyTorch reports as "no
//     device time" for that op.
// Kineto's own path (ProfilerActivity.PrivateUse1) does not use these stubs.

struct KilnProfilerStubs final : public ProfilerStubs {
  void record(c10::DeviceIndex* device, ProfilerVoidEventStub* event,
              int64_t* cpu_ns) const override {
    try {
      const c10::kiln::KilnStream stream = c10::kiln::getCurrentKilnStream();
      if (device != nullptr) {
        *device = stream.device_index();
      }
      kilnEvent_t raw = nullptr;
      KILN_CHECK(kilnEventCreateWithFlags(&raw, kilnEventDefault));
      // Owned by the profiler's record of the op; destroyed with it (a record
      // still pending at that point is safe, see kilnEventDestroy).
      std::shared_ptr<void> owned(static_cast<void*>(raw), [](void* e) {
        kilnEventDestroy(static_cast<kilnEvent_t>(e));
      });
      if (cpu_ns != nullptr) {
        *cpu_ns = c10::getTime();
      }
      KILN_CHECK(kilnEventRecord(raw, stream.stream()));
      *event = std::move(owned);
    } catch (const std::exception& e) {
      TORCH_WARN_ONCE("kiln: the legacy profiler could not record a device event, so some ops "
                      "show no device time: ", e.what());
    }
  }

  float elapsed(const ProfilerVoidEventStub* start,
                const ProfilerVoidEventStub* end) const override {
    if (start == nullptr || end == nullptr || !*start || !*end) {
      return 0.f;
    }
    auto* a = static_cast<kilnEvent_t>(start->get());
    auto* b = static_cast<kilnEvent_t>(end->get());
    float ms = 0.f;
    auto wait = std::chrono::microseconds(10);
    kilnError_t status;
    while ((status = kilnEventElapsedTime(&ms, a, b)) == kilnErrorNotReady) {
      std::this_thread::sleep_for(wait);
      wait = std::min(wait * 2, std::chrono::microseconds(1000));
    }
    if (status != kilnSuccess) {
      TORCH_WARN_ONCE("kiln: the legacy profiler could not time a device event pair, so some "
                      "ops show no device time: ", kilnGetErrorName(status), ": ",
                      kilnGetLastErrorMessage());
      return 0.f;
    }
    // Microseconds, as the profiler expects. Two events of one op on different
    // streams (the op changed the current stream) can complete out of order;
    // their difference is no device time of the op, so it counts as none.
    return std::max(ms, 0.f) * 1000.f;
  }

  void mark(const char* /*name*/) const override {}
  void rangePush(const char* /*name*/) const override {}
  void rangePop() const override {}

  bool enabled() const override { return true; }

  void onEachDevice(std::function<void(int)> op) const override {
    c10::DeviceGuard guard(c10::Device(c10::DeviceType::PrivateUse1, 0));
    const c10::DeviceIndex count = c10::kiln::device_count();
    for (c10::DeviceIndex i = 0; i < count; ++i) {
      guard.set_index(i);
      op(i);
    }
  }

  void synchronize() const override { c10::kiln::device_synchronize(); }
};

struct RegisterKilnProfilerStubs {
  RegisterKilnProfilerStubs() {
    static KilnProfilerStubs stubs;
    torch::profiler::impl::registerPrivateUse1Methods(&stubs);
  }
};
const RegisterKilnProfilerStubs kRegister;

}  // namespace
}  // namespace at::kiln::profiler
