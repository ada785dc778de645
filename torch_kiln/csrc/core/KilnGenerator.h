// KilnGenerator.h — the random number generator of a kiln device.
//
// See Note [Kiln random numbers] in KilnGenerator.cc for the algorithm and
// its guarantees. In short: a kiln generator is PyTorch's CPU generator
// (mt19937, CPUGeneratorImpl) living on the device; random kernels consume it
// when they run on a kiln stream, in launch order, so a seed gives the same
// numbers on kiln as on CPU for the same sequence of random ops.
//
// Thread-safety: host-side methods lock the generator; kernels lock the
// engine (CPUGeneratorImpl::mutex_) as CPU kernels always do.
#pragma once

#include <memory>
#include <mutex>
#include <optional>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <c10/core/GeneratorImpl.h>

#include "core/KilnStream.h"

namespace c10::kiln {

class KilnGeneratorImpl final : public c10::GeneratorImpl {
 public:
  explicit KilnGeneratorImpl(DeviceIndex device,
                             uint64_t seed = c10::default_rng_seed_val);
  ~KilnGeneratorImpl() override = default;

  // c10::GeneratorImpl. Methods that read or change the state first wait for
  // random kernels already launched with this generator.
  void set_current_seed(uint64_t seed) override;
  uint64_t current_seed() const override;
  uint64_t seed() override;
  void set_offset(uint64_t offset) override; // unsupported, as on CPU
  uint64_t get_offset() const override;      // unsupported, as on CPU
  void set_state(const c10::TensorImpl& new_state) override;
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;
  static c10::DeviceType device_type();

  // For a random kernel about to be launched on `stream`: orders it after the
  // random kernels launched earlier with this generator on other streams and
  // returns the engine the kernel must use (a CPU generator).
  at::Generator engineForLaunch(const KilnStream& stream);

 private:
  KilnGeneratorImpl* clone_impl() const override;
  // Blocks until random kernels launched with this generator have run.
  void waitForLaunchedKernels() const;
  // True while the current stream of this generator's device is capturing a kiln graph.
  bool capturingOnCurrentStream() const;

  mutable at::Generator engine_; // a CPUGeneratorImpl (mutable: its lock is taken in const reads)
  mutable std::mutex launch_mutex_;
  std::optional<KilnStream> last_stream_; // stream of the last random kernel
};

// The default generator of a kiln device (-1: current device).
const at::Generator& getDefaultKilnGenerator(DeviceIndex device = -1);
// A new generator for a kiln device (-1: current device).
at::Generator createKilnGenerator(DeviceIndex device = -1);

} // namespace c10::kiln
