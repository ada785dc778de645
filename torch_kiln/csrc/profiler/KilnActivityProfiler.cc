#include "profiler/KilnActivityProfiler.h"

#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>

#include "profiler/KilnProfilerSession.h"

namespace at::kiln::profiler {

// Note [Kiln profiling data flow]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch.profiler.profile(activities=[CPU, PrivateUse1]) on kiln code:
//
//  1. Registration. Loading torch_kiln._C registers KilnActivityProfiler with
//     PyTorch's PrivateUse1ProfilerRegistry, which hands it to Kineto as a
//     child profiler. When a profile is configured, Kineto calls configure()
//     with the requested activity types; PrivateUse1 maps to kernels, memcpy,
//     memset, user annotations and runtime events, and we answer with a
//     KilnProfilerSession (a CPU-only profile gets none).
//  2. Recording. session.start() turns on the runtime's activity tracing
//     (kilnActivityEnable, see "Activity tracing" in kiln/runtime.h). From
//     then on the runtime writes a record for every kiln task, copy and memset
//     enqueued — stamped on the stream's worker with device-clock start/end —
//     and one for each runtime call that enqueued it, on the calling thread.
//  3. Correlation. For every CPU op it records, PyTorch pushes the op's
//     correlation id through Kineto to session.pushCorrelationId (and
//     pushUserCorrelationId for record_function ranges), on the thread running
//     the op, and pops it when the op ends. The session forwards them to the
//     runtime's per-thread external correlation stacks, so every launch
//     (KernelLaunch::launch, launchTask, the copies of Copy.cc, on whatever
//     path) is stamped with the innermost op and range of the thread that
//     launched it without the launch code doing anything: the hot path
//     stays untouched when profiling is off.
//  4. Collection. session.stop() disables tracing and waits for the traced
//     work still in flight (kilnActivityFlushAll: no stream synchronization,
//     sticky errors stay put), then drains the records.
//  5. Conversion (KilnTraceBuilder). Device timestamps are moved from the
//     device clock to the host's wall clock that Kineto and PyTorch's CPU ops
//     use (an offset sampled at start and stop). Each record becomes a Kineto
//     activity: tasks are CONCURRENT_KERNEL, copies GPU_MEMCPY, memsets
//     GPU_MEMSET — which PyTorch reports as kiln device events — placed on
//     pid = kiln device index, tid = the torch stream id (one chrome-trace
//     track per stream); runtime calls are PRIVATEUSE1_RUNTIME events on the
//     launching thread. Each is linked to the CPU op whose id it carries
//     (Kineto's getLinkedActivity callback), which is how key_averages()
//     charges device time to ops, and each launch and its device work share
//     an ac2g flow (the arrows in the trace). Device work inside a
//     record_function range also yields a GPU_USER_ANNOTATION spanning it on
//     the same stream track, named after the range.
//  6. Hand-off. Kineto takes the activities (getTraceBuffer) and the stream
//     track names (getResourceInfos) into its trace; PyTorch builds
//     key_averages() and export_chrome_trace() from it.

const std::string& KilnActivityProfiler::name() const {
  static const std::string kName = "kiln";
  return kName;
}

const std::set<libkineto::ActivityType>& KilnActivityProfiler::availableActivities() const {
  static const std::set<libkineto::ActivityType> kActivities = {
      libkineto::ActivityType::CONCURRENT_KERNEL,
      libkineto::ActivityType::GPU_MEMCPY,
      libkineto::ActivityType::GPU_MEMSET,
      libkineto::ActivityType::GPU_USER_ANNOTATION,
      libkineto::ActivityType::PRIVATEUSE1_RUNTIME,
  };
  return kActivities;
}

std::unique_ptr<libkineto::IActivityProfilerSession> KilnActivityProfiler::configure(
    const std::set<libkineto::ActivityType>& activity_types,
    const libkineto::Config& /*config*/) {
  // PRIVATEUSE1_RUNTIME alone does not count: PyTorch requests it for CPU-only
  // profiles too.
  const bool wants_device = activity_types.count(libkineto::ActivityType::CONCURRENT_KERNEL) ||
      activity_types.count(libkineto::ActivityType::GPU_MEMCPY) ||
      activity_types.count(libkineto::ActivityType::GPU_MEMSET);
  if (!wants_device) {
    return nullptr;
  }
  return std::make_unique<KilnProfilerSession>(activity_types);
}

std::unique_ptr<libkineto::IActivityProfilerSession> KilnActivityProfiler::configure(
    int64_t /*ts_ms*/,
    int64_t /*duration_ms*/,
    const std::set<libkineto::ActivityType>& activity_types,
    const libkineto::Config& config) {
  // Kineto starts and stops the session itself at the requested times.
  return configure(activity_types, config);
}

REGISTER_PRIVATEUSE1_PROFILER(KilnActivityProfiler);

} // namespace at::kiln::profiler
