#include "profiler/KilnTraceBuilder.h"

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_set>
#include <utility>

#include <ThreadUtil.h>
#include <c10/util/ApproximateClock.h>
#include <output_base.h>

#include "core/KilnStream.h"

namespace at::kiln::profiler {
namespace {

using libkineto::ActivityType;

// Tracks of runtime streams the torch layer did not create (none today) get
// ids past the torch stream ids.
constexpr int32_t kForeignStreamTrackBase = 1000;

std::optional<ActivityType> activityTypeOf(kilnActivityKind kind) {
  switch (kind) {
    case kilnActivityKindApi:
      return ActivityType::PRIVATEUSE1_RUNTIME;
    case kilnActivityKindTask:
      return ActivityType::CONCURRENT_KERNEL;
    case kilnActivityKindMemcpyHtoD:
    case kilnActivityKindMemcpyDtoH:
    case kilnActivityKindMemcpyDtoD:
    case kilnActivityKindMemcpyPeer:
    case kilnActivityKindMemcpyHtoH:
      return ActivityType::GPU_MEMCPY;
    case kilnActivityKindMemset:
      return ActivityType::GPU_MEMSET;
    case kilnActivityKindEventRecord:
    case kilnActivityKindEventWait:
      // Instants and waits would count as device time of the ops that
      // recorded them; the gaps on the stream tracks already show waits.
      return std::nullopt;
  }
  return std::nullopt;
}

} // namespace

ClockOffset sampleClockOffset() {
  ClockOffset best;
  for (int i = 0; i < 5; ++i) {
    const int64_t before = c10::getTime();
    long long device = 0;
    if (kilnActivityGetTimestamp(&device) != kilnSuccess) {
      break;
    }
    const int64_t after = c10::getTime();
    const int64_t error = after - before;
    if (best.error_ns < 0 || error < best.error_ns) {
      best = ClockOffset{before + error / 2 - static_cast<int64_t>(device), error};
    }
  }
  return best;
}

int64_t averageOffset(const ClockOffset& a, const ClockOffset& b) {
  if (a.error_ns < 0) {
    return b.offset_ns;
  }
  if (b.error_ns < 0) {
    return a.offset_ns;
  }
  return a.offset_ns + (b.offset_ns - a.offset_ns) / 2;
}

KilnTraceBuilder::KilnTraceBuilder(
    std::set<ActivityType> activity_types,
    int64_t clock_offset_ns,
    libkineto::getLinkedActivityCallback linked,
    int64_t capture_start_ns,
    int64_t capture_end_ns)
    : activity_types_(std::move(activity_types)),
      clock_offset_ns_(clock_offset_ns),
      linked_(std::move(linked)),
      capture_start_ns_(capture_start_ns),
      capture_end_ns_(capture_end_ns) {}

bool KilnTraceBuilder::wanted(ActivityType type) const {
  return activity_types_.count(type) != 0;
}

const libkineto::ITraceActivity* KilnTraceBuilder::linkedActivity(
    unsigned long long correlation_id) const {
  if (correlation_id == 0 || !linked_) {
    return nullptr;
  }
  // Kineto keys CPU activities by PyTorch's correlation id as int32.
  return linked_(static_cast<int32_t>(correlation_id));
}

int32_t KilnTraceBuilder::trackOf(int device, unsigned long long runtime_stream_id) {
  const auto key = std::make_pair(device, runtime_stream_id);
  auto it = tracks_.find(key);
  if (it != tracks_.end()) {
    return it->second;
  }
  const std::optional<c10::StreamId> torch_id =
      c10::kiln::streamIdOfRuntimeStream(static_cast<c10::DeviceIndex>(device), runtime_stream_id);
  int32_t track = 0;
  std::string name = "kiln:" + std::to_string(device);
  if (torch_id.has_value()) {
    track = static_cast<int32_t>(*torch_id);
    name += " stream " + std::to_string(track) + (track == 0 ? " (default)" : "");
  } else {
    track = kForeignStreamTrackBase + static_cast<int32_t>(runtime_stream_id);
    name += " runtime stream " + std::to_string(runtime_stream_id);
  }
  tracks_.emplace(key, track);
  trace_.streams.push_back(libkineto::ResourceInfo{track, track, device, name});
  return track;
}

KilnTrace KilnTraceBuilder::build(
    const std::vector<kilnActivityRecord>& records,
    libkineto::ActivityLogger& logger) {
  trace_.buffer = std::make_unique<libkineto::CpuTraceBuffer>();
  libkineto::CpuTraceBuffer& buffer = *trace_.buffer;
  buffer.span = libkineto::TraceSpan(capture_start_ns_, capture_end_ns_, "kiln");

  // A launch and the device work it enqueued share a correlation id; when
  // both are reported they get an ac2g flow (the trace's arrow, and
  // PyTorch's parent link from the work to its launch).
  std::unordered_set<unsigned long long> launched;
  std::unordered_set<unsigned long long> ran;
  for (const kilnActivityRecord& r : records) {
    const std::optional<ActivityType> type = activityTypeOf(r.kind);
    if (!type.has_value() || !wanted(*type)) {
      continue;
    }
    (r.kind == kilnActivityKindApi ? launched : ran).insert(r.correlationId);
  }

  // record_function ranges on the device: (device, track, range id) -> span.
  struct Range {
    int64_t start;
    int64_t end;
    const libkineto::ITraceActivity* cpu;
  };
  std::map<std::tuple<int, int32_t, unsigned long long>, Range> ranges;
  const bool want_ranges = wanted(ActivityType::GPU_USER_ANNOTATION);

  for (const kilnActivityRecord& r : records) {
    const std::optional<ActivityType> type = activityTypeOf(r.kind);
    if (!type.has_value() || !wanted(*type)) {
      continue;
    }
    buffer.emplace_activity(buffer.span, *type, std::string(r.name));
    libkineto::GenericTraceActivity& act = *buffer.activities.back();
    act.startTime = r.start + clock_offset_ns_;
    act.endTime = r.end + clock_offset_ns_;
    // PyTorch takes an activity's id as its own correlation id and matches
    // those of unlinked host events against CPU op ids; the runtime's ids live
    // in another number space, so they go to the metadata instead.
    act.id = 0;
    act.linked = linkedActivity(r.externalId);
    act.addMetadata("correlation", r.correlationId);
    const bool flow = launched.count(r.correlationId) != 0 && ran.count(r.correlationId) != 0;
    if (flow) {
      act.flow.id = static_cast<uint32_t>(r.correlationId);
      act.flow.type = libkineto::kLinkAsyncCpuGpu;
      act.flow.start = r.kind == kilnActivityKindApi;
    }
    if (r.kind == kilnActivityKindApi) {
      act.device = libkineto::processId();
      act.resource = static_cast<int32_t>(r.threadId);
      act.threadId = static_cast<int32_t>(r.threadId);
      if (r.device >= 0) {
        act.addMetadata("device", r.device);
      }
    } else {
      const int32_t track = trackOf(r.device, r.streamId);
      act.device = r.device;
      act.resource = track;
      act.threadId = track;
      act.addMetadata("device", r.device);
      act.addMetadata("stream", track);
      trace_.devices.insert(r.device);
      if (want_ranges && r.userExternalId != 0) {
        if (const libkineto::ITraceActivity* cpu = linkedActivity(r.userExternalId)) {
          const auto key = std::make_tuple(r.device, track, r.userExternalId);
          auto [it, fresh] = ranges.try_emplace(key, Range{act.startTime, act.endTime, cpu});
          if (!fresh) {
            it->second.start = std::min(it->second.start, act.startTime);
            it->second.end = std::max(it->second.end, act.endTime);
          }
        }
      }
    }
    if (r.bytes > 0) {
      act.addMetadata("bytes", r.bytes);
    }
    logger.handleActivity(act);
  }

  for (const auto& [key, range] : ranges) {
    const auto& [device, track, range_id] = key;
    buffer.emplace_activity(buffer.span, ActivityType::GPU_USER_ANNOTATION, range.cpu->name());
    libkineto::GenericTraceActivity& act = *buffer.activities.back();
    act.startTime = range.start;
    act.endTime = range.end;
    act.device = device;
    act.resource = track;
    act.threadId = track;
    // Carries the range's id (the trace shows it as "External id") but is not
    // linked, as Kineto does for CUDA: PyTorch would otherwise add the whole
    // span to the range's device time on top of the work inside it.
    act.id = static_cast<int32_t>(range_id);
    logger.handleActivity(act);
  }
  return std::move(trace_);
}

} // namespace at::kiln::profiler
