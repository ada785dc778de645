#include "aten/OpTracking.h"

#include <mutex>

namespace at::kiln {
namespace {

struct Counters {
  std::mutex mutex;
  std::unordered_map<std::string, int64_t> executed;
  std::unordered_map<std::string, int64_t> sync;
};

Counters& counters() {
  static Counters* instance = new Counters(); // leaked: used at exit
  return *instance;
}

std::string nameOf(const c10::OperatorName& op) {
  return op.overload_name.empty() ? op.name : op.name + "." + op.overload_name;
}

} // namespace

void recordExecutedOp(const c10::OperatorName& op) {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.executed[nameOf(op)]++;
}

void recordExecutedOp(const char* name) {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.executed[name]++;
}

void recordSyncOp(const c10::OperatorName& op) {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.sync[nameOf(op)]++;
}

void recordSyncOp(const char* name) {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.sync[name]++;
}

std::unordered_map<std::string, int64_t> executedOps() {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.executed;
}

std::unordered_map<std::string, int64_t> syncOps() {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.sync;
}

void clearOpTracking() {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.executed.clear();
  c.sync.clear();
}

} // namespace at::kiln
