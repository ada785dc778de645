// OpSchemaInfo.h — what the op executor needs to know about an ATen operator,
// derived once from its schema and cached.
//
// For each argument: is it a tensor (or optional / list of tensors), a
// generator, a device, or something else; is it mutable (`Tensor(a!)`), and
// is it an out= argument (mutable and keyword-only). For each return: is it a
// fresh tensor, the mutated argument itself, a view of an argument
// (`Tensor(a)`), or not a tensor. And whether the op's output layouts are
// taken from its meta kernel or from a first run of its CPU kernel (Note
// [Meta layouts and CPU layouts] in KilnOpExecutor.cc).
//
// Thread-safety: opSchemaInfo() is thread-safe; the returned reference lives
// for the life of the process. The atomic fields may change at any time.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>

namespace at::kiln {

enum class ArgKind : uint8_t {
  Other,
  Tensor,
  OptionalTensor,
  TensorList,
  OptionalTensorList,
  Generator,
  Device,
};

enum class ReturnKind : uint8_t {
  Fresh,     // a new tensor (or list of new tensors)
  Mutated,   // the mutable argument `source` itself (in-place / out=)
  View,      // a view of argument `source` (or a list of views)
  NonTensor, // a scalar, bool, int, ... computed from data
};

struct ReturnInfo {
  ReturnKind kind = ReturnKind::Fresh;
  bool is_list = false;
  int source = -1; // argument index for Mutated / View
};

struct OpSchemaInfo {
  const c10::FunctionSchema* schema = nullptr;
  std::vector<ArgKind> arg_kinds;
  std::vector<bool> arg_is_mutable;
  std::vector<bool> arg_is_out; // mutable and keyword-only
  // Written whole without being read: out= arguments, and `self` of fill_,
  // zero_ and the in-place random fills (uniform_, normal_, random_,
  // bernoulli_, ...), which overwrite every element (Note [Results of failed
  // kernels]).
  std::vector<bool> arg_is_overwritten;
  std::vector<ReturnInfo> returns;

  bool has_mutable_args = false;
  bool has_out_args = false;
  bool has_fresh_returns = false;
  bool has_view_returns = false;
  bool has_non_tensor_returns = false;
  // Output sizes depend on tensor values (nonzero, masked_select, unique, ...)
  // or the op returns values read from device data (item, equal, ...).
  bool is_data_dependent = false;
  // Index of a `bool sparse` argument (embedding backward kernels): when it
  // is true the result is a sparse tensor whose nnz depends on the data, so
  // the call runs synchronously (Note [Sparse tensors on kiln]). -1 if none.
  int sparse_flag_arg = -1;
  // PyTorch tags the op dynamic_output_shape: some of its output sizes may
  // depend on data (linalg_lstsq's residuals, index with boolean masks, ...).
  // Without a meta kernel to tell, such an op's layouts are never learned
  // from a CPU run.
  bool has_dynamic_output_shape = false;
  // The CPU kernel rejects some empty inputs that the meta kernel accepts
  // (reductions such as max() of an empty tensor): with an empty tensor
  // argument the op runs synchronously, so the error is raised at the call.
  bool checks_empty_inputs = false;
  // The op's output layouts and argument checks depend on the *types* of its
  // scalar arguments but not their values (alpha of add, value of addcdiv,
  // weight of lerp, ...), so the layout cache may ignore those values.
  bool scalar_values_irrelevant = false;
  // A meta kernel exists to compute output layouts on the calling thread.
  bool has_meta_kernel = false;
  // The op can run on CPU (the reference device's kernel library).
  bool has_cpu_kernel = false;
  // Index arguments may be CPU tensors (moved to the device), as on CUDA.
  bool accepts_host_indices = false;
  // The op's dtype support is checked on the calling thread before its first
  // launch per layout class (Note [Dtype errors at the call] in
  // KilnOpExecutor.cc): an aten op that launches a kernel and takes tensors.
  bool checks_dtypes_at_call = false;
  // Output layouts come from a synchronous first run of the CPU kernel per
  // argument signature, because the meta kernel disagrees with CPU's (set
  // for known ops, and learned when a kernel's result differs from its meta
  // layout). `layout_generation` changes when this is learned, retiring
  // layouts cached from the meta kernel.
  std::atomic<bool> layouts_from_cpu{false};
  std::atomic<int64_t> layout_generation{0};
  // Bit i: the CPU kernel accepted an out= argument that is the very tensor
  // memory of argument i (same bytes, same layout), learned from one
  // synchronous run (Note [Out= arguments that overlap inputs] in
  // KilnOpExecutor.cc). Arguments past the 64th are never learned.
  std::atomic<uint64_t> accepts_out_fully_overlapping{0};
};

const OpSchemaInfo& opSchemaInfo(const c10::OperatorHandle& op);

// Whether the op (by name, e.g. "aten::replication_pad2d") is known to have
// a meta kernel whose output layouts differ from its CPU kernel's.
bool metaLayoutsKnownWrong(const std::string& name);

} // namespace at::kiln
