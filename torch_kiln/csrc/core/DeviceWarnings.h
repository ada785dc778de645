// DeviceWarnings.h — warnings raised by kernels on stream workers reach the
// program at its next synchronization, through its own warning handler.
//
// A CPU kernel's TORCH_WARN (say, std() with too few degrees of freedom) runs
// on a stream worker, where nobody would see it except as a line on stderr.
// Tasks therefore collect warnings (DeviceWarningCollector) into a process
// queue, and the synchronizing calls (stream and device synchronize, copies
// to the host, item()) re-emit them on the calling thread, where PyTorch
// turns them into Python warnings (warnings.catch_warnings sees them).
//
// Thread-safety: all functions are thread-safe.
#pragma once

#include <c10/util/Exception.h>

namespace c10::kiln {

// Installed for the duration of a task on a worker thread.
class DeviceWarningCollector final : public c10::WarningHandler {
 public:
  DeviceWarningCollector() : guard_(this) {}
  void process(const c10::Warning& warning) override;

 private:
  c10::WarningUtils::WarningHandlerGuard guard_;
};

// Re-emits the queued warnings through the calling thread's handler.
void flushDeviceWarnings();

} // namespace c10::kiln
