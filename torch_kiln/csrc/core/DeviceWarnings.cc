#include "core/DeviceWarnings.h"

#include <atomic>
#include <mutex>
#include <vector>

namespace c10::kiln {
namespace {

struct Queue {
  std::mutex mutex;
  std::vector<c10::Warning> warnings;
  std::atomic<bool> pending{false};
};

Queue& queue() {
  static auto* instance = new Queue(); // leaked: workers may warn at exit
  return *instance;
}

} // namespace

void DeviceWarningCollector::process(const c10::Warning& warning) {
  auto& q = queue();
  std::lock_guard<std::mutex> lock(q.mutex);
  q.warnings.push_back(warning);
  q.pending.store(true, std::memory_order_release);
}

void flushDeviceWarnings() {
  auto& q = queue();
  if (!q.pending.load(std::memory_order_acquire)) {
    return;
  }
  std::vector<c10::Warning> warnings;
  {
    std::lock_guard<std::mutex> lock(q.mutex);
    warnings.swap(q.warnings);
    q.pending.store(false, std::memory_order_release);
  }
  c10::WarningHandler* handler = c10::WarningUtils::get_warning_handler();
  for (const auto& warning : warnings) {
    handler->process(warning);
  }
}

} // namespace c10::kiln
