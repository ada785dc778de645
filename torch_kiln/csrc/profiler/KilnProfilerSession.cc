#include "profiler/KilnProfilerSession.h"

#include <utility>

#include <c10/util/Exception.h>
#include <libkineto.h>
#include <output_base.h>

namespace at::kiln::profiler {
namespace {

// Drained per kilnActivityGetRecords call.
constexpr size_t kDrainBatch = 4096;

} // namespace

KilnProfilerSession::KilnProfilerSession(std::set<libkineto::ActivityType> activity_types)
    : activity_types_(std::move(activity_types)) {}

KilnProfilerSession::~KilnProfilerSession() {
  if (recording_) {
    // Kineto dropped the session without stopping it (e.g. an error while
    // starting): leave the runtime as we found it.
    kilnActivityDisable();
  }
}

bool KilnProfilerSession::check(kilnError_t status, const char* what) {
  if (status == kilnSuccess) {
    return true;
  }
  warn(std::string("kiln profiler: ") + what + " failed, the profile has no kiln device activity: " +
       kilnGetErrorName(status) + ": " + kilnGetLastErrorMessage());
  return false;
}

void KilnProfilerSession::warn(std::string message) {
  // Kineto does not surface a session's errors(); a warning reaches the user.
  TORCH_WARN(message);
  errors_.push_back(std::move(message));
}

void KilnProfilerSession::start() {
  offset_at_start_ = sampleClockOffset();
  recording_ = check(kilnActivityEnable(0), "kilnActivityEnable");
  status_ = recording_ ? libkineto::TraceStatus::RECORDING : libkineto::TraceStatus::ERROR;
}

void KilnProfilerSession::stop() {
  if (!recording_) {
    return;
  }
  recording_ = false;
  check(kilnActivityDisable(), "kilnActivityDisable");
  // Work launched in the window may still be running (torch.profiler only
  // synchronizes the current device): wait for its records, without
  // synchronizing streams in the CUDA sense.
  check(kilnActivityFlushAll(), "kilnActivityFlushAll");
  offset_at_stop_ = sampleClockOffset();
  std::vector<kilnActivityRecord> batch(kDrainBatch);
  for (;;) {
    size_t count = 0;
    if (!check(kilnActivityGetRecords(batch.data(), batch.size(), &count), "kilnActivityGetRecords") ||
        count == 0) {
      break;
    }
    records_.insert(records_.end(), batch.begin(), batch.begin() + static_cast<std::ptrdiff_t>(count));
  }
  check(kilnActivityGetDroppedCount(&dropped_), "kilnActivityGetDroppedCount");
  if (dropped_ > 0) {
    warn("kiln profiler: " + std::to_string(dropped_) +
         " device activity records were dropped: a profile keeps at most " +
         std::to_string(KILN_ACTIVITY_DEFAULT_MAX_RECORDS) +
         "; profile fewer steps (e.g. with torch.profiler.schedule)");
  }
  status_ = libkineto::TraceStatus::PROCESSING;
}

std::vector<std::string> KilnProfilerSession::errors() {
  return errors_;
}

void KilnProfilerSession::processTrace(libkineto::ActivityLogger& logger) {
  processTrace(logger, nullptr, 0, 0);
}

void KilnProfilerSession::processTrace(
    libkineto::ActivityLogger& logger,
    libkineto::getLinkedActivityCallback get_linked_activity,
    int64_t capture_start_ns,
    int64_t capture_end_ns) {
  KilnTraceBuilder builder(
      activity_types_, averageOffset(offset_at_start_, offset_at_stop_),
      std::move(get_linked_activity), capture_start_ns, capture_end_ns);
  trace_ = builder.build(records_, logger);
  records_.clear();
  records_.shrink_to_fit();
  status_ = libkineto::TraceStatus::READY;
}

std::unique_ptr<libkineto::DeviceInfo> KilnProfilerSession::getDeviceInfo() {
  // Kineto takes one device row per session: the lowest kiln device used.
  // Stream tracks of other devices still carry the device in their names.
  if (trace_.devices.empty()) {
    return nullptr;
  }
  const int device = *trace_.devices.begin();
  return std::make_unique<libkineto::DeviceInfo>(libkineto::DeviceInfo{
      device, libkineto::kExceedMaxPid + device, "kiln", "kiln:" + std::to_string(device)});
}

std::vector<libkineto::ResourceInfo> KilnProfilerSession::getResourceInfos() {
  return trace_.streams;
}

std::unique_ptr<libkineto::CpuTraceBuffer> KilnProfilerSession::getTraceBuffer() {
  return std::move(trace_.buffer);
}

// Kineto forwards PyTorch's op correlation ids on the op's own thread; the
// runtime stamps every launch that thread makes with the innermost one.
// Errors are ignored on purpose: a pop whose push happened before the
// session existed finds an empty stack, which is harmless.
void KilnProfilerSession::pushCorrelationId(uint64_t id) {
  kilnActivityPushExternalCorrelationId(kilnExternalCorrelationKindDefault, id);
}

void KilnProfilerSession::popCorrelationId() {
  kilnActivityPopExternalCorrelationId(kilnExternalCorrelationKindDefault, nullptr);
}

void KilnProfilerSession::pushUserCorrelationId(uint64_t id) {
  kilnActivityPushExternalCorrelationId(kilnExternalCorrelationKindUser, id);
}

void KilnProfilerSession::popUserCorrelationId() {
  kilnActivityPopExternalCorrelationId(kilnExternalCorrelationKindUser, nullptr);
}

} // namespace at::kiln::profiler
