#include "aten/KilnTask.h"

#include <pthread.h>

#include <exception>
#include <optional>
#include <string_view>

#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include "core/DeviceWarnings.h"
#include "core/KilnGraph.h"
#include "core/KilnException.h"

namespace at::kiln {
namespace {

struct TaskRecord {
  std::unique_ptr<TaskBody> body;
  int threads; // Note [Intra-op threads of kiln kernels]
  bool inference_mode; // Note [Kiln tasks run in the issuer's inference and grad mode]
  bool grad_mode; // the same Note
  bool ran = false;
  bool captured = false; // recorded into a kiln graph: released unrun is no skip
};

kilnError_t runTask(void* user_data) {
  auto* record = static_cast<TaskRecord*>(user_data);
  record->ran = true;
  try {
    prepareWorkerThread(record->threads);
    c10::kiln::DeviceWarningCollector warnings;
    std::optional<c10::InferenceMode> inference_mode;
    if (record->inference_mode) {
      inference_mode.emplace();
    }
    const c10::AutoGradMode grad_mode(record->grad_mode);
    record->body->run();
    return kilnSuccess;
  } catch (const std::exception& e) {
    // Note [Kernel errors keep their type]
    kilnTaskSetErrorClass(static_cast<int>(c10::kiln::kernelErrorClassOf(e)));
    std::string message = c10::kiln::kernelErrorMessageOf(e);
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
  auto* record = static_cast<TaskRecord*>(user_data);
  if (!record->ran && !record->captured) {
    record->body->skipped();
  }
  delete record;
}

} // namespace

namespace {

// Whether the calling thread is one of autograd's device threads, which
// PyTorch names "pt_autograd_<device>" (torch/csrc/autograd/engine.cpp).
bool isAutogradDeviceThread() {
  char name[16] = {};
  if (pthread_getname_np(pthread_self(), name, sizeof(name)) != 0) {
    return false;
  }
  return std::string_view(name).starts_with("pt_autograd_");
}

} // namespace

int issuingThreadCount() {
  // Note [Intra-op threads of kiln kernels]: backward kernels.
  static thread_local const bool autograd_device_thread = isAutogradDeviceThread();
  if (autograd_device_thread) {
    at::init_num_threads();
  }
  return at::get_num_threads();
}

void prepareWorkerThread(int threads) {
  // Stream workers are plain threads: ATen's lazy per-thread set-up first
  // (as for PyTorch's own pool threads), then the issuing thread's count.
  thread_local int current = [] {
    at::init_num_threads();
    return at::get_num_threads();
  }();
  if (threads != current && threads > 0) {
    at::set_num_threads(threads);
    current = threads;
  }
}

void launchTaskBody(const c10::kiln::KilnStream& stream, const char* name,
                    std::unique_ptr<TaskBody> body) {
  auto* record =
      new TaskRecord{std::move(body), issuingThreadCount(), c10::InferenceMode::is_enabled(),
                     c10::GradMode::is_enabled()};
  record->captured =
      C10_UNLIKELY(c10::kiln::anyCaptureUnderway()) && c10::kiln::isStreamCapturing(stream);
  KILN_CHECK(kilnLaunchTask(stream.stream(), &runTask, &releaseTask, record, name));
}

} // namespace at::kiln
