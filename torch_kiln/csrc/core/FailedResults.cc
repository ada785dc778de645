#include "core/FailedResults.h"

#include "core/KilnFunctions.h"

#include <atomic>
#include <mutex>
#include <unordered_map>

#include <c10/util/Exception.h>

namespace c10::kiln {
namespace {

struct Registry {
  std::mutex mutex;
  std::unordered_map<const void*, std::string> reasons;
  std::atomic<size_t> count{0};
};

Registry& registry() {
  static auto* instance = new Registry(); // leaked: workers may mark at exit
  return *instance;
}

} // namespace

void markFailedResult(const void* data, const std::string& reason) {
  if (data == nullptr) {
    return;
  }
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.reasons.try_emplace(data, reason); // the first (root) reason wins
  r.count.store(r.reasons.size(), std::memory_order_relaxed);
}

std::optional<std::string> failedResultReason(const void* data) {
  auto& r = registry();
  if (r.count.load(std::memory_order_relaxed) == 0 || data == nullptr) {
    return std::nullopt;
  }
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.reasons.find(data);
  if (it == r.reasons.end()) {
    return std::nullopt;
  }
  return it->second;
}

void clearFailedResult(const void* data) {
  auto& r = registry();
  if (r.count.load(std::memory_order_relaxed) == 0 || data == nullptr) {
    return;
  }
  std::lock_guard<std::mutex> lock(r.mutex);
  r.reasons.erase(data);
  r.count.store(r.reasons.size(), std::memory_order_relaxed);
}

bool anyFailedResults() {
  return registry().count.load(std::memory_order_relaxed) != 0;
}

void raiseFailedResult(const std::string& reason, c10::DeviceIndex device) {
  device_synchronize(device); // raises the failure if no synchronization has yet
  TORCH_CHECK(false,
              "The values of this kiln tensor were never computed: the device kernel that should "
              "have written them failed (", reason,
              "). The failure itself is raised by a synchronization of the stream it ran on; "
              "recompute the tensor.");
}

void checkNotFailedResult(const void* data, c10::DeviceIndex device) {
  if (const auto reason = failedResultReason(data)) {
    raiseFailedResult(*reason, device);
  }
}

} // namespace c10::kiln
