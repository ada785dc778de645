// KilnActivityProfiler.h — Kiln's Kineto plugin: the device side of
// torch.profiler for kiln (ProfilerActivity.PrivateUse1).
//
// Registered with PyTorch's PrivateUse1ProfilerRegistry when torch_kiln._C
// loads; PyTorch forwards it to Kineto, which asks it for a session each time
// a profile starts. See Note [Kiln profiling data flow] in
// KilnActivityProfiler.cc.
//
// Thread-safety: Kineto calls configure() from the thread that starts the
// profile; the object holds no mutable state.
#pragma once

#include <memory>
#include <set>
#include <string>

#include <IActivityProfiler.h>

namespace at::kiln::profiler {

class KilnActivityProfiler final : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override;

  // The Kineto activity types kiln produces: kernels (tasks), memcpy, memset,
  // user annotations on the device, and runtime calls on host threads.
  const std::set<libkineto::ActivityType>& availableActivities() const override;

  // A session if `activity_types` asks for device activity (kernels, memcpy
  // or memset, i.e. ProfilerActivity.PrivateUse1 was requested), else null:
  // a CPU-only profile leaves the device untouched.
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(
      const std::set<libkineto::ActivityType>& activity_types,
      const libkineto::Config& config) override;
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(
      int64_t ts_ms,
      int64_t duration_ms,
      const std::set<libkineto::ActivityType>& activity_types,
      const libkineto::Config& config) override;
};

} // namespace at::kiln::profiler
