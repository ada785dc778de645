#include "aten/KilnTask.h"

#include <exception>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "core/DeviceWarnings.h"
#include "core/KilnException.h"

namespace at::kiln {
namespace {

struct TaskRecord {
  std::unique_ptr<TaskBody> body;
};

kilnError_t runTask(void* user_data) {
  auto* record = static_cast<TaskRecord*>(user_data);
  try {
    prepareWorkerThread();
    c10::kiln::DeviceWarningCollector warnings;
    record->body->run();
    return kilnSuccess;
  } catch (const c10::Error& e) {
    std::string message = e.what_without_backtrace();
    const std::string context = record->body->describe();
    if (!context.empty()) {
      message = context + ": " + message;
    }
    kilnTaskSetErrorMessage(message.c_str());
  } catch (const std::exception& e) {
    std::string message = e.what();
    const std::string context = record->body->describe();
    if (!context.empty()) {
      message = context + ": " + message;
    }
    kilnTaskSetErrorMessage(message.c_str());
  } catch (...) {
    kilnTaskSetErrorMessage("unknown C++ exception");
  }
  return kilnErrorLaunchFailure;
}

void releaseTask(void* user_data) {
  delete static_cast<TaskRecord*>(user_data);
}

} // namespace

void prepareWorkerThread() {
  // Stream workers are plain threads: give them PyTorch's intra-op thread
  // settings once, as PyTorch does for its own pool threads.
  thread_local bool prepared = [] {
    at::init_num_threads();
    return true;
  }();
  (void)prepared;
}

void launchTaskBody(const c10::kiln::KilnStream& stream, const char* name,
                    std::unique_ptr<TaskBody> body) {
  auto* record = new TaskRecord{std::move(body)};
  KILN_CHECK(kilnLaunchTask(stream.stream(), &runTask, &releaseTask, record, name));
}

} // namespace at::kiln
