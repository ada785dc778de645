// The op executor: the boxed kernel that runs every ATen operator on kiln
// tensors that has no dedicated kiln kernel.
#include "aten/KilnOpExecutor.h"

#include <algorithm>
#include <cctype>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "aten/AdaptiveEager.h"
#include "aten/ArgumentTensors.h"
#include "aten/KernelLaunch.h"
#include "aten/KilnTask.h"
#include "aten/LayoutCache.h"
#include "aten/OpSchemaInfo.h"
#include "aten/OpTracking.h"
#include "aten/SparseTensors.h"
#include "aten/TensorAliases.h"
#include "core/FailedResults.h"
#include "core/KilnException.h"
#include "core/KilnFunctions.h"
#include "core/KilnGenerator.h"
#include "core/KilnStorage.h"
#include "core/KilnStream.h"

namespace at::kiln {

// Note [How an eager op runs on kiln]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The reference device's kernel library is ATen's CPU kernels, run inside a
// task on a kiln stream over the device memory itself (device memory is host
// memory there, see TensorAliases.h). For an op with kiln tensors:
//
//  1. Devices. All tensor arguments must be on one kiln device, as CUDA
//     requires; 0-dim CPU tensors are accepted as scalars, and CPU index
//     tensors of indexing ops are moved to the device (as CUDA does). Anything
//     else raises PyTorch's "Expected all tensors to be on the same device".
//  2. Layout, on the calling thread. The op's meta kernel runs on meta images
//     of the arguments: it validates them (raising the same errors as CPU)
//     and gives every output's sizes, strides and dtype. Fresh outputs are
//     allocated on the device from the caching allocator; out= arguments the
//     meta kernel resized are resized; views are built over the argument's
//     storage. No device work has happened yet and the call can return.
//  3. Work, on the stream. A task on the current stream runs the CPU kernel
//     over host aliases of the arguments and copies fresh results into the
//     outputs (Note [Meta layouts and CPU layouts]). Pure view ops launch
//     nothing.
//  4. Data-dependent ops (output sizes or returned values that depend on
//     tensor values: nonzero, masked_select, unique, item, equal, ...) and
//     reductions given an empty tensor (whose CPU kernels raise errors the
//     meta kernels do not), and out= arguments that overlap an input in a way
//     CPU may reject (Note [Out= arguments that overlap inputs]) run
//     synchronously (ops without a meta kernel only
//     their first call per argument signature, Note [Meta layouts and CPU
//     layouts]): the task runs, the
//     calling thread waits, and outputs are copied into new kiln tensors.
//     They are counted in torch.kiln.get_sync_ops() because each one stalls
//     the device the way it would on a GPU.
// Random ops run with the kiln generator's engine (Note [Kiln random numbers]).

// Note [Meta layouts and CPU layouts]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Kiln must return tensors before its kernels have run, so it allocates
// outputs in the layout (dtype, sizes, strides, conj/neg bits) that the op's
// meta kernel declares. PyTorch's meta kernels describe *CUDA's* outputs, and
// for a few CPU kernels they are wrong: statistics of half-precision norms
// are float on CUDA but half on CPU, padding and convolution keep
// channels-last strides on CPU, linalg solves return conjugate views, unused
// batch-norm statistics are empty on CPU. Kiln guards three ways:
//   * The kernel writes its results into temporaries (the op's functional
//     CPU kernel), which are then copied into the kiln outputs whatever their
//     layout, never straight into them through a hand-written out= kernel
//     (those may reallocate, rebind or re-stride their outputs).
//   * An out= argument the kernel rebound or re-strided anyway is repaired by
//     a copy (KernelLaunch::run).
//   * Ops known to disagree, and any op whose CPU result is found to differ
//     from its meta layout, take their layouts from the CPU kernel instead:
//     the first call with each argument signature runs synchronously, and its
//     outputs' layouts are cached for the asynchronous calls that follow
//     (OpSchemaInfo::layouts_from_cpu). A learned disagreement costs one call
//     whose outputs have the meta layout (values copied into it).
// Note [Verifying meta kernels]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Which meta kernels disagree with CPU is not known in advance for every op
// and input kind, so Kiln checks: the first call of an op with fresh outputs
// (or with an empty out= tensor to resize) in each *layout class* (dtypes,
// ranks, memory formats, dimension orders and flags of its arguments; not
// sizes, see LayoutCache::layoutClassOf) runs synchronously and compares
// the CPU kernel's result layouts with the meta kernel's. If they agree,
// later calls of that class trust the meta kernel and run asynchronously;
// if not, each new argument signature of that class takes its layouts from
// one synchronous CPU run. Agreement on a result whose strides show no
// order of its dimensions (rank 2 or more, at most one dimension longer
// than 1: linalg.eig of a 1x1 matrix) proves nothing, so it leaves the
// class unverified: the next call checks again. Training and inference
// loops meet a handful of layout classes, so this costs a few
// synchronizations at the start; they show in torch.kiln.get_sync_ops().
//
// Structured ops (add, mm, ...) never reach the executor as functional ops:
// PyTorch's generated wrapper runs their C++ meta function, allocates through
// kiln, and calls the out= kernel, whose generated code honours any output
// layout.

// Note [Dtype errors at the call]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A meta kernel checks shapes, not whether the CPU kernel's dtype dispatch
// covers the arguments' dtypes: `bool @ bool` passes mm's meta function and
// fails inside the kernel (AT_DISPATCH raises NotImplementedError
// "\"addmm_impl_cpu_\" not implemented for 'Bool'"). CPU and CUDA raise that at
// the call; on kiln the kernel runs on the device, so it would surface at the
// next synchronization and the work queued behind it would be skipped.
// PyTorch has no table of the dtypes a kernel supports, so Kiln asks the
// kernel: the first time an aten op meets a layout class (the dtypes, ranks,
// formats and flags of its arguments, LayoutCache::layoutClassOf), before its
// first launch in that class, the CPU kernel runs on the calling thread on
// *tiny images* of the arguments — zero-filled host tensors of the same
// dtypes and ranks with every dimension cut to at most one element, other
// arguments as given, a throwaway generator for random ops, warnings
// discarded. If that raises NotImplementedError, TypeError or a plain
// RuntimeError (some dtype checks are TORCH_CHECKs, like sub's "with a bool
// tensor is not supported", which PyTorch's meta kernel for sub.out lacks),
// the class is marked unsupported and its calls run synchronously on the real
// arguments, which raises CPU's own error, unchanged, at the call (if that
// run succeeds after all, the tiny images misled the probe — a RuntimeError
// of their tiny shapes, say — and the class is cleared, at the cost of that
// one synchronous call). Any other outcome — success, or an IndexError or
// ValueError the tiny shapes or values caused — leaves the class to the
// asynchronous path. The verdict is remembered per layout class
// (LayoutCache::dtypeSupport), so the probe costs one tiny kernel per op and
// class, on a layout-cache miss; calls served from the layout cache pay
// nothing and nothing ever synchronizes for it. Limits: a dtype check that
// sits behind a check the tiny images fail (a grouped convolution's channel
// count, say) is not reached, and its error still surfaces at
// synchronization; a TORCH_WARN_ONCE the probe reaches first is lost. Not
// probed (OpSchemaInfo's checks_dtypes_at_call): custom (non-aten) ops, whose
// kernels may have side effects; ops with integer arguments other than
// dimensions and modes (sizes, lengths, counts: ctc_loss's input_lengths,
// group_norm's N, C and HxW), which a kernel may trust, unchecked, to match
// its tensors' shapes, so tiny images could make it read out of bounds; ops
// taking LAPACK pivots, which are 1-based. Their dtype errors surface where
// their kernels run (at the call for a first call's layout check). Copies
// between dtypes, which kiln runs as CPU's copy_ on the device, check each
// pair of dtypes once the same way (checkConversion in Copy.cc).

namespace {

using c10::kiln::KilnStream;
using torch::jit::Stack;

// ---------------------------------------------------------------- devices

[[noreturn]] void raiseDeviceMismatch(const OpSchemaInfo& info, size_t arg,
                                      const at::Tensor& tensor, c10::Device expected) {
  TORCH_CHECK(
      false, "Expected all tensors to be on the same device, but got ",
      info.schema->arguments()[arg].name(), " is on ", tensor.device(),
      ", different from other tensors on ", expected,
      " (when checking argument in method ", opName(info), ")");
}

// Step 1 of Note [How an eager op runs on kiln]. May replace CPU index tensors
// on the stack with kiln copies.
c10::Device resolveDevice(const OpSchemaInfo& info, Stack* stack, size_t first) {
  const size_t num_args = info.arg_kinds.size();
  std::optional<c10::Device> device;
  for (size_t i = 0; i < num_args && !device; ++i) {
    forEachTensorIn((*stack)[first + i], info.arg_kinds[i], [&](const at::Tensor& t) {
      if (!device && t.defined() && t.device().is_privateuseone()) {
        device = t.device();
      }
    });
  }
  const bool has_kiln_tensor = device.has_value();
  bool has_kiln_generator = false;
  for (size_t i = 0; i < num_args; ++i) {
    const c10::IValue& value = (*stack)[first + i];
    has_kiln_generator |= info.arg_kinds[i] == ArgKind::Generator && value.isGenerator() &&
        value.toGenerator().device().is_privateuseone();
  }
  if (!device) {
    for (size_t i = 0; i < num_args; ++i) {
      const c10::IValue& value = (*stack)[first + i];
      if (info.arg_kinds[i] == ArgKind::Device && value.isDevice() &&
          value.toDevice().is_privateuseone()) {
        device = value.toDevice();
        break;
      }
    }
  }
  if (!device) {
    device = c10::Device(c10::DeviceType::PrivateUse1, c10::kiln::current_device());
  }
  if (!device->has_index()) {
    device = c10::Device(c10::DeviceType::PrivateUse1, c10::kiln::current_device());
  }
  c10::kiln::check_device_index(device->index());

  for (size_t i = 0; i < num_args; ++i) {
    c10::IValue& value = (*stack)[first + i];
    const ArgKind kind = info.arg_kinds[i];
    const bool is_index_list = info.accepts_host_indices &&
        (kind == ArgKind::TensorList || kind == ArgKind::OptionalTensorList);
    bool has_host_index = false;
    forEachTensorIn(value, kind, [&](const at::Tensor& t) {
      if (!t.defined() || t.device() == *device) {
        return;
      }
      if (t.device().is_cpu() && is_index_list) {
        has_host_index = true;
        return;
      }
      if (t.device().is_cpu() && t.dim() == 0 && !info.arg_is_mutable[i]) {
        return; // a host scalar
      }
      if (!has_kiln_tensor && has_kiln_generator && t.device().is_cpu()) {
        // Only a kiln generator sent this CPU op here; say so, as CPU does.
        TORCH_CHECK(false, "Expected a 'cpu' device type for generator but found 'kiln' (in ",
                    opName(info), " on CPU tensors); use a CPU generator for CPU tensors.");
      }
      raiseDeviceMismatch(info, i, t, *device);
    });
    if (has_host_index) {
      // Indexing with CPU index tensors works as on CUDA: move them over.
      std::vector<std::optional<at::Tensor>> moved;
      for (const c10::IValue& element : value.toListRef()) {
        // Python's indexing passes a slice, None or ... as an undefined
        // tensor (x[:, i]), not as None.
        if (element.isTensor() && element.toTensor().defined()) {
          const at::Tensor& t = element.toTensor();
          // Pageable indices are staged at the call, so the copy need not
          // wait; pinned ones are not, so that copy completes first
          // (Note [Kiln copies]).
          moved.emplace_back(t.device().is_cpu()
                                 ? t.to(*device, /*non_blocking=*/!t.is_pinned())
                                 : t);
        } else {
          moved.emplace_back(std::nullopt);
        }
      }
      if (kind == ArgKind::TensorList) {
        std::vector<at::Tensor> tensors;
        for (auto& t : moved) {
          tensors.push_back(t.value_or(at::Tensor()));
        }
        value = c10::IValue(c10::List<at::Tensor>(tensors));
      } else {
        value = c10::IValue(c10::List<std::optional<at::Tensor>>(moved));
      }
    }
  }
  return *device;
}

// "inputs (Float[4], Long[2])", as a failed kernel launch names them
// (KernelLaunch::describe).
std::string describeInputs(const OpSchemaInfo& info, const Stack& stack, size_t first) {
  std::string text;
  for (size_t i = 0; i < info.arg_kinds.size(); ++i) {
    if (info.arg_is_out[i]) {
      continue;
    }
    forEachTensorIn(stack[first + i], info.arg_kinds[i], [&](const at::Tensor& t) {
      if (t.defined()) {
        appendInputDescription(text, t.scalar_type(), t.sizes());
      }
    });
  }
  return finishInputDescription(std::move(text));
}

// Whether an input (not an out= tensor, which composites pass empty) has no
// elements.
bool hasEmptyInput(const OpSchemaInfo& info, const Stack& stack, size_t first) {
  bool empty = false;
  for (size_t i = 0; i < info.arg_kinds.size() && !empty; ++i) {
    if (info.arg_is_out[i]) {
      continue;
    }
    forEachTensorIn(stack[first + i], info.arg_kinds[i], [&](const at::Tensor& t) {
      empty |= t.defined() && t.numel() == 0;
    });
  }
  return empty;
}

bool hasEmptyOutArgument(const OpSchemaInfo& info, const Stack& stack, size_t first) {
  for (size_t i = 0; i < info.arg_kinds.size(); ++i) {
    if (info.arg_is_out[i] && stack[first + i].isTensor() && stack[first + i].toTensor().numel() == 0) {
      return true;
    }
  }
  return false;
}

// ---------------------------------------------------------------- aliases

// Replaces the tensors in `value` by stand-ins from `aliaser`.
c10::IValue aliasValue(const c10::IValue& value, ArgKind kind, TensorAliaser& aliaser) {
  return mapTensors(value, kind, [&](const at::Tensor& t) { return aliaser.alias(t); });
}

// Host-side copies of user-visible CPU scalar tensors, so a task never reads
// a host tensor the caller may change after the op returns. Wrapped numbers
// (Python scalars) are private to the call and need no copy.
c10::IValue snapshotHostScalars(const c10::IValue& value, ArgKind kind) {
  if ((kind == ArgKind::Tensor || kind == ArgKind::OptionalTensor) && value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    if (t.defined() && t.device().is_cpu() && !t.unsafeGetTensorImpl()->is_wrapped_number()) {
      return c10::IValue(t.clone());
    }
  }
  return value;
}

// The value a CPU kernel gets for a generator or device argument: the kiln
// generator's engine (Note [Kiln random numbers]) and the CPU device.
c10::IValue hostValueOf(const OpSchemaInfo& info, const c10::IValue& value, ArgKind kind,
                        const KilnStream& stream) {
  if (kind == ArgKind::Generator) {
    at::Generator generator = value.isNone()
        ? c10::kiln::getDefaultKilnGenerator(stream.device_index())
        : value.toGenerator();
    TORCH_CHECK(
        generator.device().is_privateuseone(),
        "Expected a generator on a kiln device for ", opName(info), ", but got a ",
        generator.device().type(), " generator. Create it with torch.Generator(device=\"kiln\").");
    return c10::IValue(generator.get<c10::kiln::KilnGeneratorImpl>()->engineForLaunch(stream));
  }
  if (kind == ArgKind::Device && value.isDevice() && value.toDevice().is_privateuseone()) {
    return c10::IValue(c10::Device(c10::kCPU));
  }
  return snapshotHostScalars(value, kind);
}

// Host arguments for the CPU kernel, built now (the synchronous path).
Stack hostArguments(const OpSchemaInfo& info, const Stack& stack, size_t first,
                    TensorAliaser& aliaser, const KilnStream& stream) {
  Stack args;
  const size_t num_args = info.arg_kinds.size();
  args.reserve(num_args);
  for (size_t i = 0; i < num_args; ++i) {
    const ArgKind kind = info.arg_kinds[i];
    args.push_back(aliasValue(hostValueOf(info, stack[first + i], kind, stream), kind, aliaser));
  }
  return args;
}

// Arguments for running the op elsewhere: every tensor replaced by
// image(tensor, is_out_argument), no generators, kiln devices replaced by
// `device_type`.
template <typename F>
Stack argumentImages(const OpSchemaInfo& info, const Stack& stack, size_t first,
                     c10::DeviceType device_type, F&& image) {
  Stack args;
  const size_t num_args = info.arg_kinds.size();
  args.reserve(num_args);
  for (size_t i = 0; i < num_args; ++i) {
    const c10::IValue& value = stack[first + i];
    switch (info.arg_kinds[i]) {
      case ArgKind::Generator:
        args.emplace_back();
        break;
      case ArgKind::Device:
        args.emplace_back(value.isDevice() && value.toDevice().is_privateuseone()
                              ? c10::IValue(c10::Device(device_type))
                              : value);
        break;
      default:
        args.push_back(mapTensors(value, info.arg_kinds[i], [&](const at::Tensor& t) {
          return image(t, static_cast<bool>(info.arg_is_out[i]));
        }));
    }
  }
  return args;
}

// Meta arguments: meta images of tensors, no generators, meta devices.
Stack metaArguments(const OpSchemaInfo& info, const Stack& stack, size_t first,
                    TensorAliaser& aliaser) {
  return argumentImages(info, stack, first, c10::kMeta,
                        [&](const at::Tensor& t, bool) { return aliaser.alias(t); });
}

// Host images of the arguments (fresh CPU tensors with each tensor's sizes,
// strides and dtype), if every tensor input other than out= tensors is
// empty, so the CPU kernel needs no values.
std::optional<Stack> emptyHostImages(const OpSchemaInfo& info, const Stack& stack, size_t first) {
  bool needs_values = false;
  Stack images = argumentImages(info, stack, first, c10::kCPU,
                                [&](const at::Tensor& t, bool is_out) -> at::Tensor {
    if (!t.defined()) {
      return t;
    }
    needs_values |= !is_out && t.numel() != 0;
    return at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kCPU));
  });
  if (needs_values) {
    return std::nullopt;
  }
  return images;
}

// ---------------------------------------------------------------- dtypes

// A zero-filled host tensor with `t`'s dtype and rank and every dimension cut
// to at most one element; host tensors (scalars) as they are.
at::Tensor tinyImageOf(const at::Tensor& t) {
  if (!t.defined() || t.device().is_cpu()) {
    return t;
  }
  c10::SmallVector<int64_t, 6> sizes;
  for (const int64_t size : t.sizes()) {
    sizes.push_back(std::min<int64_t>(size, 1));
  }
  return at::zeros(sizes, at::TensorOptions().dtype(t.scalar_type()));
}

// Drops the warnings of a run whose outcome is only looked at (a probe); the
// real run warns.
struct DiscardingHandler final : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

// Note [Dtype errors at the call]: whether the CPU kernel rejects the
// arguments' dtypes, judged by a run on tiny images.
LayoutCache::DtypeSupport probeDtypes(const c10::OperatorHandle& op, const OpSchemaInfo& info,
                                      const Stack& stack, size_t first) {
  Stack args = argumentImages(info, stack, first, c10::kCPU,
                              [](const at::Tensor& t, bool) { return tinyImageOf(t); });
  for (size_t i = 0; i < info.arg_kinds.size(); ++i) {
    if (info.arg_kinds[i] == ArgKind::Generator) {
      args[i] = c10::IValue(at::detail::createCPUGenerator()); // leaves the user's untouched
    }
  }
  DiscardingHandler handler;
  try {
    c10::WarningUtils::WarningHandlerGuard guard(&handler);
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &args);
  } catch (const c10::NotImplementedError&) {
    return LayoutCache::DtypeSupport::Unsupported;
  } catch (const c10::TypeError&) {
    return LayoutCache::DtypeSupport::Unsupported;
  } catch (const c10::IndexError&) {
    // An index the tiny shapes put out of range: no verdict on the dtypes.
  } catch (const c10::ValueError&) {
    // A value the tiny shapes made invalid: no verdict on the dtypes.
  } catch (const c10::Error&) {
    // A plain RuntimeError may be a dtype check that is not a dispatch
    // failure (sub's "with a bool tensor is not supported", whose out= form
    // PyTorch's meta kernel does not check) or an error of the tiny shapes:
    // the real arguments decide, once, synchronously.
    return LayoutCache::DtypeSupport::Unsupported;
  } catch (const std::exception&) {
    // An error of the tiny shapes or values: no verdict on the dtypes.
  }
  return LayoutCache::DtypeSupport::Supported;
}

// ---------------------------------------------------------------- quantized

// Kiln has no quantized tensors (the reference device's kernels are CPU's
// float ones, and quantized tensors carry a quantizer kiln has no storage
// for): asking for one on kiln raises NotImplementedError at the call, like
// other layouts kiln lacks, naming the op, the dtype and what to do.


// "a torch.qint8 tensor (per_tensor_affine)" or "a torch.quint8 tensor".
std::string quantizedTensorDescription(c10::ScalarType dtype,
                                       std::optional<c10::QScheme> scheme = std::nullopt) {
  std::string text = "a torch." + std::string(c10::toString(dtype)) + " tensor";
  for (char& c : text) {
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  if (scheme.has_value()) {
    text += " (" + c10::toString(*scheme) + ")";
  }
  return text;
}

[[noreturn]] void raiseQuantizedNotSupported(const std::string& op_name, const std::string& what) {
  TORCH_CHECK_NOT_IMPLEMENTED(
      false, "Kiln does not support quantized tensors: ", op_name, " was asked for ", what,
      " on a kiln device. Dequantize first and move the float tensor (t.dequantize().to(\"kiln\")), "
      "or keep quantized tensors and the ops that use them on the CPU.");
}

std::optional<c10::ScalarType> quantizedDtypeArgument(const c10::FunctionSchema& schema,
                                                      const Stack& stack, size_t first) {
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& value = stack[first + i];
    auto type = args[i].real_type(); // ScalarType, not the int it is passed as
    if (type->kind() == c10::TypeKind::OptionalType) {
      type = type->castRaw<c10::OptionalType>()->getElementType();
    }
    if (type->kind() == c10::TypeKind::ScalarTypeType && value.isInt()) {
      const auto dtype = static_cast<c10::ScalarType>(value.toInt());
      if (c10::isQIntType(dtype)) {
        return dtype;
      }
    }
  }
  return std::nullopt;
}

// ---------------------------------------------------------------- outputs

// Gives the kiln tensor `target` the sizes, strides and offset of `layout`,
// growing its storage if needed. Used when a kernel resized an out= argument.
void adoptLayout(const at::Tensor& target, const TensorLayout& layout) {
  auto* impl = target.unsafeGetTensorImpl();
  if (target.sizes().equals(layout.sizes) && target.strides().equals(layout.strides) &&
      target.storage_offset() == layout.storage_offset) {
    return;
  }
  const size_t needed = at::detail::computeStorageNbytes(
      layout.sizes, layout.strides, target.dtype().itemsize(),
      static_cast<size_t>(layout.storage_offset));
  if (needed > target.storage().nbytes()) {
    c10::kiln::resizeStorageBytes(target.storage().unsafeGetStorageImpl(), needed);
  }
  impl->set_sizes_and_strides(layout.sizes, layout.strides, layout.storage_offset);
}

// A kiln tensor over `base`'s storage with the layout and dtype of `layout`.
at::Tensor viewOf(const at::Tensor& base, const TensorLayout& layout) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(base.storage()), base.key_set(),
      c10::scalarTypeToTypeMeta(layout.dtype));
  impl->set_sizes_and_strides(layout.sizes, layout.strides, layout.storage_offset);
  impl->_set_conj(layout.is_conj);
  impl->_set_neg(layout.is_neg);
  return at::Tensor(std::move(impl));
}

at::Tensor freshLike(const OpSchemaInfo& info, const TensorLayout& layout, c10::Device device) {
  if (!layout.defined) {
    return at::Tensor(); // e.g. a gradient that output_mask did not ask for
  }
  if (C10_UNLIKELY(c10::isQIntType(layout.dtype))) {
    raiseQuantizedNotSupported(opName(info), quantizedTensorDescription(layout.dtype));
  }
  return at::empty_strided(layout.sizes, layout.strides,
                           at::TensorOptions().dtype(layout.dtype).device(device));
}

// Part of the error ATen's Meta fallback kernel raises for an op without a
// meta kernel (aten/src/ATen/core/MetaFallbackKernel.cpp).
constexpr std::string_view kNoMetaKernelMessage = "no fake impl or Meta kernel registered";

// Runs the meta kernel on meta images of the arguments; nullopt if it raised.
// Warnings it emits are passed on, and make the outcome uncacheable.
std::optional<MetaOutcome> runMetaKernel(const c10::OperatorHandle& op, const OpSchemaInfo& info,
                                         const Stack& stack, size_t first) {
  struct CollectingHandler final : c10::WarningHandler {
    std::vector<c10::Warning> warnings;
    void process(const c10::Warning& warning) override { warnings.push_back(warning); }
  };
  TensorAliaser aliaser(c10::kMeta);
  Stack meta_stack = metaArguments(info, stack, first, aliaser);
  const Stack meta_args = meta_stack; // keeps the meta images of mutable args
  CollectingHandler handler;
  c10::WarningHandler* previous = c10::WarningUtils::get_warning_handler();
  try {
    c10::WarningUtils::WarningHandlerGuard guard(&handler);
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), &meta_stack);
  } catch (const c10::NotImplementedError& e) {
    // ATen's Meta fallback (MetaFallbackKernel.cpp) stands in for ops that
    // have no meta kernel: their layouts come from CPU runs from now on,
    // unless their output sizes may depend on data.
    if (!info.has_dynamic_output_shape &&
        std::string_view(e.what()).find(kNoMetaKernelMessage) != std::string_view::npos) {
      const_cast<OpSchemaInfo&>(info).layouts_from_cpu.store(true);
    }
    return std::nullopt;
  } catch (const std::exception& e) {
    if (c10::kiln::isInterrupt(e)) {
      throw; // Ctrl-C in a Python meta kernel: not a reason to run on CPU
    }
    return std::nullopt;
  }
  for (const auto& warning : handler.warnings) {
    previous->process(warning);
  }
  MetaOutcome outcome;
  outcome.uncacheable = !handler.warnings.empty();
  outcome.returns.resize(info.returns.size());
  for (size_t r = 0; r < info.returns.size(); ++r) {
    if (info.returns[r].kind == ReturnKind::Mutated) {
      continue; // the mutable argument's layout is recorded below
    }
    forEachTensorIn(meta_stack[r], returnArgKind(info.returns[r]),
                    [&](const at::Tensor& t) { outcome.returns[r].push_back(TensorLayout::of(t)); });
    if (info.returns[r].kind == ReturnKind::Fresh && !info.returns[r].is_list &&
        outcome.returns[r].empty()) {
      outcome.returns[r].emplace_back(); // an undefined tensor
    }
  }
  outcome.mutable_args.resize(info.arg_kinds.size());
  for (size_t i = 0; i < info.arg_kinds.size(); ++i) {
    if (info.arg_is_mutable[i]) {
      forEachTensorIn(meta_args[i], info.arg_kinds[i], [&](const at::Tensor& t) {
        outcome.mutable_args[i].push_back(TensorLayout::of(t));
      });
    }
  }
  return outcome;
}

// ---------------------------------------------------------------- out= overlap

// Note [Out= arguments that overlap inputs]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// CPU's kernels check, before computing, that an out= argument does not
// share memory with an input in a way they cannot handle: TensorIterator
// rejects an out= whose elements partly overlap an input's
// (`torch.mul(x[:-1], 2, out=x[1:])`) or whose own elements share memory
// (an expanded out=); index_select, cat and others reject any overlap
// (at::assert_no_overlap). PyTorch's meta kernels for out= ops check none of
// it, so on the asynchronous path CPU's error would surface at the next
// synchronization, and the failed kernel would mark the out= tensor, and
// with it the input it overlaps, as never computed: the user's data lost.
// So before anything is launched the executor looks at the memory of each
// out= argument (sizes, strides and offsets, never values) with ATen's own
// tests (ATen/MemoryOverlap.h):
//   * no overlap with any tensor input, or one ATen cannot decide
//     (TooHard, which CPU's checks let pass too): the asynchronous path;
//   * overlap within the out= tensor (Yes), or partial overlap with an
//     input: the call runs synchronously, which raises CPU's error at the
//     call (or computes what CPU computes, for a kernel that allows it);
//   * the out= tensor is exactly input i's memory (`torch.add(x, 1,
//     out=x)`): elementwise kernels allow it, others reject it. At an op's
//     first such call, CPU's kernel is asked on tiny images, as for dtypes
//     (Note [Dtype errors at the call]), where tensors with the same memory
//     share one image. If it accepts, the op is marked as accepting the
//     overlap for argument i (OpSchemaInfo::accepts_out_fully_overlapping)
//     and this call and later ones are asynchronous, so nothing
//     synchronizes (and a kiln graph capture is not broken). If it raises
//     ATen's overlap error, or gives no verdict (an op that is not probed,
//     tiny images failing for another reason), the call runs synchronously:
//     CPU's error at the call, or a success that marks the op.
// An out= argument that shares memory with another argument and that the
// meta kernel resizes runs synchronously too, whatever the verdict above: the
// resize can turn a full or no overlap into a partial one.
// The synchronous run gives such an out= argument its host alias rather than
// a fresh host tensor, so the kernel sees the aliasing CPU would see
// (runSynchronously). In-place ops need none of this: their meta kernels run
// TensorIterator's checks on meta images that share one storage
// (TensorAliases.h), which raises CPU's errors at the call.

// Whether out= argument `i` shares memory with another tensor argument, or
// has elements that share memory with one another.
bool outSharesMemory(const OpSchemaInfo& info, const Stack& stack, size_t first, size_t i) {
  bool shares = false;
  forEachTensorIn(stack[first + i], info.arg_kinds[i], [&](const at::Tensor& out) {
    if (!out.defined() || shares) {
      return;
    }
    shares = at::has_internal_overlap(out) == at::MemOverlap::Yes;
    for (size_t j = 0; j < info.arg_kinds.size() && !shares; ++j) {
      if (j == i) {
        continue;
      }
      forEachTensorIn(stack[first + j], info.arg_kinds[j], [&](const at::Tensor& t) {
        shares |= t.defined() && t.device() == out.device() && t.is_alias_of(out);
      });
    }
  });
  return shares;
}

// How an out= argument meets the inputs' memory (Note [Out= arguments that
// overlap inputs]).
enum class OutOverlap {
  Harmless,      // no overlap, one ATen cannot decide, or a full one the op accepts
  Unknown,       // a full overlap the op is not yet known to accept
  Synchronous,   // overlap within an out= tensor, or a partial one: run synchronously
};

// Classifies the call's out= arguments. Sets `*full_overlaps` to the
// arguments an out= argument fully overlaps that the op is not yet known to
// accept.
OutOverlap classifyOutOverlap(const OpSchemaInfo& info, const Stack& stack, size_t first,
                              uint64_t* full_overlaps) {
  const size_t num_args = info.arg_kinds.size();
  const uint64_t accepted = info.accepts_out_fully_overlapping.load(std::memory_order_relaxed);
  bool synchronous = false;
  *full_overlaps = 0;
  for (size_t i = 0; i < num_args && !synchronous; ++i) {
    if (!info.arg_is_out[i]) {
      continue;
    }
    forEachTensorIn(stack[first + i], info.arg_kinds[i], [&](const at::Tensor& out) {
      if (synchronous || !out.defined() || out.numel() == 0) {
        return;
      }
      if (at::has_internal_overlap(out) == at::MemOverlap::Yes) {
        synchronous = true;
        return;
      }
      for (size_t j = 0; j < num_args && !synchronous; ++j) {
        if (info.arg_is_out[j]) {
          continue;
        }
        forEachTensorIn(stack[first + j], info.arg_kinds[j], [&](const at::Tensor& input) {
          if (synchronous || !input.defined() || input.device() != out.device()) {
            return;
          }
          switch (at::get_overlap_status(out, input)) {
            case at::MemOverlapStatus::Partial:
              synchronous = true;
              break;
            case at::MemOverlapStatus::Full:
              if (j >= 64) {
                synchronous = true;
              } else if ((accepted & (uint64_t{1} << j)) == 0) {
                *full_overlaps |= uint64_t{1} << j;
              }
              break;
            default: // No, TooHard
              break;
          }
        });
      }
    });
  }
  if (synchronous) {
    return OutOverlap::Synchronous;
  }
  return *full_overlaps != 0 ? OutOverlap::Unknown : OutOverlap::Harmless;
}

// Whether the CPU kernel accepts the call's full overlaps, judged as dtypes
// are (Note [Dtype errors at the call]) on tiny images, where tensors whose
// memory is the same get one image. std::nullopt: no verdict (the tiny
// images failed for another reason, or the op is not probed).
std::optional<bool> probeFullOverlap(const c10::OperatorHandle& op, const OpSchemaInfo& info,
                                     const Stack& stack, size_t first) {
  if (!info.checks_dtypes_at_call) {
    return std::nullopt;
  }
  c10::SmallVector<std::pair<at::Tensor, at::Tensor>, 4> images; // kiln tensor, image
  auto imageOf = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || t.device().is_cpu()) {
      return t;
    }
    for (const auto& [kiln, image] : images) {
      if (at::get_overlap_status(kiln, t) == at::MemOverlapStatus::Full) {
        return image;
      }
    }
    images.emplace_back(t, tinyImageOf(t));
    return images.back().second;
  };
  Stack args = argumentImages(info, stack, first, c10::kCPU,
                              [&](const at::Tensor& t, bool) { return imageOf(t); });
  for (size_t i = 0; i < info.arg_kinds.size(); ++i) {
    if (info.arg_kinds[i] == ArgKind::Generator) {
      args[i] = c10::IValue(at::detail::createCPUGenerator());
    }
  }
  DiscardingHandler handler;
  try {
    c10::WarningUtils::WarningHandlerGuard guard(&handler);
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &args);
  } catch (const c10::Error& e) {
    // ATen's overlap assertions (MemoryOverlap.cpp) all say this.
    if (std::string_view(e.what_without_backtrace()).find("unsupported operation") !=
        std::string_view::npos) {
      return false;
    }
    return std::nullopt;
  } catch (const std::exception&) {
    return std::nullopt;
  }
  return true;
}

// ---------------------------------------------------------------- sync path

// What a synchronous run learned about layouts.
struct LayoutProbe {
  // Record the kiln outputs' layouts in the layout cache under this
  // signature (if not null).
  const LayoutCache::Signature* signature = nullptr;
  // Filled: the layouts of the CPU kernel's own fresh results, per return,
  // and of out= arguments that were empty before the call, per argument.
  std::vector<std::vector<TensorLayout>> cpu_results;
  std::vector<std::optional<TensorLayout>> cpu_out_args;
};

// Runs the CPU kernel now and waits (Note [How an eager op runs on kiln],
// step 4). With `probe`, also records what the run shows about layouts
// (Note [Meta layouts and CPU layouts]); such a run stands in for an
// asynchronous launch, so a failure raises what that launch would have raised
// at synchronization (Note [Kernel errors keep their type]). Without, the
// kernel's error is raised as the kernel raised it, as on CPU.
void runSynchronously(const c10::OperatorHandle& op, const OpSchemaInfo& info,
                      Stack* stack, size_t first, c10::Device device,
                      LayoutProbe* probe = nullptr) {
  if (probe != nullptr) {
    recordLayoutCheck(info.schema->operator_name());
  } else {
    recordSyncOp(info.schema->operator_name());
  }
  const KilnStream stream = c10::kiln::getCurrentKilnStream(device.index());
  const size_t num_args = info.arg_kinds.size();

  TensorAliaser aliaser(c10::kCPU);
  Stack host_args = hostArguments(info, *stack, first, aliaser, stream);
  // out= arguments get fresh host tensors: the kernel may resize them; the
  // results are copied into the kiln tensors afterwards. Except an out= that
  // shares memory with another argument or within itself: it keeps its host
  // alias, so the kernel sees (and checks) the aliasing CPU would see (Note
  // [Out= arguments that overlap inputs]). Such an alias cannot grow its
  // storage: the caller grows it first where the meta kernel says the kernel
  // will; a partial overlap judged before any meta kernel ran is run as is,
  // and CPU's kernels check overlaps before resizing (TensorIterator's
  // compute_mem_overlaps), so it raises CPU's overlap error first.
  std::vector<at::Tensor> host_outs(num_args);
  std::vector<at::Tensor> aliased_outs(num_args);
  std::vector<bool> out_was_empty(num_args, false);
  for (size_t i = 0; i < num_args; ++i) {
    if (info.arg_is_out[i] && host_args[i].isTensor()) {
      const at::Tensor& kiln_out = (*stack)[first + i].toTensor();
      out_was_empty[i] = kiln_out.numel() == 0;
      if (outSharesMemory(info, *stack, first, i)) {
        aliased_outs[i] = host_args[i].toTensor();
        continue;
      }
      host_outs[i] = at::empty({0}, at::TensorOptions().dtype(kiln_out.dtype()));
      host_args[i] = c10::IValue(host_outs[i]);
    }
  }

  // Note [Results of failed kernels]: the kernel reads its inputs here, on
  // the host, so an input whose kernel failed is not read but raised, as a
  // host read raises. Checked when the task runs: a failure on another
  // stream, ordered before it by an event, has marked its results by then.
  std::vector<const void*> input_storages;
  for (size_t i = 0; i < num_args; ++i) {
    if (!info.arg_is_out[i]) {
      forEachTensorIn((*stack)[first + i], info.arg_kinds[i], [&](const at::Tensor& t) {
        if (t.defined() && t.device().is_privateuseone() && t.has_storage()) {
          input_storages.push_back(t.storage().data());
        }
      });
    }
  }

  struct Outcome {
    Stack results;
    std::exception_ptr error;
    std::optional<std::string> failed_input; // the reason of a marked input's mark
  };
  auto outcome = std::make_shared<Outcome>();
  launchTask(stream, info.schema->name().c_str(),
             [op, args = std::move(host_args), outcome,
              input_storages = std::move(input_storages)]() mutable {
               if (c10::kiln::anyFailedResults()) {
                 for (const void* data : input_storages) {
                   if (auto reason = c10::kiln::failedResultReason(data)) {
                     outcome->failed_input = std::move(reason);
                     return;
                   }
                 }
               }
               try {
                 op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &args);
                 outcome->results = std::move(args);
               } catch (...) {
                 // Raised on the calling thread below, with its original type.
                 outcome->error = std::current_exception();
               }
             });
  stream.synchronize();
  if (outcome->failed_input) {
    c10::kiln::raiseFailedResult(*outcome->failed_input, device.index());
  }
  if (outcome->error) {
    if (probe != nullptr) {
      try {
        std::rethrow_exception(outcome->error);
      } catch (const std::exception& e) {
        c10::kiln::throwKernelFailure(
            info.schema->name(),
            describeInputs(info, *stack, first) + ": " + c10::kiln::kernelErrorMessageOf(e),
            c10::kiln::kernelErrorClassOf(e));
      }
    }
    std::rethrow_exception(outcome->error);
  }

  // out= arguments: an empty or wrongly sized kiln tensor takes the layout
  // the CPU kernel gave its output (as resizing it on CPU would); then copy.
  for (size_t i = 0; i < num_args; ++i) {
    if (host_outs[i].defined()) {
      const at::Tensor& kiln_out = (*stack)[first + i].toTensor();
      if (kiln_out.numel() == 0 || !kiln_out.sizes().equals(host_outs[i].sizes())) {
        TensorLayout layout = TensorLayout::of(host_outs[i]);
        layout.storage_offset = kiln_out.storage_offset();
        adoptLayout(kiln_out, layout);
      }
      kiln_out.copy_(host_outs[i], /*non_blocking=*/true); // staged: see below
    } else if (aliased_outs[i].defined()) {
      // The kernel wrote the kiln memory itself; it may have resized its
      // alias within the storage, as CPU resizes an out= view.
      adoptLayout((*stack)[first + i].toTensor(), TensorLayout::of(aliased_outs[i]));
    }
  }

  // Map host results back to kiln values.
  auto toKiln = [&](const at::Tensor& host, const ReturnInfo& r) -> at::Tensor {
    if (!host.defined()) {
      return host;
    }
    if (host.layout() != c10::kStrided) { // dense.to_sparse(), sparse gradients, ...
      std::vector<at::Tensor> kiln_arguments;
      for (size_t i = 0; i < num_args; ++i) {
        forEachTensorIn((*stack)[first + i], info.arg_kinds[i], [&](const at::Tensor& t) {
          if (t.defined() && t.device().is_privateuseone()) {
            kiln_arguments.push_back(t);
          }
        });
      }
      return sparseHostResultToKiln(host, device, kiln_arguments);
    }
    if (r.kind == ReturnKind::View) {
      // A view of an argument: find the kiln tensor whose bytes it shares.
      const void* data = host.storage().data();
      for (size_t i = 0; i < num_args; ++i) {
        at::Tensor match;
        forEachTensorIn((*stack)[first + i], info.arg_kinds[i], [&](const at::Tensor& t) {
          if (!match.defined() && t.defined() && t.device().is_privateuseone() &&
              t.storage().data() == data) {
            match = t;
          }
        });
        if (match.defined()) {
          return viewOf(match, TensorLayout::of(host));
        }
      }
    }
    at::Tensor result = host.is_non_overlapping_and_dense()
        ? freshLike(info, TensorLayout::of(host), device)
        : at::empty(host.sizes(), at::TensorOptions().dtype(host.dtype()).device(device));
    // `host` is a pageable temporary of this call: the runtime stages it at
    // the copy, so the copy need not wait (Note [Kiln copies]).
    result.copy_(host, /*non_blocking=*/true);
    return result;
  };

  const size_t num_returns = info.returns.size();
  Stack results;
  results.reserve(num_returns);
  for (size_t r = 0; r < num_returns; ++r) {
    const ReturnInfo& ret = info.returns[r];
    const c10::IValue& host = outcome->results[r];
    if (ret.kind == ReturnKind::Mutated) {
      results.push_back((*stack)[first + static_cast<size_t>(ret.source)]);
    } else if (ret.kind == ReturnKind::NonTensor) {
      results.push_back(host);
    } else if (ret.is_list) {
      std::vector<at::Tensor> tensors;
      for (const c10::IValue& element : host.toListRef()) {
        tensors.push_back(toKiln(element.toTensor(), ret));
      }
      results.emplace_back(c10::List<at::Tensor>(tensors));
    } else {
      results.emplace_back(toKiln(host.toTensor(), ret));
    }
  }
  if (probe != nullptr) {
    probe->cpu_out_args.assign(num_args, std::nullopt);
    for (size_t i = 0; i < num_args; ++i) {
      if (out_was_empty[i]) {
        probe->cpu_out_args[i] = TensorLayout::of((*stack)[first + i].toTensor());
      }
    }
    probe->cpu_results.assign(num_returns, {});
    for (size_t r = 0; r < num_returns; ++r) {
      if (info.returns[r].kind == ReturnKind::Fresh) {
        forEachTensorIn(outcome->results[r],
                        returnArgKind(info.returns[r]),
                        [&](const at::Tensor& t) { probe->cpu_results[r].push_back(TensorLayout::of(t)); });
        if (!info.returns[r].is_list && probe->cpu_results[r].empty()) {
          probe->cpu_results[r].emplace_back();
        }
      }
    }
  }
  if (probe != nullptr && probe->signature != nullptr) {
    MetaOutcome learned;
    learned.returns.resize(num_returns);
    for (size_t r = 0; r < num_returns; ++r) {
      if (info.returns[r].kind == ReturnKind::Fresh || info.returns[r].kind == ReturnKind::View) {
        forEachTensorIn(results[r], returnArgKind(info.returns[r]),
                        [&](const at::Tensor& t) { learned.returns[r].push_back(TensorLayout::of(t)); });
        if (!info.returns[r].is_list && learned.returns[r].empty()) {
          learned.returns[r].emplace_back(); // an undefined tensor
        }
      }
    }
    learned.mutable_args.resize(num_args);
    for (size_t i = 0; i < num_args; ++i) {
      if (info.arg_is_mutable[i]) {
        forEachTensorIn((*stack)[first + i], info.arg_kinds[i], [&](const at::Tensor& t) {
          learned.mutable_args[i].push_back(TensorLayout::of(t));
        });
      }
    }
    LayoutCache::insert(*probe->signature, std::move(learned));
  }
  torch::jit::drop(*stack, num_args);
  for (auto& value : results) {
    stack->push_back(std::move(value));
  }
}

// Before a synchronous run: an out= argument that shares memory with another
// argument keeps its host alias in runSynchronously, which cannot grow its
// storage. Where `meta` (the meta kernel's outcome for this call) says the
// kernel's resize needs more bytes than the storage has, the kiln storage
// grows now, contents kept (resizeStorageBytes, ordered on the stream), as
// CPU's resize_ grows the shared storage inside the kernel; the other
// arguments over that storage then read the new memory, as on CPU.
void growAliasedOutStorages(const OpSchemaInfo& info, const Stack& stack, size_t first,
                            const MetaOutcome& meta) {
  for (size_t i = 0; i < info.arg_kinds.size(); ++i) {
    if (!info.arg_is_out[i] || !outSharesMemory(info, stack, first, i)) {
      continue; // runSynchronously gives it a fresh host tensor
    }
    size_t j = 0;
    forEachTensorIn(stack[first + i], info.arg_kinds[i], [&](const at::Tensor& t) {
      const TensorLayout& layout = meta.mutable_args[i][j++];
      const size_t needed = at::detail::computeStorageNbytes(
          layout.sizes, layout.strides, t.dtype().itemsize(),
          static_cast<size_t>(layout.storage_offset));
      if (needed > t.storage().nbytes()) {
        c10::kiln::resizeStorageBytes(t.storage().unsafeGetStorageImpl(), needed);
      }
    });
  }
}

} // namespace

// ---------------------------------------------------------------- main path

void runOnKiln(const c10::OperatorHandle& op, Stack* stack) {
  const OpSchemaInfo& info = opSchemaInfo(op);
  const size_t num_args = info.arg_kinds.size();
  TORCH_INTERNAL_ASSERT(stack->size() >= num_args);
  const size_t first = stack->size() - num_args;

  const c10::Device device = resolveDevice(info, stack, first);
  const c10::DeviceGuard device_guard(device);
  recordExecutedOp(info.schema->operator_name());

  TORCH_CHECK_NOT_IMPLEMENTED(
      info.has_cpu_kernel,
      "The operator '", opName(info), "' is not implemented for kiln: the reference device runs "
      "ATen's CPU kernels and this operator has none. Please file an issue with the program "
      "that needs it.");

  if (info.is_data_dependent ||
      (info.sparse_flag_arg >= 0 &&
       (*stack)[first + static_cast<size_t>(info.sparse_flag_arg)].toBool())) {
    runSynchronously(op, info, stack, first, device);
    return;
  }
  if (info.has_out_args) {
    // Note [Out= arguments that overlap inputs]
    uint64_t full_overlaps = 0;
    OutOverlap overlap = classifyOutOverlap(info, *stack, first, &full_overlaps);
    if (overlap == OutOverlap::Unknown) {
      const std::optional<bool> accepted = probeFullOverlap(op, info, *stack, first);
      if (accepted == true) {
        const_cast<OpSchemaInfo&>(info).accepts_out_fully_overlapping.fetch_or(full_overlaps);
        overlap = OutOverlap::Harmless;
      } else {
        overlap = OutOverlap::Synchronous;
      }
    }
    if (overlap == OutOverlap::Synchronous) {
      if (info.has_meta_kernel) {
        // The resize the kernel will make, if the meta kernel gets that far
        // (its overlap checks are CPU's): an aliased out= cannot grow inside
        // the synchronous run.
        DiscardingHandler handler;
        c10::WarningUtils::WarningHandlerGuard guard(&handler);
        if (const std::optional<MetaOutcome> meta = runMetaKernel(op, info, *stack, first)) {
          growAliasedOutStorages(info, *stack, first, *meta);
        }
      }
      runSynchronously(op, info, stack, first, device); // raises CPU's error, if any
      const_cast<OpSchemaInfo&>(info).accepts_out_fully_overlapping.fetch_or(full_overlaps);
      return;
    }
  }
  if (info.checks_empty_inputs && hasEmptyInput(info, *stack, first)) {
    // The CPU kernel may reject the empty input where the meta kernel would
    // not. With every input empty, the kernel needs no values: running it on
    // host images raises CPU's error at the call without waiting for the
    // device. Otherwise run the op synchronously.
    std::optional<Stack> images = emptyHostImages(info, *stack, first);
    if (!images.has_value()) {
      runSynchronously(op, info, stack, first, device);
      return;
    }
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &*images);
  }

  // Step 2: layouts, from the layout cache or the meta kernel.
  std::optional<LayoutCache::Signature> signature = LayoutCache::signatureOf(info, *stack, first);
  const MetaOutcome* cached = signature ? LayoutCache::find(*signature) : nullptr;
  MetaOutcome computed;
  if (cached == nullptr) {
    std::optional<LayoutCache::Signature> layout_class;
    if (info.checks_dtypes_at_call) {
      // Note [Dtype errors at the call]
      layout_class = LayoutCache::layoutClassOf(info, *stack, first);
      auto support = LayoutCache::dtypeSupport(*layout_class);
      if (support == LayoutCache::DtypeSupport::Unknown) {
        support = probeDtypes(op, info, *stack, first);
        LayoutCache::setDtypeSupport(*layout_class, support);
      }
      if (support == LayoutCache::DtypeSupport::Unsupported) {
        runSynchronously(op, info, stack, first, device); // raises CPU's error
        LayoutCache::setDtypeSupport(*layout_class, LayoutCache::DtypeSupport::Supported);
        return;
      }
    }
    // Note [Verifying meta kernels]: is the meta kernel's layout CPU's?
    auto trust = LayoutCache::MetaTrust::Trusted;
    if (info.layouts_from_cpu.load(std::memory_order_relaxed) || !info.has_meta_kernel) {
      trust = LayoutCache::MetaTrust::Untrusted;
    } else if (info.has_fresh_returns || hasEmptyOutArgument(info, *stack, first)) {
      if (!layout_class) {
        layout_class = LayoutCache::layoutClassOf(info, *stack, first);
      }
      trust = layout_class ? LayoutCache::trust(*layout_class) : LayoutCache::MetaTrust::Untrusted;
    }
    LayoutProbe probe;
    probe.signature = signature ? &*signature : nullptr;
    if (trust == LayoutCache::MetaTrust::Untrusted) {
      runSynchronously(op, info, stack, first, device, &probe);
      return;
    }
    std::optional<MetaOutcome> meta = runMetaKernel(op, info, *stack, first);
    if (!meta.has_value()) {
      // The meta kernel could not decide (or the inputs are invalid): run the
      // CPU kernel synchronously, which raises the CPU's own error if invalid.
      // If it turned out to be Meta's fallback (no meta kernel at all), the
      // CPU run's layouts serve this signature from now on.
      runSynchronously(op, info, stack, first, device,
                       info.layouts_from_cpu.load(std::memory_order_relaxed) ? &probe : nullptr);
      return;
    }
    if (trust == LayoutCache::MetaTrust::Unknown) {
      growAliasedOutStorages(info, *stack, first, *meta);
      runSynchronously(op, info, stack, first, device, &probe);
      bool agree = true;
      bool decisive = true; // every layout compared shows its dimension order
      for (size_t r = 0; r < info.returns.size() && agree; ++r) {
        if (info.returns[r].kind != ReturnKind::Fresh) {
          continue;
        }
        const auto& expected = meta->returns[r];
        const auto& actual = probe.cpu_results[r];
        agree = expected.size() == actual.size();
        for (size_t k = 0; k < expected.size() && agree; ++k) {
          agree = expected[k].sameAs(actual[k]);
          decisive = decisive && actual[k].showsDimensionOrder();
        }
      }
      for (size_t i = 0; i < num_args && agree; ++i) {
        if (probe.cpu_out_args[i].has_value()) {
          agree = meta->mutable_args[i].size() == 1 &&
              meta->mutable_args[i][0].sameAs(*probe.cpu_out_args[i]);
          decisive = decisive && probe.cpu_out_args[i]->showsDimensionOrder();
        }
      }
      // Agreement on a degenerate result (linalg.eig of a 1x1 matrix) says
      // nothing about larger ones: the class stays unverified, and this
      // call's signature keeps the layouts its CPU run gave.
      if (!agree || decisive) {
        LayoutCache::setTrust(*layout_class, agree);
      }
      return;
    }
    computed = std::move(*meta);
  }
  const MetaOutcome& outcome = cached != nullptr ? *cached : computed;

  // An out= argument that shares memory with another argument and that the
  // meta kernel resizes: its overlap was judged before the resize (Note [Out=
  // arguments that overlap inputs]), and after it the overlap may differ, so
  // the call runs synchronously on host aliases, where CPU's own checks see
  // the resized tensor. A host alias cannot grow its storage, so a storage
  // the resize outgrows is grown first, contents kept, as CPU's resize_
  // grows it inside the kernel (the other arguments over the same storage
  // see the new memory, as on CPU).
  if (info.has_out_args) {
    bool resized = false;
    for (size_t i = 0; i < num_args && !resized; ++i) {
      if (!info.arg_is_out[i] || !outSharesMemory(info, *stack, first, i)) {
        continue;
      }
      size_t j = 0;
      forEachTensorIn((*stack)[first + i], info.arg_kinds[i], [&](const at::Tensor& t) {
        const TensorLayout& layout = outcome.mutable_args[i][j++];
        resized |= !t.sizes().equals(layout.sizes) || !t.strides().equals(layout.strides) ||
            t.storage_offset() != layout.storage_offset;
      });
    }
    if (resized) {
      growAliasedOutStorages(info, *stack, first, outcome);
      runSynchronously(op, info, stack, first, device);
      return;
    }
  }

  // Mutable arguments the meta kernel resized (out= with the wrong size).
  for (size_t i = 0; i < num_args; ++i) {
    if (!info.arg_is_mutable[i]) {
      continue;
    }
    size_t j = 0;
    forEachTensorIn((*stack)[first + i], info.arg_kinds[i], [&](const at::Tensor& t) {
      adoptLayout(t, outcome.mutable_args[i][j++]);
    });
  }

  // Outputs.
  const size_t num_returns = info.returns.size();
  Stack results;
  results.reserve(num_returns);
  c10::SmallVector<at::Tensor, 4> fresh;
  for (size_t r = 0; r < num_returns; ++r) {
    const ReturnInfo& ret = info.returns[r];
    const auto& layouts = outcome.returns[r];
    switch (ret.kind) {
      case ReturnKind::Mutated:
        results.push_back((*stack)[first + static_cast<size_t>(ret.source)]);
        break;
      case ReturnKind::View: {
        const c10::IValue& source = (*stack)[first + static_cast<size_t>(ret.source)];
        TORCH_INTERNAL_ASSERT(source.isTensor(), "view of a tensor list is unsupported");
        if (ret.is_list) {
          std::vector<at::Tensor> views;
          for (const auto& layout : layouts) {
            views.push_back(viewOf(source.toTensor(), layout));
          }
          results.emplace_back(c10::List<at::Tensor>(views));
        } else {
          results.emplace_back(viewOf(source.toTensor(), layouts[0]));
        }
        break;
      }
      case ReturnKind::Fresh:
        if (ret.is_list) {
          std::vector<at::Tensor> outputs;
          for (const auto& layout : layouts) {
            outputs.push_back(freshLike(info, layout, device));
            fresh.push_back(outputs.back());
          }
          results.emplace_back(c10::List<at::Tensor>(outputs));
        } else {
          fresh.push_back(freshLike(info, layouts[0], device));
          results.emplace_back(fresh.back());
        }
        break;
      case ReturnKind::NonTensor:
        TORCH_INTERNAL_ASSERT(false, "non-tensor returns take the synchronous path");
    }
  }
  if (cached == nullptr && signature.has_value() && !computed.uncacheable) {
    LayoutCache::insert(*signature, std::move(computed));
  }

  // Step 3: the kernel on the stream (nothing to do for pure views).
  if (info.has_mutable_args || info.has_fresh_returns) {
    const KilnStream stream = c10::kiln::getCurrentKilnStream(device.index());
    if (C10_UNLIKELY(adaptiveEagerEnabled()) && mayFuse(op, info)) {
      // Note [Adaptive eager fusion]
      c10::SmallVector<c10::IValue, 4> host_args;
      for (size_t i = 0; i < num_args; ++i) {
        host_args.push_back(hostValueOf(info, (*stack)[first + i], info.arg_kinds[i], stream));
      }
      if (enqueueFusible(op, info, host_args, fresh, stream)) {
        torch::jit::drop(*stack, num_args);
        for (auto& value : results) {
          stack->push_back(std::move(value));
        }
        return;
      }
    }
    KernelLaunch* launch = KernelLaunch::acquire();
    launch->setOperator(op, info);
    for (size_t i = 0; i < num_args; ++i) {
      const ArgKind kind = info.arg_kinds[i];
      launch->addArgument(hostValueOf(info, (*stack)[first + i], kind, stream), kind,
                          info.arg_is_mutable[i], info.arg_is_overwritten[i]);
    }
    for (const auto& output : fresh) {
      launch->addOutput(output);
    }
    launch->launch(stream);
  }

  torch::jit::drop(*stack, num_args);
  for (auto& value : results) {
    stack->push_back(std::move(value));
  }
}

void kilnFallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  runOnKiln(op, stack);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&kilnFallback>());
}

namespace {

// Every op dispatched for a quantized tensor on kiln (QuantizedPrivateUse1):
// creating one (Tensor.to("kiln") of a quantized tensor, empty(...,
// dtype=torch.qint8, device="kiln"), _empty_affine_quantized) lands here.
void quantizedFallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t first = stack->size() - num_args;
  std::string what = "a quantized tensor";
  for (size_t i = 0; i < num_args; ++i) {
    const c10::IValue& value = (*stack)[first + i];
    if (value.isTensor() && value.toTensor().defined() && value.toTensor().is_quantized()) {
      const at::Tensor& t = value.toTensor();
      what = quantizedTensorDescription(t.scalar_type(), t.qscheme());
      break;
    }
  }
  if (what == "a quantized tensor") {
    if (auto dtype = quantizedDtypeArgument(schema, *stack, first)) {
      what = quantizedTensorDescription(*dtype);
    }
  }
  const std::string name = schema.overload_name().empty()
      ? schema.name()
      : schema.name() + "." + schema.overload_name();
  raiseQuantizedNotSupported(name, what);
}

} // namespace

TORCH_LIBRARY_IMPL(_, QuantizedPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&quantizedFallback>());
}

} // namespace at::kiln
