// KernelLaunch.h — one launch of an ATen CPU kernel on a kiln stream, as the
// op executor builds it (step 3 of Note [How an eager op runs on kiln]).
//
// Note [Kernel launches are built on the worker]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The launching thread records *descriptors* of the kiln tensors an op uses
// (data pointer, storage size, dtype, sizes, strides, offset, conj/neg bits),
// never the tensors. The stream's worker turns them into host aliases
// (TensorAliases.h), runs the kernel and destroys the aliases. Three reasons:
//   * ownership: a task never holds a kiln tensor, so freeing a tensor never
//     waits for device work and the caching allocator's stream-ordered reuse
//     stays exactly CUDA's (Note [Kiln caching allocator]);
//   * speed: TensorImpls and storages are created and destroyed on the same
//     (worker) thread, so the allocator's per-thread caches stay warm on both
//     threads; cross-thread frees made malloc half of a tiny op's cost;
//   * less work on the calling thread, which is the bottleneck for small ops.
// Launch records are pooled: when a kernel has run, its record goes back to a
// pool, and the next launch clears it *on the launching thread* (so objects
// that thread allocated, like argument lists, are also freed there) and
// reuses its buffers.
//
// Thread-safety: a KernelLaunch is filled by one thread, then owned by the
// runtime until released; the pool is thread-safe.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/SmallVector.h>

#include "aten/OpSchemaInfo.h"
#include "core/KilnStream.h"

namespace at::kiln {

// What the worker needs to rebuild a tensor argument as a host alias.
struct TensorDescriptor {
  bool defined = false;
  at::Tensor host_tensor;             // set for host (CPU) tensors, used as is
  const void* storage_key = nullptr;  // identity of the kiln storage (never dereferenced)
  const void* tensor_key = nullptr;   // identity of the kiln tensor (its TensorImpl, ditto)
  void* data = nullptr;               // the storage's first byte
  size_t nbytes = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int64_t storage_offset = 0;
  c10::SmallVector<int64_t, 6> sizes;
  c10::SmallVector<int64_t, 6> strides;
  bool is_conj = false;
  bool is_neg = false;
  bool written = false;               // the kernel writes it (output, out= or in-place)
  bool overwritten = false;           // ...every element, without reading it (output, out=)

  void assign(const at::Tensor& tensor);
  // Whether the tensor's elements cover its whole storage, contiguously.
  bool coversStorage() const;
};

// How a failed kernel's message names its inputs (tensor arguments other
// than out=, in argument order): "inputs (Float[4, 3], Long[2])". Append each
// tensor to an initially empty string, then finish it.
void appendInputDescription(std::string& text, c10::ScalarType dtype, c10::IntArrayRef sizes);
std::string finishInputDescription(std::string text);

// The failure of the last kernel that failed on the calling (worker) thread,
// "<op>: <message>": kernels the runtime then skips on the same stream are
// released on this thread and name it as their cause (Note [Results of
// failed kernels]).
std::string& lastKernelFailureOnThread();

class KernelLaunch {
 public:
  // A cleared record from the pool (or a new one).
  static KernelLaunch* acquire();

  // `op` runs with the recorded arguments; its fresh results are copied into
  // the recorded outputs, and out= arguments it rebound or re-strided are
  // repaired (Note [Meta layouts and CPU layouts] in KilnOpExecutor.cc).
  void setOperator(const c10::OperatorHandle& op, const OpSchemaInfo& info);
  // Records argument `value` of kind `kind` (tensors as descriptors; other
  // values as given: the caller substitutes generators and devices).
  // `written`: the kernel writes the argument's tensors; `overwritten`: all
  // of their elements, without reading them (OpSchemaInfo::arg_is_overwritten).
  void addArgument(const c10::IValue& value, ArgKind kind, bool written = false,
                   bool overwritten = false);
  // Records a fresh kiln output (in return order; undefined allowed).
  void addOutput(const at::Tensor& output);
  // Hands the record to the runtime; it runs on `stream` and returns to the
  // pool afterwards. Throws (and recycles the record) if the launch fails.
  void launch(const c10::kiln::KilnStream& stream);

 private:
  struct Argument {
    ArgKind kind = ArgKind::Other;
    c10::IValue value;    // non-tensor arguments
    uint32_t first = 0;   // tensor kinds: index of the first descriptor
    uint32_t count = 0;   // tensor kinds: number of descriptors (list length)
  };

  void clear();
  void run();
  std::string describe() const;
  // Note [Results of failed kernels]: marks what this kernel writes.
  void markWrittenAsFailed(const std::string& reason) const;
  // At launch: an input without valid values makes the outputs invalid too;
  // a whole-storage overwrite (fill_, zero_, copy_) makes them valid again.
  void propagateFailedResults() const;
  // After a successful run: the storages this kernel overwrote whole (fresh
  // outputs; out= arguments and random fills covering their storage) hold
  // valid results.
  void clearOverwrittenFailedResults() const;
  // The failure reason of the first input (a tensor the kernel reads but
  // does not write) whose storage holds no valid result, if any.
  std::optional<std::string> firstFailedInput() const;
  TensorDescriptor& nextDescriptor();

  static kilnError_t runTask(void* self);
  static void releaseTask(void* self);

  std::optional<c10::OperatorHandle> op_;
  const OpSchemaInfo* info_ = nullptr;
  std::vector<Argument> arguments_;
  std::vector<TensorDescriptor> descriptors_; // arguments' tensors, then outputs
  size_t used_descriptors_ = 0;
  uint32_t first_output_ = 0;
  uint32_t output_count_ = 0;
  bool cleared_ = true;
  bool ran_ = false;
  bool captured_ = false; // recorded into a kiln graph (Note [Kiln graphs])
  int threads_ = 1; // Note [Intra-op threads of kiln kernels]
  bool grad_mode_ = true; // Note [Kiln tasks run in the issuer's inference and grad mode]
};

} // namespace at::kiln
