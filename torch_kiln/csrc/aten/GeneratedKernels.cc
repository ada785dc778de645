#include "aten/GeneratedKernels.h"

#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>

#include "aten/KilnTask.h"
#include "aten/OpTracking.h"
#include "core/FailedResults.h"
#include "core/KilnException.h"

namespace at::kiln {
namespace {

// What Inductor's C++ kernels say for an indirect index out of range
// (torch_kiln/compiler/inductor/kernels.py, INDEX_CHECK_MARKER).
constexpr const char* kIndexCheckMarker = "index out of bounds:";

std::optional<std::string> firstFailedInput(const std::vector<const void*>& reads) {
  for (const void* data : reads) {
    if (auto reason = c10::kiln::failedResultReason(data)) {
      return reason;
    }
  }
  return std::nullopt;
}

void markWritten(const std::vector<const void*>& writes, const std::string& reason) {
  for (const void* data : writes) {
    c10::kiln::markFailedResult(data, reason);
  }
}

struct GeneratedKernelTask final : TaskBody {
  explicit GeneratedKernelTask(GeneratedKernelCall c) : call(std::move(c)) {}

  void run() override {
    // An input marked after the launch (a failure on another stream ordered
    // before this kernel by an event): do not compute from memory that holds
    // no result; pass the mark on instead (Note [Results of failed kernels]).
    if (c10::kiln::anyFailedResults()) {
      if (auto reason = firstFailedInput(call.read_storages)) {
        markWritten(call.written_storages, *reason);
        return;
      }
    }
    try {
      call.entry(call.packed.data());
    } catch (const std::exception& e) {
      const std::string message = c10::kiln::kernelErrorMessageOf(e);
      markWritten(call.written_storages, std::string(call.name) + ": " + message);
      // Inductor's indirect-index check is a plain TORCH_CHECK; eager
      // indexing raises IndexError for the same bad index, eager gather and
      // scatter RuntimeError (Note [Index errors of compiled kernels] in
      // torch_kiln/compiler/inductor/kernels.py).
      if (call.index_check_raises_index_error &&
          message.find(kIndexCheckMarker) != std::string::npos &&
          dynamic_cast<const c10::IndexError*>(&e) == nullptr) {
        TORCH_CHECK_INDEX(false, message);
      }
      throw; // KilnTask makes it the stream's sticky error, keeping its type.
    }
  }

  std::string describe() const override {
    return call.description;
  }

  void skipped() override {
    markWritten(call.written_storages,
                std::string(call.name) +
                    " was skipped after an earlier kernel on its stream failed");
  }

  GeneratedKernelCall call;
};

} // namespace

const char* internKernelName(const std::string& name) {
  // Kernel names are few (one per generated kernel) and tasks may outlive the
  // Python object that launched them, so names are kept for the process.
  static std::mutex mutex;
  static auto* names = new std::unordered_set<std::string>();
  std::lock_guard<std::mutex> lock(mutex);
  return names->insert(name).first->c_str();
}

void launchGeneratedKernel(const c10::kiln::KilnStream& stream, GeneratedKernelCall call) {
  TORCH_CHECK(call.entry != nullptr, "kiln: a compiled kernel was launched without an entry point");
  TORCH_CHECK(call.name != nullptr, "kiln: a compiled kernel was launched without a name");
  // Inputs marked by now make the outputs invalid at once, as for eager
  // kernels (KernelLaunch::launch), so reading them raises even before the
  // task ran.
  if (c10::kiln::anyFailedResults()) {
    if (auto reason = firstFailedInput(call.read_storages)) {
      markWritten(call.written_storages, *reason);
    }
  }
  const char* name = call.name;
  if (call.counted_as_op) {
    recordExecutedOp(name);
  }
  launchTaskBody(stream, name, std::make_unique<GeneratedKernelTask>(std::move(call)));
}

} // namespace at::kiln
