#include "aten/KernelLaunch.h"

#include <exception>
#include <mutex>
#include <optional>
#include <string_view>
#include <utility>

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "aten/KilnTask.h"
#include "aten/TensorAliases.h"
#include "core/DeviceWarnings.h"
#include "core/FailedResults.h"
#include "core/KilnGraph.h"
#include "core/KilnException.h"

namespace at::kiln {
namespace {

// Finished launch records, waiting to be reused (Note [Kernel launches are
// built on the worker]). Records beyond kMaxPooled are deleted.
constexpr size_t kMaxPooled = 4096;

struct LaunchPool {
  std::mutex mutex;
  std::vector<KernelLaunch*> records;
};

LaunchPool& pool() {
  static auto* instance = new LaunchPool(); // leaked: workers may release at exit
  return *instance;
}

} // namespace

void TensorDescriptor::assign(const at::Tensor& tensor) {
  defined = tensor.defined();
  host_tensor = at::Tensor();
  if (!defined) {
    return;
  }
  if (tensor.device().is_cpu()) {
    host_tensor = tensor; // a host scalar; the executor made a private copy
    return;
  }
  const c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  storage_key = storage;
  tensor_key = tensor.unsafeGetTensorImpl();
  data = const_cast<c10::StorageImpl*>(storage)->mutable_data();
  nbytes = storage->nbytes();
  dtype = tensor.scalar_type();
  storage_offset = tensor.storage_offset();
  sizes.assign(tensor.sizes().begin(), tensor.sizes().end());
  strides.assign(tensor.strides().begin(), tensor.strides().end());
  is_conj = tensor.is_conj();
  is_neg = tensor.is_neg();
}

bool TensorDescriptor::coversStorage() const {
  if (!defined || host_tensor.defined() || storage_offset != 0) {
    return false;
  }
  int64_t expected = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    if (sizes[i] != 1 && strides[i] != expected) {
      return false;
    }
    expected *= sizes[i];
  }
  return static_cast<size_t>(expected) * c10::elementSize(dtype) == nbytes;
}

std::string& lastKernelFailureOnThread() {
  thread_local std::string last_failure;
  return last_failure;
}

KernelLaunch* KernelLaunch::acquire() {
  KernelLaunch* record = nullptr;
  {
    auto& p = pool();
    std::lock_guard<std::mutex> lock(p.mutex);
    if (!p.records.empty()) {
      record = p.records.back();
      p.records.pop_back();
    }
  }
  if (record == nullptr) {
    return new KernelLaunch();
  }
  record->clear();
  return record;
}

void KernelLaunch::clear() {
  if (cleared_) {
    return;
  }
  op_.reset();
  info_ = nullptr;
  arguments_.clear();
  for (size_t i = 0; i < used_descriptors_; ++i) {
    descriptors_[i].host_tensor = at::Tensor();
  }
  used_descriptors_ = 0;
  first_output_ = 0;
  output_count_ = 0;
  cleared_ = true;
  ran_ = false;
  captured_ = false;
}

TensorDescriptor& KernelLaunch::nextDescriptor() {
  if (used_descriptors_ == descriptors_.size()) {
    descriptors_.emplace_back();
  }
  return descriptors_[used_descriptors_++];
}

void KernelLaunch::setOperator(const c10::OperatorHandle& op, const OpSchemaInfo& info) {
  cleared_ = false;
  op_ = op;
  info_ = &info;
}

void KernelLaunch::addArgument(const c10::IValue& value, ArgKind kind, bool written,
                               bool overwritten) {
  Argument argument;
  argument.kind = kind;
  argument.first = static_cast<uint32_t>(used_descriptors_);
  switch (kind) {
    case ArgKind::Tensor:
    case ArgKind::OptionalTensor:
      if (value.isTensor()) {
        TensorDescriptor& d = nextDescriptor();
        d.assign(value.toTensor());
        d.written = written;
        d.overwritten = overwritten;
        argument.count = 1;
      }
      break;
    case ArgKind::TensorList:
    case ArgKind::OptionalTensorList:
      for (const c10::IValue& element : value.toListRef()) {
        TensorDescriptor& d = nextDescriptor();
        if (element.isTensor()) {
          d.assign(element.toTensor());
        } else {
          d.assign(at::Tensor());
        }
        d.written = written;
        d.overwritten = overwritten;
        argument.count++;
      }
      break;
    default:
      argument.value = value;
  }
  arguments_.push_back(std::move(argument));
}

void KernelLaunch::addOutput(const at::Tensor& output) {
  if (output_count_ == 0) {
    first_output_ = static_cast<uint32_t>(used_descriptors_);
  }
  TensorDescriptor& d = nextDescriptor();
  d.assign(output);
  d.written = true;
  d.overwritten = true;
  output_count_++;
}

namespace {

// Whether the host tensor `t` has the layout the kiln tensor described by
// `d` has (dtype, sizes, strides of non-trivial dimensions, conj/neg bits).
bool matchesDescriptor(const at::Tensor& t, const TensorDescriptor& d) {
  if (t.scalar_type() != d.dtype || !t.sizes().equals(d.sizes) || t.is_conj() != d.is_conj ||
      t.is_neg() != d.is_neg) {
    return false;
  }
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (t.size(i) > 1 && t.stride(i) != d.strides[static_cast<size_t>(i)]) {
      return false;
    }
  }
  return true;
}

// Note [Out= arguments are resized at the call]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An out= argument gets its final layout on the calling thread: the meta
// kernel resizes its meta image (warning there, as CPU does, if a tensor
// with elements changes shape) and the executor gives the kiln tensor that
// layout before launching. When the CPU out= kernel then runs on the worker,
// PyTorch's structured wrapper runs the op's meta function again on the
// host alias, and some meta functions resize the output through an
// intermediate shape: mse_loss's (like smooth_l1_loss's and huber_loss's)
// sizes it as the elementwise loss, then resize_({}) for a reduction. On an
// output that already has its final shape, [] (one element), the first step
// warns "An output with one or more elements was resized since it had shape
// []". CPU never shows it for F.mse_loss, whose functional kernel allocates
// its own output; kiln reaches the out= kernel because PyTorch's
// CompositeExplicitAutogradNonFunctional wrapper of a structured op
// preallocates the output and calls the out= variant. So warnings about
// resizing an out= argument are dropped on the worker: the user-facing one
// was given at the call.
constexpr std::string_view kOutputResizedWarning = "An output with one or more elements was resized";

class OutResizeWarningFilter final : public c10::WarningHandler {
 public:
  OutResizeWarningFilter() : next_(c10::WarningUtils::get_warning_handler()), guard_(this) {}
  void process(const c10::Warning& warning) override {
    if (std::string_view(warning.msg()).substr(0, kOutputResizedWarning.size()) !=
        kOutputResizedWarning) {
      next_->process(warning);
    }
  }

 private:
  c10::WarningHandler* next_; // set before guard_ installs this handler
  c10::WarningUtils::WarningHandlerGuard guard_;
};

// The meta kernel's layout was not the CPU kernel's: from now on this op
// takes its layouts from CPU runs (Note [Meta layouts and CPU layouts]).
void learnLayoutsFromCpu(const OpSchemaInfo& info) {
  auto& mutable_info = const_cast<OpSchemaInfo&>(info);
  if (!mutable_info.layouts_from_cpu.exchange(true)) {
    mutable_info.layout_generation.fetch_add(1);
  }
}

} // namespace

void KernelLaunch::run() {
  TensorAliaser aliaser(c10::kCPU);
  auto alias = [&](uint32_t index) { return aliaser.alias(descriptors_[index]); };
  torch::jit::Stack stack;
  stack.reserve(arguments_.size());
  // Host aliases of out= arguments, to check after the kernel what it did
  // with them (see below).
  c10::SmallVector<std::pair<uint32_t, at::Tensor>, 2> out_arguments;
  for (size_t a = 0; a < arguments_.size(); ++a) {
    const Argument& argument = arguments_[a];
    switch (argument.kind) {
      case ArgKind::Tensor:
        stack.emplace_back(argument.count == 1 ? alias(argument.first) : at::Tensor());
        if (argument.count == 1 && info_->arg_is_out[a]) {
          out_arguments.emplace_back(argument.first, stack.back().toTensor());
        }
        break;
      case ArgKind::OptionalTensor:
        if (argument.count == 1 && descriptors_[argument.first].defined) {
          stack.emplace_back(alias(argument.first));
        } else {
          stack.emplace_back();
        }
        break;
      case ArgKind::TensorList: {
        c10::List<at::Tensor> list;
        list.reserve(argument.count);
        for (uint32_t i = 0; i < argument.count; ++i) {
          list.push_back(alias(argument.first + i));
        }
        stack.emplace_back(std::move(list));
        break;
      }
      case ArgKind::OptionalTensorList: {
        c10::List<std::optional<at::Tensor>> list;
        list.reserve(argument.count);
        for (uint32_t i = 0; i < argument.count; ++i) {
          const uint32_t index = argument.first + i;
          list.push_back(descriptors_[index].defined ? std::optional<at::Tensor>(alias(index))
                                                     : std::nullopt);
        }
        stack.emplace_back(std::move(list));
        break;
      }
      default:
        stack.push_back(argument.value);
    }
  }
  {
    std::optional<OutResizeWarningFilter> filter;
    if (!out_arguments.empty()) {
      filter.emplace(); // Note [Out= arguments are resized at the call]
    }
    op_->redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &stack);
  }

  // An out= kernel may have rebound its output (returned another tensor) or
  // re-strided it in place: then the kiln tensor's memory does not hold the
  // result in the kiln tensor's layout. Copy the result into place.
  for (size_t k = 0; k < out_arguments.size(); ++k) {
    const auto& [index, out_alias] = out_arguments[k];
    const at::Tensor returned =
        k < stack.size() && stack[k].isTensor() ? stack[k].toTensor() : out_alias;
    const TensorDescriptor& d = descriptors_[index];
    const bool intact = returned.unsafeGetTensorImpl() == out_alias.unsafeGetTensorImpl() &&
        out_alias.storage_offset() == d.storage_offset &&
        out_alias.strides().equals(d.strides) && matchesDescriptor(out_alias, d);
    if (!intact) {
      const at::Tensor result = returned.is_alias_of(out_alias) ? returned.clone() : returned;
      alias(index).copy_(result);
    }
  }

  // Copy fresh results into the preallocated outputs, in return order.
  uint32_t next = 0;
  auto copyInto = [&](const c10::IValue& result) {
    const uint32_t index = first_output_ + next++;
    const TensorDescriptor& d = descriptors_[index];
    if (!result.isTensor() || !result.toTensor().defined()) {
      TORCH_CHECK(!d.defined, "the kernel returned no tensor where its meta kernel declared one");
      return;
    }
    const at::Tensor& value = result.toTensor();
    TORCH_CHECK(d.defined, "the kernel returned a tensor where its meta kernel declared none");
    if (!matchesDescriptor(value, d)) {
      learnLayoutsFromCpu(*info_);
      TORCH_CHECK(value.sizes().equals(d.sizes), "result of shape ", value.sizes(),
                  " where the meta kernel declared ", c10::IntArrayRef(d.sizes),
                  " (this op's next calls take their layouts from the CPU kernel)");
    }
    alias(index).copy_(value);
  };
  for (size_t r = 0; r < info_->returns.size(); ++r) {
    if (info_->returns[r].kind != ReturnKind::Fresh) {
      continue;
    }
    if (info_->returns[r].is_list) {
      for (const c10::IValue& element : stack[r].toListRef()) {
        copyInto(element);
      }
    } else {
      copyInto(stack[r]);
    }
  }
}

void appendInputDescription(std::string& text, c10::ScalarType dtype, c10::IntArrayRef sizes) {
  text += text.empty() ? "inputs (" : ", ";
  text += c10::toString(dtype);
  text += "[";
  for (size_t k = 0; k < sizes.size(); ++k) {
    text += (k ? ", " : "") + std::to_string(sizes[k]);
  }
  text += "]";
}

std::string finishInputDescription(std::string text) {
  return text.empty() ? "inputs ()" : text + ")";
}

// "inputs (Float[4, 3], Long[2])" — the runtime prefixes the op's name.
std::string KernelLaunch::describe() const {
  std::string text;
  for (size_t a = 0; a < arguments_.size(); ++a) {
    if (info_->arg_is_out[a]) {
      continue; // outputs, not inputs
    }
    const Argument& argument = arguments_[a];
    for (uint32_t i = argument.first; i < argument.first + argument.count; ++i) {
      const TensorDescriptor& d = descriptors_[i];
      if (!d.defined) {
        continue;
      }
      if (d.host_tensor.defined()) {
        appendInputDescription(text, d.host_tensor.scalar_type(), d.host_tensor.sizes());
      } else {
        appendInputDescription(text, d.dtype, d.sizes);
      }
    }
  }
  return finishInputDescription(std::move(text));
}

void KernelLaunch::markWrittenAsFailed(const std::string& reason) const {
  for (size_t i = 0; i < used_descriptors_; ++i) {
    const TensorDescriptor& d = descriptors_[i];
    if (d.written && d.defined && !d.host_tensor.defined()) {
      c10::kiln::markFailedResult(d.data, reason);
    }
  }
}

std::optional<std::string> KernelLaunch::firstFailedInput() const {
  for (size_t i = 0; i < used_descriptors_; ++i) {
    const TensorDescriptor& d = descriptors_[i];
    if (d.defined && !d.written && !d.host_tensor.defined()) {
      if (auto reason = c10::kiln::failedResultReason(d.data)) {
        return reason;
      }
    }
  }
  return std::nullopt;
}

void KernelLaunch::propagateFailedResults() const {
  const std::string& name = info_->schema->name();
  const bool overwrites = name == "aten::fill_" || name == "aten::zero_" || name == "aten::copy_";
  const std::optional<std::string> invalid_input = firstFailedInput();
  if (invalid_input) {
    markWrittenAsFailed(*invalid_input);
    return;
  }
  if (overwrites) {
    for (size_t i = 0; i < used_descriptors_; ++i) {
      const TensorDescriptor& d = descriptors_[i];
      if (d.written && d.coversStorage()) {
        c10::kiln::clearFailedResult(d.data);
      }
    }
  }
}

void KernelLaunch::clearOverwrittenFailedResults() const {
  for (size_t i = 0; i < used_descriptors_; ++i) {
    const TensorDescriptor& d = descriptors_[i];
    if (!d.overwritten || !d.defined || d.host_tensor.defined()) {
      continue;
    }
    const bool fresh = i >= first_output_ && i < first_output_ + output_count_;
    if (fresh || d.coversStorage()) {
      c10::kiln::clearFailedResult(d.data);
    }
  }
}

kilnError_t KernelLaunch::runTask(void* self) {
  auto* record = static_cast<KernelLaunch*>(self);
  record->ran_ = true;
  std::string message;
  try {
    // An input marked failed after this kernel was launched (by a kernel on
    // another stream, ordered before this one by an event): the results
    // would be computed from memory that holds none, so mark them instead,
    // as the launch does for inputs marked by then (Note [Results of failed
    // kernels]).
    if (c10::kiln::anyFailedResults()) {
      if (auto reason = record->firstFailedInput()) {
        record->markWrittenAsFailed(*reason);
        return kilnSuccess;
      }
    }
    prepareWorkerThread(record->threads_);
    c10::kiln::DeviceWarningCollector warnings;
    const c10::AutoGradMode grad_mode(record->grad_mode_);
    record->run();
    if (c10::kiln::anyFailedResults()) {
      // What this kernel wrote whole now holds valid results, whatever was
      // marked on that memory before: an earlier failed graph replay's
      // outputs, an out= tensor whose earlier kernel failed, or a block
      // reused while a skipped kernel's mark was still to come (Note
      // [Results of failed kernels]). In stream order, so after those marks.
      record->clearOverwrittenFailedResults();
    }
    return kilnSuccess;
  } catch (const std::exception& e) {
    // Note [Kernel errors keep their type]
    kilnTaskSetErrorClass(static_cast<int>(c10::kiln::kernelErrorClassOf(e)));
    message = c10::kiln::kernelErrorMessageOf(e);
  } catch (...) {
    message = "unknown C++ exception";
  }
  message = record->describe() + ": " + message;
  kilnTaskSetErrorMessage(message.c_str());
  lastKernelFailureOnThread() = record->info_->schema->name() + ": " + message;
  record->markWrittenAsFailed(lastKernelFailureOnThread());
  return kilnErrorLaunchFailure;
}

void KernelLaunch::releaseTask(void* self) {
  auto* record = static_cast<KernelLaunch*>(self);
  // A captured record is released when its graph is destroyed, replayed
  // or not: that is no skip (Note [Kiln graphs]).
  if (!record->ran_ && !record->captured_) {
    record->markWrittenAsFailed(
        record->info_->schema->name() + " was skipped after an earlier kernel on its stream failed" +
        (lastKernelFailureOnThread().empty() ? std::string() : ": " + lastKernelFailureOnThread()));
  }
  auto& p = pool();
  {
    std::lock_guard<std::mutex> lock(p.mutex);
    if (p.records.size() < kMaxPooled) {
      p.records.push_back(record);
      return;
    }
  }
  delete record;
}

void KernelLaunch::launch(const c10::kiln::KilnStream& stream) {
  if (c10::kiln::anyFailedResults()) {
    propagateFailedResults();
  }
  threads_ = issuingThreadCount();
  grad_mode_ = c10::GradMode::is_enabled();
  captured_ = C10_UNLIKELY(c10::kiln::anyCaptureUnderway()) && c10::kiln::isStreamCapturing(stream);
  // On failure the runtime has already called releaseTask. With
  // KILN_LAUNCH_BLOCKING=1 a failed kernel fails its launch: raised here with
  // its own type (Note [Kernel errors keep their type]).
  KILN_CHECK(kilnLaunchTask(stream.stream(), &runTask, &releaseTask, this,
                            info_->schema->name().c_str()));
}

} // namespace at::kiln
