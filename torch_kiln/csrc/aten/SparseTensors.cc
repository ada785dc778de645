// SparseTensors.cc — sparse COO and sparse compressed tensors on kiln: the
// structural kernels and the boxed fallback that runs every other sparse op.
#include "aten/SparseTensors.h"

#include <algorithm>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/SparseCsrTensorImpl.h>
#include <ATen/SparseCsrTensorUtils.h>
#include <ATen/SparseTensorImpl.h>
#include <ATen/native/SparseTensorUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/_coalesced_native.h>
#include <ATen/ops/_indices_native.h>
#include <ATen/ops/_nnz_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_and_tensors_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_native.h>
#include <ATen/ops/_values_native.h>
#include <ATen/ops/ccol_indices_native.h>
#include <ATen/ops/col_indices_native.h>
#include <ATen/ops/copy_native.h>
#include <ATen/ops/copy_sparse_to_sparse_native.h>
#include <ATen/ops/crow_indices_native.h>
#include <ATen/ops/dense_dim_native.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_native.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/indices_native.h>
#include <ATen/ops/is_coalesced_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/row_indices_native.h>
#include <ATen/ops/sparse_dim_native.h>
#include <ATen/ops/sparse_resize_and_clear_native.h>
#include <ATen/ops/sparse_resize_native.h>
#include <ATen/ops/values_native.h>
#include <ATen/ops/zero_native.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "aten/ArgumentTensors.h"
#include "aten/KilnTask.h"
#include "aten/OpSchemaInfo.h"
#include "aten/OpTracking.h"
#include "aten/TensorAliases.h"
#include "core/KilnStream.h"

namespace at::kiln {

// Note [Sparse tensors on kiln]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A kiln sparse tensor is PyTorch's own SparseTensorImpl (layout
// torch.sparse_coo, dispatch key SparsePrivateUse1) or SparseCsrTensorImpl
// (torch.sparse_csr / csc / bsr / bsc, key SparseCsrPrivateUse1) whose member
// tensors — indices and values; compressed indices, plain indices and values
// — are ordinary dense kiln tensors, as CUDA's are CUDA tensors. Its ops run
// two ways:
//  * Structure: building one from member tensors (what torch.sparse_coo_tensor,
//    torch.sparse_csr_tensor and .to("kiln") / .cpu() call), reading members,
//    nnz, dims, the coalesced flag, empty, resize, and copy_ between sparse
//    tensors. These are ATen's device-generic kernels, registered below: they
//    read no device data, and copy_ moves members with kiln's dense copies
//    (asynchronous, like any copy).
//  * Compute (coalesce, add, mul, mm, addmm, to_dense, sampled_addmm, sum,
//    transpose, ... every other op): the boxed fallback runs ATen's SparseCPU
//    or SparseCsrCPU kernel in a task on the current kiln stream, over host
//    stand-ins whose members alias the kiln members' bytes, and the calling
//    thread waits for it: a sparse result's nnz depends on the data, as it
//    does for most of CUDA's sparse kernels, which synchronize to learn it.
//    Each such call is counted in torch.kiln.get_sync_ops(). Results come
//    back as kiln tensors: a member or dense result that shares bytes with an
//    argument becomes a view of that kiln tensor, anything else is copied
//    into fresh kiln memory. A sparse argument the op mutates (add_, zero_,
//    out=) is given to the kernel with resizable host copies of its members
//    (the kernel may grow nnz), and its kiln members are updated afterwards:
//    in place when their sizes did not change, replaced when they did.
// So every layout PyTorch's CPU backend supports works on kiln, with CPU's
// numbers and CPU's errors; an op CPU lacks for a layout raises
// NotImplementedError naming the op and the layout.

namespace {

using c10::kiln::KilnStream;
using torch::jit::Stack;

bool isKiln(const at::Tensor& t) {
  return t.defined() && t.device().is_privateuseone();
}

bool isSparseLayout(c10::Layout layout) {
  return layout == c10::kSparse || at::sparse_csr::is_sparse_compressed(layout);
}

// A sparse compressed tensor over the given members, built without reading
// them: _sparse_compressed_tensor_unsafe validates the members' values when
// torch.sparse.check_sparse_tensor_invariants is on, which would read kiln
// memory (through host aliases) before the stream has written it. (The COO
// constructor used here, new_with_dims_and_tensor_sparse, never validates.)
at::Tensor compressedTensor(const at::Tensor& compressed, const at::Tensor& plain,
                            const at::Tensor& values, at::IntArrayRef size, c10::Layout layout,
                            c10::Device device) {
  const c10::DispatchKey key = device.is_cpu() ? c10::DispatchKey::SparseCsrCPU
                                               : c10::DispatchKey::SparseCsrPrivateUse1;
  at::Tensor tensor = at::detail::make_tensor<at::SparseCsrTensorImpl>(
      c10::DispatchKeySet(key), device, layout, values.dtype());
  at::sparse_csr::get_sparse_csr_impl(tensor)->set_member_tensors(compressed, plain, values,
                                                                   size);
  return tensor;
}

// Host stand-ins of one op call's kiln tensors, and kiln tensors of its host
// results (Note [Sparse tensors on kiln]). Built on the calling thread; the
// stand-ins may be read and written only by the task the call launches.
class SparseHostMapping {
 public:
  explicit SparseHostMapping(c10::Device device) : device_(device), aliaser_(c10::kCPU) {}

  // A stand-in for argument `t`: CPU tensors pass through, dense kiln tensors
  // become host aliases, sparse kiln tensors become CPU sparse tensors whose
  // members alias theirs, or (`mutated`) are fresh host tensors that the task
  // fills from the members before the kernel runs. A sparse tensor passed as
  // several arguments (smm calls sspaddmm.out(result, result, ...)) gets one
  // stand-in, so the kernel sees the aliasing CPU would.
  at::Tensor toHost(const at::Tensor& t, bool mutated) {
    if (!isKiln(t)) {
      return t;
    }
    const c10::Layout layout = t.layout();
    if (layout == c10::kStrided) {
      return denseToHost(t);
    }
    for (const auto& [kiln, host] : sparse_stand_ins_) {
      if (kiln == t.unsafeGetTensorImpl()) {
        return host;
      }
    }
    at::Tensor host = sparseToHost(t, mutated);
    sparse_stand_ins_.emplace_back(t.unsafeGetTensorImpl(), host);
    return host;
  }

  // A kiln tensor for host result `host` (see the Note).
  at::Tensor toKiln(const at::Tensor& host) {
    if (!host.defined() || isKiln(host)) {
      return host;
    }
    const c10::Layout layout = host.layout();
    if (layout == c10::kStrided) {
      return denseToKiln(host);
    }
    if (layout == c10::kSparse) {
      return at::native::new_with_dims_and_tensor_sparse_symint(
          host.sparse_dim(), host.dense_dim(), host.sym_sizes(), denseToKiln(host._indices()),
          denseToKiln(host._values()), host.scalar_type(), c10::kSparse, device_, std::nullopt,
          host.is_coalesced());
    }
    if (at::sparse_csr::is_sparse_compressed(layout)) {
      auto [compressed, plain] = at::sparse_csr::getCompressedPlainIndices(host);
      return compressedTensor(denseToKiln(compressed), denseToKiln(plain),
                              denseToKiln(host.values()), host.sizes(), layout, device_);
    }
    TORCH_CHECK_NOT_IMPLEMENTED(false, "kiln has no tensors with layout ", layout,
                                " (a result of this op on CPU)");
  }

  // Gives kiln argument `kiln`, which the kernel mutated through its stand-in
  // `host`, the stand-in's final state.
  void writeBack(const at::Tensor& kiln, const at::Tensor& host) {
    if (!isKiln(kiln)) {
      return;
    }
    if (kiln.layout() == c10::kStrided) {
      const bool same_layout = host.storage().is_alias_of(aliasStorageOf(kiln)) &&
          host.sizes().equals(kiln.sizes()) && host.strides().equals(kiln.strides()) &&
          host.storage_offset() == kiln.storage_offset();
      if (!same_layout) { // an out= tensor the kernel resized: as on CPU
        if (!kiln.sizes().equals(host.sizes())) {
          kiln.resize_(host.sizes());
        }
        kiln.copy_(host, /*non_blocking=*/true); // staged, see denseToKiln
      }
      return;
    }
    if (kiln.layout() == c10::kSparse) {
      auto* impl = at::sparse::get_sparse_impl(kiln);
      const at::Tensor old_indices = kiln._indices();
      const at::Tensor old_values = kiln._values();
      const at::Tensor new_indices = host._indices();
      const at::Tensor new_values = host._values();
      at::Tensor indices = memberAfter(old_indices, new_indices);
      at::Tensor values = memberAfter(old_values, new_values);
      impl->raw_resize_(host.sparse_dim(), host.dense_dim(), host.sizes());
      impl->set_indices_and_values_unsafe(indices, values);
      impl->set_coalesced(host.is_coalesced());
      return;
    }
    auto [old_compressed, old_plain] = at::sparse_csr::getCompressedPlainIndices(kiln);
    auto [new_compressed, new_plain] = at::sparse_csr::getCompressedPlainIndices(host);
    const at::Tensor old_values = kiln.values();
    const at::Tensor new_values = host.values();
    TORCH_CHECK_NOT_IMPLEMENTED(kiln.layout() == host.layout(), "an op changed the layout of a ",
                                kiln.layout(), " kiln tensor to ", host.layout());
    at::sparse_csr::get_sparse_csr_impl(kiln)->set_member_tensors(
        memberAfter(old_compressed, new_compressed), memberAfter(old_plain, new_plain),
        memberAfter(old_values, new_values), host.sym_sizes());
  }

  // A dense out= argument's stand-in: a host copy the kernel may resize
  // (kernels of structured ops' sparse out= variants also expect it to hold
  // its sizes already, as the structured wrapper allocated it).
  at::Tensor stagedDense(const at::Tensor& kiln) {
    const auto options = kiln.options().device(c10::kCPU);
    at::Tensor copy = kiln.is_non_overlapping_and_dense()
        ? at::empty_strided(kiln.sizes(), kiln.strides(), options)
        : at::empty(kiln.sizes(), options);
    staging_.emplace_back(copy, denseToHost(kiln));
    return copy;
  }

  // Kiln tensors `host` results may alias (a dense kernel's arguments).
  void addKnownKilnTensor(const at::Tensor& kiln) {
    if (isKiln(kiln) && kiln.layout() == c10::kStrided) {
      dense_.push_back(kiln);
    }
  }

  // (destination host tensor, source host alias) pairs the task copies
  // before running the kernel.
  std::vector<std::pair<at::Tensor, at::Tensor>> takeStaging() { return std::move(staging_); }

 private:
  at::Tensor sparseToHost(const at::Tensor& t, bool mutated) {
    const c10::Layout layout = t.layout();
    auto member = [&](const at::Tensor& m) { return mutated ? stagedCopy(m) : denseToHost(m); };
    if (layout == c10::kSparse) {
      return at::native::new_with_dims_and_tensor_sparse_symint(
          t.sparse_dim(), t.dense_dim(), t.sym_sizes(), member(t._indices()),
          member(t._values()), t.scalar_type(), c10::kSparse, c10::Device(c10::kCPU),
          std::nullopt, t.is_coalesced());
    }
    if (at::sparse_csr::is_sparse_compressed(layout)) {
      auto [compressed, plain] = at::sparse_csr::getCompressedPlainIndices(t);
      return compressedTensor(member(compressed), member(plain), member(t.values()), t.sizes(),
                              layout, c10::Device(c10::kCPU));
    }
    TORCH_CHECK_NOT_IMPLEMENTED(false, "kiln has no tensors with layout ", layout);
  }

  at::Tensor denseToHost(const at::Tensor& t) {
    dense_.push_back(t);
    return aliaser_.alias(t);
  }

  at::Tensor stagedCopy(const at::Tensor& member) {
    at::Tensor copy = at::empty(member.sizes(), member.options().device(c10::kCPU));
    staging_.emplace_back(copy, denseToHost(member));
    staged_members_.emplace_back(copy.storage().unsafeGetStorageImpl(), member);
    return copy;
  }

  c10::Storage aliasStorageOf(const at::Tensor& kiln) { return aliaser_.alias(kiln).storage(); }

  // The kiln tensor `host` stands for: a view of the kiln argument whose
  // bytes it shares, or a fresh copy.
  at::Tensor denseToKiln(const at::Tensor& host) {
    if (isKiln(host)) {
      return host;
    }
    const void* data = host.storage().data();
    if (data != nullptr) {
      for (const at::Tensor& k : dense_) {
        if (k.storage().data() != data) {
          continue;
        }
        if (k.scalar_type() == host.scalar_type()) {
          return k.as_strided(host.sizes(), host.strides(), host.storage_offset());
        }
        // A view with another dtype (view_as_real of complex values).
        return at::empty({0}, k.options().dtype(host.dtype()))
            .set_(k.storage(), host.storage_offset(), host.sizes(), host.strides());
      }
    }
    const auto options = host.options().device(device_);
    at::Tensor result = host.is_non_overlapping_and_dense()
        ? at::empty_strided(host.sizes(), host.strides(), options)
        : at::empty(host.sizes(), options);
    // `host` is a pageable temporary of this call (or a CPU argument): the
    // runtime stages it at the copy, so the copy need not wait (Note [Kiln
    // copies]).
    result.copy_(host, /*non_blocking=*/true);
    return result;
  }

  // The kiln member a mutated sparse argument holds after the kernel, as on
  // CPU: if the kernel wrote into the member in place (the stand-in still
  // holds the staged copy, same sizes), the kiln member is updated in place,
  // so tensors sharing it (s._values() views, another sparse tensor built on
  // the same values) see the write; if the kernel gave the tensor new members
  // (CPU's mul_ and add_ do), the kiln tensor gets new members too and the
  // old ones are left alone.
  at::Tensor memberAfter(const at::Tensor& kiln_member, const at::Tensor& host_member) {
    if (isKiln(host_member)) {
      return host_member;
    }
    const c10::StorageImpl* storage = host_member.storage().unsafeGetStorageImpl();
    for (const auto& [staged, member] : staged_members_) {
      if (staged == storage && member.storage().is_alias_of(kiln_member.storage()) &&
          host_member.sizes().equals(kiln_member.sizes())) {
        kiln_member.copy_(host_member, /*non_blocking=*/true); // staged: see denseToKiln
        return kiln_member;
      }
    }
    return denseToKiln(host_member);
  }

  c10::Device device_;
  TensorAliaser aliaser_;
  std::vector<at::Tensor> dense_; // kiln strided tensors aliased so far
  std::vector<std::pair<at::Tensor, at::Tensor>> staging_;
  std::vector<std::pair<const c10::TensorImpl*, at::Tensor>> sparse_stand_ins_;
  // (storage of a staged member copy, the kiln member it was copied from)
  std::vector<std::pair<const c10::StorageImpl*, at::Tensor>> staged_members_;
};

// The one kiln device of the call's tensors. As on CUDA, a host tensor with
// dimensions (or a sparse host tensor) next to kiln tensors is an error;
// 0-dim dense host tensors are scalars.
c10::Device deviceOfCall(const OpSchemaInfo& info, const Stack& stack, size_t first) {
  const c10::FunctionSchema& schema = *info.schema;
  std::optional<c10::Device> device;
  std::optional<c10::Device> host;
  for (size_t i = first; i < stack.size(); ++i) {
    forEachTensorIn(stack[i], info.arg_kinds[i - first], [&](const at::Tensor& t) {
      if (!t.defined()) {
        return;
      }
      if (isKiln(t)) {
        if (!device) {
          device = t.device();
        } else {
          TORCH_CHECK(*device == t.device(),
                      "Expected all tensors to be on the same device, but found at least two "
                      "devices, ", *device, " and ", t.device(),
                      "! (in ", opName(schema), ")");
        }
      } else if (t.dim() > 0 || t.layout() != c10::kStrided) {
        host = t.device();
      }
    });
  }
  TORCH_INTERNAL_ASSERT(device.has_value(), "sparse kiln fallback reached without a kiln tensor");
  TORCH_CHECK(!host, "Expected all tensors to be on the same device, but found at least two "
              "devices, ", *device, " and ", *host, "! (in ",
              opName(schema), ")");
  return *device;
}

// Note [Sparse tensors on kiln]: the compute path.
void runSparseOp(const c10::OperatorHandle& op, Stack* stack, c10::DispatchKey cpu_key,
                 const char* layouts) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t first = stack->size() - num_args;
  TORCH_CHECK_NOT_IMPLEMENTED(
      op.hasKernelForDispatchKey(cpu_key), "The operator '", opName(schema),
      "' is not implemented for ", layouts, " tensors on kiln: the reference device runs "
      "PyTorch's CPU kernels, and PyTorch has no ", c10::toString(cpu_key),
      " kernel for it either.");

  const OpSchemaInfo& info = opSchemaInfo(op);
  const c10::Device device = deviceOfCall(info, *stack, first);
  const c10::DeviceGuard device_guard(device);
  recordExecutedOp(schema.operator_name());
  recordSyncOp(schema.operator_name());
  const KilnStream stream = c10::kiln::getCurrentKilnStream(device.index());

  // Sparse tensors some mutable argument holds (maybe also passed read-only).
  std::vector<const c10::TensorImpl*> mutated_sparse;
  for (size_t i = 0; i < num_args; ++i) {
    if (info.arg_is_mutable[i]) {
      forEachTensorIn((*stack)[first + i], info.arg_kinds[i], [&](const at::Tensor& t) {
        if (isKiln(t) && t.layout() != c10::kStrided) {
          mutated_sparse.push_back(t.unsafeGetTensorImpl());
        }
      });
    }
  }
  auto isMutated = [&](const at::Tensor& t) {
    return std::find(mutated_sparse.begin(), mutated_sparse.end(), t.unsafeGetTensorImpl()) !=
        mutated_sparse.end();
  };

  SparseHostMapping mapping(device);
  Stack host_args;
  host_args.reserve(num_args);
  for (size_t i = 0; i < num_args; ++i) {
    const c10::IValue& value = (*stack)[first + i];
    if (info.arg_kinds[i] == ArgKind::Device && value.isDevice() &&
        value.toDevice().is_privateuseone()) {
      host_args.emplace_back(c10::Device(c10::kCPU));
      continue;
    }
    const bool out = info.arg_is_out[i];
    host_args.push_back(mapTensors(value, info.arg_kinds[i], [&](const at::Tensor& t) -> at::Tensor {
      if (out && isKiln(t) && t.layout() == c10::kStrided) {
        return mapping.stagedDense(t); // copied into the kiln tensor afterwards
      }
      return mapping.toHost(t, isMutated(t));
    }));
  }
  // The stand-ins of mutated arguments, kept for the write-back (the task
  // consumes its copy of the stack).
  std::vector<c10::IValue> mutated_host(num_args);
  for (size_t i = 0; i < num_args; ++i) {
    if (info.arg_is_mutable[i]) {
      mutated_host[i] = host_args[i];
    }
  }

  struct Outcome {
    Stack results;
    std::exception_ptr error;
  };
  auto outcome = std::make_shared<Outcome>();
  // Stand-ins made under torch.inference_mode() are inference tensors; the
  // task runs in the caller's mode (Note [Kiln tasks run in the issuer's
  // inference mode] in KilnTask.h).
  launchTask(stream, schema.name().c_str(),
             [op, args = std::move(host_args), staging = mapping.takeStaging(),
              outcome]() mutable {
               try {
                 for (auto& [destination, source] : staging) {
                   destination.copy_(source);
                 }
                 // Host stand-ins never require grad: skip autograd's layers.
                 const at::AutoDispatchBelowADInplaceOrView below_autograd;
                 op.callBoxed(&args);
                 outcome->results = std::move(args);
               } catch (...) {
                 outcome->error = std::current_exception(); // raised below, as thrown
               }
             });
  stream.synchronize();
  if (outcome->error) {
    std::rethrow_exception(outcome->error);
  }

  for (size_t i = 0; i < num_args; ++i) {
    if (!info.arg_is_mutable[i]) {
      continue;
    }
    const c10::IValue& kiln_value = (*stack)[first + i];
    if (kiln_value.isTensor() && mutated_host[i].isTensor()) {
      mapping.writeBack(kiln_value.toTensor(), mutated_host[i].toTensor());
    } else if (kiln_value.isTensorList() && mutated_host[i].isTensorList()) {
      const auto kilns = kiln_value.toTensorVector();
      const auto hosts = mutated_host[i].toTensorVector();
      for (size_t j = 0; j < kilns.size() && j < hosts.size(); ++j) {
        mapping.writeBack(kilns[j], hosts[j]);
      }
    }
  }

  const auto& returns = schema.returns();
  Stack results;
  results.reserve(returns.size());
  for (size_t r = 0; r < returns.size(); ++r) {
    const ReturnInfo& ret = info.returns[r];
    if (ret.kind == ReturnKind::Mutated) {
      results.push_back((*stack)[first + static_cast<size_t>(ret.source)]);
    } else {
      results.push_back(
          mapTensors(outcome->results[r], returnArgKind(ret),
                     [&](const at::Tensor& t) { return mapping.toKiln(t); }));
    }
  }
  torch::jit::drop(*stack, num_args);
  for (auto& value : results) {
    stack->push_back(std::move(value));
  }
}

void sparseCooFallback(const c10::OperatorHandle& op, Stack* stack) {
  runSparseOp(op, stack, c10::DispatchKey::SparseCPU, "sparse COO");
}

void sparseCompressedFallback(const c10::OperatorHandle& op, Stack* stack) {
  runSparseOp(op, stack, c10::DispatchKey::SparseCsrCPU,
              "sparse compressed (CSR, CSC, BSR, BSC)");
}

// ATen's SparseTensorImpl makes its initial members on the *current* device
// of the device type, so creating a sparse tensor for kiln:1 while kiln:0 is
// current would pair kiln:0 members with kiln:1 ones. CUDA's generated
// registrations put a device guard around these kernels; so do these.
at::Tensor sparseWithDims(int64_t sparse_dim, int64_t dense_dim, at::IntArrayRef size,
                          std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                          std::optional<at::Device> device, std::optional<bool> pin_memory) {
  const c10::OptionalDeviceGuard guard(device);
  return at::native::new_with_dims_sparse(sparse_dim, dense_dim, size, dtype, layout, device,
                                          pin_memory);
}

at::Tensor sparseWithDimsAndTensors(int64_t sparse_dim, int64_t dense_dim,
                                    c10::SymIntArrayRef size, const at::Tensor& indices,
                                    const at::Tensor& values, std::optional<at::ScalarType> dtype,
                                    std::optional<at::Layout> layout,
                                    std::optional<at::Device> device,
                                    std::optional<bool> pin_memory,
                                    std::optional<bool> is_coalesced) {
  TORCH_CHECK(indices.device() == values.device(),
              "Expected all tensors to be on the same device, but found at least two devices, ",
              indices.device(), " and ", values.device(),
              "! (indices and values of a sparse COO tensor)");
  const c10::OptionalDeviceGuard guard(device ? device : std::optional<c10::Device>(values.device()));
  return at::native::new_with_dims_and_tensor_sparse_symint(
      sparse_dim, dense_dim, size, indices, values, dtype, layout, device, pin_memory,
      is_coalesced);
}

at::Tensor emptySparse(c10::SymIntArrayRef size, std::optional<at::ScalarType> dtype,
                       std::optional<at::Layout> layout, std::optional<at::Device> device,
                       std::optional<bool> pin_memory,
                       std::optional<at::MemoryFormat> memory_format) {
  const c10::OptionalDeviceGuard guard(device);
  return at::native::empty_sparse_symint(size, dtype, layout, device, pin_memory, memory_format);
}

} // namespace

at::Tensor sparseHostResultToKiln(const at::Tensor& host, c10::Device device,
                                  c10::ArrayRef<at::Tensor> kiln_arguments) {
  TORCH_INTERNAL_ASSERT(isSparseLayout(host.layout()));
  SparseHostMapping mapping(device);
  for (const at::Tensor& t : kiln_arguments) {
    mapping.addKnownKilnTensor(t);
  }
  return mapping.toKiln(host);
}

// Structure: ATen's device-generic kernels (Note [Sparse tensors on kiln]).
TORCH_LIBRARY_IMPL(aten, SparsePrivateUse1, m) {
  m.impl("_sparse_coo_tensor_with_dims", TORCH_FN(sparseWithDims));
  m.impl("_sparse_coo_tensor_with_dims_and_tensors", TORCH_FN(sparseWithDimsAndTensors));
  m.impl("empty.memory_format", TORCH_FN(emptySparse));
  m.impl("_nnz", TORCH_FN(at::native::_nnz_sparse));
  m.impl("_indices", TORCH_FN(at::native::_indices_sparse));
  m.impl("_values", TORCH_FN(at::native::_values_sparse));
  m.impl("indices", TORCH_FN(at::native::indices_sparse));
  m.impl("values", TORCH_FN(at::native::values_sparse));
  m.impl("sparse_dim", TORCH_FN(at::native::sparse_dim_sparse));
  m.impl("dense_dim", TORCH_FN(at::native::dense_dim_sparse));
  m.impl("_dimI", TORCH_FN(at::native::sparse_dim_sparse));
  m.impl("_dimV", TORCH_FN(at::native::dense_dim_sparse));
  m.impl("is_coalesced", TORCH_FN(at::native::is_coalesced_sparse));
  m.impl("_coalesced_", TORCH_FN(at::native::_coalesced_sparse_));
  m.impl("sparse_resize_", TORCH_FN(at::native::sparse_resize_));
  m.impl("sparse_resize_and_clear_", TORCH_FN(at::native::sparse_resize_and_clear_));
  m.impl("copy_", TORCH_FN(at::native::copy_sparse_wrapper_));
  m.impl("zero_", TORCH_FN(at::native::zero_sparse_)); // resize_and_clear_: no device work
  // Across devices too (copy_ of a CPU sparse tensor into a kiln one).
  m.impl("copy_sparse_to_sparse_", TORCH_FN(at::native::copy_sparse_));
}

TORCH_LIBRARY_IMPL(aten, SparseCsrPrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(at::native::empty_sparse_compressed_symint));
  m.impl("_nnz", TORCH_FN(at::native::_nnz_sparse_csr));
  m.impl("crow_indices", TORCH_FN(at::native::crow_indices_sparse_csr));
  m.impl("col_indices", TORCH_FN(at::native::col_indices_sparse_csr));
  m.impl("ccol_indices", TORCH_FN(at::native::ccol_indices_sparse_csr));
  m.impl("row_indices", TORCH_FN(at::native::row_indices_sparse_csr));
  m.impl("values", TORCH_FN(at::native::values_sparse_csr));
  m.impl("sparse_dim", TORCH_FN(at::native::sparse_dim_sparse_csr));
  m.impl("dense_dim", TORCH_FN(at::native::dense_dim_sparse_csr));
  m.impl("resize_", TORCH_FN(at::native::resize_sparse_csr_));
  m.impl("copy_", TORCH_FN(at::native::copy_sparse_compressed_));
}

// Compute: everything else. The fallback alone is not enough: for an op
// with a composite kernel (a structured op's CompositeExplicitAutograd-
// NonFunctional wrapper, clone, empty_like, sum, ...) the dispatcher prefers
// the composite over a backend fallback, and composites are written for
// dense tensors (mm's wrapper allocates a CSR output and calls mm.out). CPU
// avoids them with direct SparseCPU / SparseCsrCPU kernels, so kiln gives
// exactly those ops direct kernels too (the same boxed function), once, when
// the library loads: kiln's sparse ops dispatch as CPU's do.
TORCH_LIBRARY_IMPL(_, SparsePrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&sparseCooFallback>());
}

TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&sparseCompressedFallback>());
}

namespace {

// Runs after the registrations above (static initialization follows
// definition order within a file).
struct MirrorCpuSparseKernels {
  MirrorCpuSparseKernels() {
    mirror(c10::DispatchKey::SparseCPU, c10::DispatchKey::SparsePrivateUse1, coo_library,
           torch::CppFunction::makeFromBoxedFunction<&sparseCooFallback>);
    mirror(c10::DispatchKey::SparseCsrCPU, c10::DispatchKey::SparseCsrPrivateUse1,
           compressed_library,
           torch::CppFunction::makeFromBoxedFunction<&sparseCompressedFallback>);
  }

  template <typename MakeKernel>
  static void mirror(c10::DispatchKey cpu_key, c10::DispatchKey kiln_key,
                     std::unique_ptr<torch::Library>& library, MakeKernel make_kernel) {
    library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", kiln_key,
                                               __FILE__, __LINE__);
    auto& dispatcher = c10::Dispatcher::singleton();
    for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) {
        continue;
      }
      auto op = dispatcher.findOp(name);
      if (!op || !op->hasKernelForDispatchKey(cpu_key) || op->hasKernelForDispatchKey(kiln_key)) {
        continue;
      }
      std::string qualified = name.name.substr(6);
      if (!name.overload_name.empty()) {
        qualified += "." + name.overload_name;
      }
      library->impl(qualified.c_str(), make_kernel());
    }
  }

  // The registrations last as long as the process (like TORCH_LIBRARY_IMPL's).
  std::unique_ptr<torch::Library> coo_library;
  std::unique_ptr<torch::Library> compressed_library;
};

const MirrorCpuSparseKernels mirror_cpu_sparse_kernels;

} // namespace

} // namespace at::kiln
