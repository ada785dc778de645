// LayoutCache.h — remembers what an op's meta kernel decided, per argument
// signature, so repeated calls skip the meta kernel.
//
// Note [Layout cache]
// ~~~~~~~~~~~~~~~~~~~
// Step 2 of Note [How an eager op runs on kiln] runs the op's meta kernel to
// validate the arguments and compute output layouts. Many ATen meta kernels
// are written in Python (torch/_meta_registrations.py overrides the C++ ones
// for most out= variants) and cost tens of microseconds, far more than the
// work of a small op. A meta kernel is a pure function of the arguments'
// metadata and of grad mode, so its outcome is cached under a *signature*:
// the operator, whether grad mode is on (oneDNN's LSTM layer,
// aten::mkldnn_rnn_layer, returns a workspace only with grad mode on; Note
// [Kiln tasks run in the issuer's inference and grad mode]), and for every
// argument its kind and
//   - tensors: defined, device, dtype, sizes, strides, storage offset,
//     conj/neg bits, wrapped-number flag, and which other argument (if any)
//     shares its storage (aliasing decides overlap errors);
//   - scalars, ints, floats, bools, strings, dtypes, lists of them: the value
//     (for pointwise ops whose float scalars are plain operands, such as
//     add's alpha or addcdiv's value, only the type: OpSchemaInfo's
//     scalar_values_irrelevant).
// A cached outcome holds the layouts of the outputs and of every mutable
// argument after the meta kernel ran. Only successful meta calls that raised
// no warning are cached (a warning must be shown every time; an error is
// re-raised by running the op again). Arguments of other kinds (generators
// excepted) make the call uncacheable. The cache is per thread, so lookups
// take no lock, and it is cleared when it holds kMaxEntries signatures.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>
#include <c10/core/ScalarType.h>
#include <c10/util/SmallVector.h>

#include "aten/OpSchemaInfo.h"

namespace at::kiln {

// Sizes, strides, offset, dtype and bits of one tensor (or "undefined").
struct TensorLayout {
  bool defined = false;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t storage_offset = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  bool is_conj = false;
  bool is_neg = false;

  static TensorLayout of(const at::Tensor& t);
  // Same dtype, sizes, bits, and strides of dimensions longer than 1.
  bool sameAs(const TensorLayout& other) const;
  // Whether the strides show an order of the dimensions, so that agreeing
  // with another layout says something about other sizes of the same rank:
  // false for a tensor of rank 2 or more with fewer than two dimensions
  // longer than 1 (a (1, 1) result agrees with any dimension order).
  bool showsDimensionOrder() const;
};

// What the meta kernel decided for one call.
struct MetaOutcome {
  // Per return: one layout (tensor) or several (tensor list).
  std::vector<std::vector<TensorLayout>> returns;
  // Per argument: the layouts of a mutable argument after the meta kernel
  // (one per tensor, several for a tensor list); empty for other arguments.
  std::vector<std::vector<TensorLayout>> mutable_args;
  // The meta kernel warned: show the warning on every call, so do not cache.
  bool uncacheable = false;
};

class LayoutCache {
 public:
  // Built on the stack for lookups; copied into the table on insert.
  using Signature = c10::SmallVector<int64_t, 64>;

  // The signature of a call, or nullopt if the arguments cannot be keyed.
  static std::optional<Signature> signatureOf(const OpSchemaInfo& info,
                                              const torch::jit::Stack& stack, size_t first);

  // The cached outcome for `signature`, or nullptr. The pointer is valid
  // until the next insert() on this thread.
  static const MetaOutcome* find(const Signature& signature);
  static void insert(const Signature& signature, MetaOutcome outcome);

  // Note [Verifying meta kernels]: whether the op's meta kernel gives CPU's
  // layouts, per *layout class*: the operator, and per argument the dtype,
  // rank, memory-format class, dimension order (non-contiguous tensors) and
  // bits of tensors and the value of bools, strings and dtypes (not sizes or
  // other numbers), and grad mode.
  enum class MetaTrust : uint8_t { Unknown, Trusted, Untrusted };
  static std::optional<Signature> layoutClassOf(const OpSchemaInfo& info,
                                                const torch::jit::Stack& stack, size_t first);
  static MetaTrust trust(const Signature& layout_class);
  static void setTrust(const Signature& layout_class, bool trusted);

  // Note [Dtype errors at the call] (KilnOpExecutor.cc): what a tiny run of
  // the op's CPU kernel showed about the dtypes of a layout class.
  enum class DtypeSupport : uint8_t { Unknown, Supported, Unsupported };
  static DtypeSupport dtypeSupport(const Signature& layout_class);
  static void setDtypeSupport(const Signature& layout_class, DtypeSupport support);
};

} // namespace at::kiln
