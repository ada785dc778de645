// KilnTraceBuilder.h — turns the runtime's activity records into Kineto
// activities (step 5 of Note [Kiln profiling data flow]).
//
// Mapping (record kind -> Kineto activity type, chrome-trace place):
//   Task                   CONCURRENT_KERNEL    pid = device, tid = stream
//   Memcpy* (HtoD, DtoH,   GPU_MEMCPY           pid = device, tid = stream
//     DtoD, PtoP, HtoH)
//   Memset                 GPU_MEMSET           pid = device, tid = stream
//   Api (kilnLaunchTask,   PRIVATEUSE1_RUNTIME  pid = process, tid = thread
//     kilnMemcpy*, syncs)
//   device work inside a   GPU_USER_ANNOTATION  pid = device, tid = stream,
//     record_function                           from the first to the last
//                                               work of the range there
//   EventRecord/EventWait  not reported (gaps on the stream track show waits)
// "stream" is the torch stream id (0 = the device's default stream), so the
// tracks match torch.Stream.stream_id. Activity types the profile did not
// request are left out. Work and launches are linked to the CPU op whose
// correlation id they carry; ranges carry the range's id but stay unlinked,
// as Kineto does for CUDA, so key_averages() does not add the span to the
// range's device time on top of the work inside it.
//
// Thread-safety: none needed; one builder per processTrace call.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include <IActivityProfiler.h>
#include <libkineto.h>
#include <kiln/runtime.h>

namespace at::kiln::profiler {

// Host wall-clock ns (what Kineto and PyTorch's CPU ops use) minus kiln
// device-clock ns, measured with an uncertainty of `error_ns`.
struct ClockOffset {
  int64_t offset_ns = 0;
  int64_t error_ns = -1; // -1: not measured
};

// Reads both clocks a few times and keeps the tightest bracket.
ClockOffset sampleClockOffset();
// The mean of two measurements (start and end of a profile), so slow drift
// between the clocks is split; falls back to whichever was measured.
int64_t averageOffset(const ClockOffset& a, const ClockOffset& b);

// What a session hands to Kineto.
struct KilnTrace {
  std::unique_ptr<libkineto::CpuTraceBuffer> buffer;
  std::vector<libkineto::ResourceInfo> streams; // one track name per stream used
  std::set<int> devices;                        // kiln devices that did work
};

class KilnTraceBuilder {
 public:
  // `linked` maps a PyTorch correlation id to its CPU activity (may be null);
  // `capture_*_ns` is the profiled window on the host clock.
  KilnTraceBuilder(
      std::set<libkineto::ActivityType> activity_types,
      int64_t clock_offset_ns,
      libkineto::getLinkedActivityCallback linked,
      int64_t capture_start_ns,
      int64_t capture_end_ns);

  // Builds the activities of `records` and passes each to `logger` (which
  // keeps pointers to them: the returned buffer owns them and must outlive
  // the logger's use, as Kineto arranges through getTraceBuffer()).
  KilnTrace build(const std::vector<kilnActivityRecord>& records, libkineto::ActivityLogger& logger);

 private:
  bool wanted(libkineto::ActivityType type) const;
  const libkineto::ITraceActivity* linkedActivity(unsigned long long correlation_id) const;
  // The chrome-trace tid of a stream: its torch stream id when known.
  int32_t trackOf(int device, unsigned long long runtime_stream_id);

  std::set<libkineto::ActivityType> activity_types_;
  int64_t clock_offset_ns_;
  libkineto::getLinkedActivityCallback linked_;
  int64_t capture_start_ns_;
  int64_t capture_end_ns_;
  std::map<std::pair<int, unsigned long long>, int32_t> tracks_; // (device, runtime id) -> tid
  KilnTrace trace_;
};

} // namespace at::kiln::profiler
