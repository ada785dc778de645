// KilnProfilerSession.h — one torch.profiler session on the kiln device.
//
// Kineto drives it: start() and stop() bracket the profiled window, the
// push/pop calls arrive for every CPU op (on the op's thread) while it runs,
// then processTrace(), getDeviceInfo(), getResourceInfos() and
// getTraceBuffer() hand the device activities over. See Note [Kiln profiling
// data flow] in KilnActivityProfiler.cc.
//
// Errors: nothing here throws into Kineto. A runtime failure (e.g. kiln is
// unavailable) turns the session into a no-op; it and dropped records are
// reported as warnings (TORCH_WARN) and by errors().
//
// Thread-safety: push/pop may come from any thread and only touch the
// runtime's per-thread stacks; the other methods are called by Kineto from
// one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <IActivityProfiler.h>
#include <kiln/runtime.h>

#include "profiler/KilnTraceBuilder.h"

namespace at::kiln::profiler {

class KilnProfilerSession final : public libkineto::IActivityProfilerSession {
 public:
  // `activity_types`: what Kineto asked for; only those are produced.
  explicit KilnProfilerSession(std::set<libkineto::ActivityType> activity_types);
  ~KilnProfilerSession() override;

  void start() override;
  void stop() override;
  std::vector<std::string> errors() override;

  void processTrace(libkineto::ActivityLogger& logger) override;
  void processTrace(
      libkineto::ActivityLogger& logger,
      libkineto::getLinkedActivityCallback get_linked_activity,
      int64_t capture_start_ns,
      int64_t capture_end_ns) override;

  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override;
  std::vector<libkineto::ResourceInfo> getResourceInfos() override;
  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override;

  void pushCorrelationId(uint64_t id) override;
  void popCorrelationId() override;
  void pushUserCorrelationId(uint64_t id) override;
  void popUserCorrelationId() override;

 private:
  // False (after warning) if `status` is a failure of `what`.
  bool check(kilnError_t status, const char* what);
  // A Python warning, also kept in errors_.
  void warn(std::string message);

  std::set<libkineto::ActivityType> activity_types_;
  bool recording_ = false;
  ClockOffset offset_at_start_;
  ClockOffset offset_at_stop_;
  std::vector<kilnActivityRecord> records_;
  size_t dropped_ = 0;
  KilnTrace trace_;
  std::vector<std::string> errors_;
};

} // namespace at::kiln::profiler
