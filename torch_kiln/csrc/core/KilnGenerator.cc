#include "core/KilnGenerator.h"

#include <vector>

#include <ATen/Utils.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include "core/KilnEvent.h"
#include "core/KilnFunctions.h"
#include "core/KilnGraph.h"

namespace c10::kiln {

// Note [Kiln random numbers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// The reference device runs ATen's CPU kernels, and CPU random kernels draw
// from a CPUGeneratorImpl (a Mersenne Twister, mt19937). A kiln generator
// therefore owns a CPUGeneratorImpl, its "engine", and every random kernel on
// kiln runs with that engine (the op executor substitutes it for the
// generator argument). Consequences:
//   * Same seed, same sequence of random ops -> the same numbers as on CPU
//     (PyTorch does not promise this across devices; Kiln does it because it
//     makes CPU-vs-kiln comparisons exact, e.g. dropout masks in training).
//   * get_state()/set_state() use the CPU generator's state format, so a kiln
//     state can be loaded into a CPU generator and back.
//   * The engine is consumed when kernels *run* (on stream workers). To make
//     the sequence depend only on launch order, even when random ops go to
//     several streams, a launch on stream B after the previous random launch
//     on stream A makes B wait for A's work so far (engineForLaunch). Host
//     reads and writes of the state (seed, get/set_state) first wait for
//     launched random kernels, so they see exactly the launched ops' effect.
// CUDA uses a counter-based Philox generator instead; a real chip's runtime
// would do the same. The interface above (engineForLaunch) is where it plugs in.

KilnGeneratorImpl::KilnGeneratorImpl(DeviceIndex device, uint64_t seed)
    : c10::GeneratorImpl(Device(DeviceType::PrivateUse1, device),
                         DispatchKeySet(DispatchKey::PrivateUse1)),
      engine_(at::make_generator<at::CPUGeneratorImpl>(seed)) {}

c10::DeviceType KilnGeneratorImpl::device_type() {
  return DeviceType::PrivateUse1;
}

void KilnGeneratorImpl::waitForLaunchedKernels() const {
  std::optional<KilnStream> last;
  {
    std::lock_guard<std::mutex> lock(launch_mutex_);
    last = last_stream_;
  }
  // Kernels captured into a kiln graph do not run until replayed: nothing
  // to wait for (and a capturing stream refuses event records).
  if (last.has_value() && !isStreamCapturing(*last)) {
    // An event captures the work launched so far without consuming the
    // stream's pending errors (those belong to the next synchronize).
    KilnEvent event;
    event.record(*last);
    event.synchronize();
  }
}

at::Generator KilnGeneratorImpl::engineForLaunch(const KilnStream& stream) {
  std::lock_guard<std::mutex> lock(launch_mutex_);
  if (last_stream_.has_value() && *last_stream_ != stream && !isStreamCapturing(*last_stream_)) {
    // (Captured random kernels on a capturing last stream consume nothing
    // now: no ordering is needed, and that stream refuses event records.)
    KilnEvent event;
    event.record(*last_stream_);
    if (C10_UNLIKELY(isStreamCapturing(stream))) {
      // A capture cannot wait for another stream's pending work; the host
      // does, so the captured kernels (which run at replay, later still)
      // follow it (Note [Kiln graphs]).
      event.synchronize();
    } else {
      event.block(stream);
    }
  }
  last_stream_ = stream;
  if (C10_UNLIKELY(anyCaptureUnderway())) {
    // Replays of the capture order this generator too (Note [Kiln graphs]).
    noteCapturedGenerator(stream, at::Generator(c10::intrusive_ptr<c10::GeneratorImpl>::reclaim_copy(this)));
  }
  return engine_;
}

bool KilnGeneratorImpl::capturingOnCurrentStream() const {
  return anyCaptureUnderway() && isStreamCapturing(getCurrentKilnStream(device().index()));
}

// Seeding during a kiln graph capture is refused as CUDA refuses it
// (CUDAGeneratorImpl::set_current_seed / set_state): a capture records
// kernels, not host calls, so a reseed inside it would take effect once, now,
// and never at replay. Re-setting the current seed is a no-op and allowed.
void KilnGeneratorImpl::set_current_seed(uint64_t seed) {
  if (C10_UNLIKELY(capturingOnCurrentStream())) {
    TORCH_CHECK(current_seed() == seed,
                "KilnGeneratorImpl::set_current_seed can be called during stream capture only "
                "if new seed is the same as the original seed (current seed ", current_seed(),
                ", new seed ", seed, "). A kiln graph records kernels, not host calls: seed "
                "before the capture (each replay continues the captured random stream).");
    return;
  }
  waitForLaunchedKernels();
  std::lock_guard<std::mutex> lock(engine_.mutex());
  engine_.set_current_seed(seed);
}

uint64_t KilnGeneratorImpl::current_seed() const {
  std::lock_guard<std::mutex> lock(engine_.mutex());
  return engine_.current_seed();
}

uint64_t KilnGeneratorImpl::seed() {
  TORCH_CHECK(!capturingOnCurrentStream(),
              "Cannot call KilnGeneratorImpl::seed during kiln graph capture: seed before the "
              "capture.");
  const uint64_t random = c10::detail::getNonDeterministicRandom();
  set_current_seed(random);
  return random;
}

void KilnGeneratorImpl::set_offset(uint64_t /*offset*/) {
  TORCH_CHECK(false, "Kiln generators, like CPU generators, do not support set_offset(); "
                     "use manual_seed() or set_state().");
}

uint64_t KilnGeneratorImpl::get_offset() const {
  TORCH_CHECK(false, "Kiln generators, like CPU generators, do not support get_offset(); "
                     "use get_state().");
}

void KilnGeneratorImpl::set_state(const c10::TensorImpl& new_state) {
  TORCH_CHECK(!capturingOnCurrentStream(),
              "Cannot call KilnGeneratorImpl::set_state during kiln graph capture: a kiln graph "
              "records kernels, not host calls, so the state would be set once, now, and never "
              "at replay. Set the generator state before the capture.");
  waitForLaunchedKernels();
  std::lock_guard<std::mutex> lock(engine_.mutex());
  engine_.unsafeGetGeneratorImpl()->set_state(new_state);
}

c10::intrusive_ptr<c10::TensorImpl> KilnGeneratorImpl::get_state() const {
  waitForLaunchedKernels();
  std::lock_guard<std::mutex> lock(engine_.mutex());
  return engine_.unsafeGetGeneratorImpl()->get_state();
}

KilnGeneratorImpl* KilnGeneratorImpl::clone_impl() const {
  waitForLaunchedKernels();
  auto* copy = new KilnGeneratorImpl(device().index());
  std::lock_guard<std::mutex> lock(engine_.mutex());
  copy->engine_ = engine_.clone();
  return copy;
}

const at::Generator& getDefaultKilnGenerator(DeviceIndex device) {
  static const std::vector<at::Generator>* generators = [] {
    auto* all = new std::vector<at::Generator>();
    const DeviceIndex count = device_count();
    for (const auto i : c10::irange(count)) {
      all->push_back(at::make_generator<KilnGeneratorImpl>(static_cast<DeviceIndex>(i)));
    }
    return all;
  }();
  if (device < 0) {
    device = current_device();
  }
  check_device_index(device);
  return (*generators)[static_cast<size_t>(device)];
}

at::Generator createKilnGenerator(DeviceIndex device) {
  if (device < 0) {
    device = current_device();
  }
  check_device_index(device);
  return at::make_generator<KilnGeneratorImpl>(device);
}

} // namespace c10::kiln
