#include "aten/OpTracking.h"

#include "core/KilnFunctions.h"
#include "core/KilnGraph.h"

#include <mutex>

namespace at::kiln {

namespace {

// Counts keyed by a stable pointer (the operator's name inside its schema, or
// a string literal), so counting costs a pointer hash and an increment; the
// name string is built once, at an op's first appearance.
struct Counter {
  std::string name;
  int64_t count = 0;
};

struct Counters {
  std::mutex mutex;
  std::unordered_map<const void*, Counter> executed;
  std::unordered_map<const void*, Counter> sync;
};

Counters& counters() {
  static Counters* instance = new Counters(); // leaked: used at exit
  return *instance;
}

std::string nameOf(const c10::OperatorName& op) {
  return op.overload_name.empty() ? op.name : op.name + "." + op.overload_name;
}

template <typename MakeName>
void bump(std::unordered_map<const void*, Counter>& table, const void* key, MakeName&& make_name) {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  auto [it, inserted] = table.try_emplace(key);
  if (inserted) {
    it->second.name = make_name();
  }
  it->second.count++;
}

std::unordered_map<std::string, int64_t> snapshot(const std::unordered_map<const void*, Counter>& table) {
  std::unordered_map<std::string, int64_t> result;
  for (const auto& [key, counter] : table) {
    result[counter.name] += counter.count; // an op may be counted under two keys
  }
  return result;
}

} // namespace

void recordExecutedOp(const c10::OperatorName& op) {
  bump(counters().executed, &op, [&] { return nameOf(op); });
}

void recordExecutedOp(const char* name) {
  bump(counters().executed, name, [&] { return std::string(name); });
}

void recordSyncOp(const c10::OperatorName& op) {
  if (C10_UNLIKELY(c10::kiln::anyCaptureUnderway())) {
    c10::kiln::refuseWhileCapturing(nameOf(op).c_str(), c10::kiln::CaptureRefusal::HostRead);
  }
  if (C10_UNLIKELY(c10::kiln::syncDebugModeIsOn())) {
    c10::kiln::warn_or_error_on_sync(nameOf(op).c_str());
  }
  bump(counters().sync, &op, [&] { return nameOf(op); });
}

void recordSyncOp(const char* name) {
  if (C10_UNLIKELY(c10::kiln::anyCaptureUnderway())) {
    c10::kiln::refuseWhileCapturing(name, c10::kiln::CaptureRefusal::HostRead);
  }
  if (C10_UNLIKELY(c10::kiln::syncDebugModeIsOn())) {
    c10::kiln::warn_or_error_on_sync(name);
  }
  bump(counters().sync, name, [&] { return std::string(name); });
}

void recordLayoutCheck(const c10::OperatorName& op) {
  if (C10_UNLIKELY(c10::kiln::anyCaptureUnderway())) {
    c10::kiln::refuseWhileCapturing(nameOf(op).c_str(), c10::kiln::CaptureRefusal::LayoutCheck);
  }
  // Keyed by another member's address, so it counts apart from recordSyncOp.
  bump(counters().sync, &op.overload_name, [&] { return nameOf(op) + " (layout check)"; });
}

std::unordered_map<std::string, int64_t> executedOps() {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  return snapshot(c.executed);
}

std::unordered_map<std::string, int64_t> syncOps() {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  return snapshot(c.sync);
}

void clearOpTracking() {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.executed.clear();
  c.sync.clear();
}

} // namespace at::kiln
