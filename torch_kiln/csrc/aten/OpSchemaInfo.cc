#include "aten/OpSchemaInfo.h"

#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include <ATen/core/jit_type.h>

namespace at::kiln {
namespace {

bool isTensorType(const c10::TypePtr& type) {
  return type->kind() == c10::TypeKind::TensorType;
}

bool isOptionalOf(const c10::TypePtr& type, c10::TypeKind kind) {
  if (type->kind() != c10::TypeKind::OptionalType) {
    return false;
  }
  return type->castRaw<c10::OptionalType>()->getElementType()->kind() == kind;
}

// int, SymInt, their optionals and lists.
bool isIntegerType(c10::TypePtr type) {
  if (type->kind() == c10::TypeKind::OptionalType) {
    type = type->castRaw<c10::OptionalType>()->getElementType();
  }
  if (type->kind() == c10::TypeKind::ListType) {
    type = type->castRaw<c10::ListType>()->getElementType();
  }
  return type->kind() == c10::TypeKind::IntType || type->kind() == c10::TypeKind::SymIntType;
}

// Integer arguments that name dimensions or modes, which tiny images of the
// tensors (same ranks) keep valid; other integers may be sizes, lengths or
// counts that kernels trust to match their tensors' shapes.
bool namesDimensionOrMode(const std::string& name) {
  static const std::unordered_set<std::string> names = {
      "dim", "dims", "dim0", "dim1", "dim2", "dimension", "reduction", "diagonal",
  };
  return names.count(name) != 0;
}

ArgKind argKindOf(const c10::TypePtr& type) {
  if (isTensorType(type)) {
    return ArgKind::Tensor;
  }
  if (isOptionalOf(type, c10::TypeKind::TensorType)) {
    return ArgKind::OptionalTensor;
  }
  if (type->kind() == c10::TypeKind::ListType) {
    const auto& element = type->castRaw<c10::ListType>()->getElementType();
    if (isTensorType(element)) {
      return ArgKind::TensorList;
    }
    if (isOptionalOf(element, c10::TypeKind::TensorType)) {
      return ArgKind::OptionalTensorList;
    }
  }
  if (type->kind() == c10::TypeKind::GeneratorType ||
      isOptionalOf(type, c10::TypeKind::GeneratorType)) {
    return ArgKind::Generator;
  }
  if (type->kind() == c10::TypeKind::DeviceObjType ||
      isOptionalOf(type, c10::TypeKind::DeviceObjType)) {
    return ArgKind::Device;
  }
  return ArgKind::Other;
}

// The alias annotation of an argument or return, looking inside lists
// (`Tensor(a)[]` annotates the list's element).
const c10::AliasInfo* aliasOf(const c10::Argument& argument) {
  const c10::AliasInfo* info = argument.alias_info();
  if (info != nullptr && info->beforeSets().empty() && !info->containedTypes().empty()) {
    return &info->containedTypes()[0];
  }
  return info;
}

bool sharesAliasSet(const c10::AliasInfo& a, const c10::AliasInfo& b) {
  for (const auto& set : a.beforeSets()) {
    if (b.beforeSets().count(set) != 0) {
      return true;
    }
  }
  return false;
}

// Ops whose outputs depend on tensor values, so their sizes cannot be known
// before the device has computed them.
bool isDataDependent(const std::string& name) {
  static const std::unordered_set<std::string> names = {
      "aten::nonzero",        "aten::masked_select",     "aten::unique_consecutive",
      "aten::_unique",        "aten::_unique2",          "aten::unique_dim",
      "aten::unique_dim_consecutive", "aten::bincount",  "aten::repeat_interleave",
      "aten::_local_scalar_dense",    "aten::equal",     "aten::is_nonzero",
      "aten::_assert_async",  "aten::nonzero_numpy",
      // Dense to sparse: nnz is the count of nonzeros (Note [Sparse tensors
      // on kiln] in SparseTensors.cc).
      "aten::_to_sparse",     "aten::_to_sparse_csr",    "aten::_to_sparse_csc",
      "aten::_to_sparse_bsr", "aten::_to_sparse_bsc",
  };
  return names.count(name) != 0;
}

// Reductions whose CPU kernels raise for empty inputs or empty reduced
// dimensions, checks their meta kernels do not make.
bool checksEmptyInputs(const std::string& name) {
  static const std::unordered_set<std::string> names = {
      "aten::max",    "aten::min",     "aten::amax",      "aten::amin",
      "aten::argmax", "aten::argmin",  "aten::aminmax",   "aten::median",
      "aten::nanmedian", "aten::mode", "aten::kthvalue",  "aten::linalg_vector_norm",
      "aten::norm",   "aten::cummax",  "aten::cummin",    "aten::_aminmax",
  };
  return names.count(name) != 0;
}

// Pointwise ops whose floating-point scalar arguments are mere operands: the
// meta kernel's decisions depend on their types, never their values.
bool scalarValuesIrrelevant(const std::string& name) {
  static const std::unordered_set<std::string> names = {
      "aten::add",       "aten::add_",      "aten::sub",        "aten::sub_",
      "aten::mul",       "aten::mul_",      "aten::div",        "aten::div_",
      "aten::rsub",      "aten::addcmul",   "aten::addcmul_",   "aten::addcdiv",
      "aten::addcdiv_",  "aten::lerp",      "aten::lerp_",      "aten::fill",
      "aten::fill_",     "aten::masked_fill", "aten::masked_fill_", "aten::clamp",
      "aten::clamp_",    "aten::clamp_min", "aten::clamp_min_", "aten::clamp_max",
      "aten::clamp_max_", "aten::hardtanh", "aten::hardtanh_",  "aten::leaky_relu",
      "aten::leaky_relu_", "aten::threshold", "aten::threshold_", "aten::where",
      "aten::addmm",     "aten::addmv",     "aten::baddbmm",    "aten::addbmm",
      "aten::nan_to_num", "aten::nan_to_num_", "aten::elu",     "aten::softplus",
  };
  return names.count(name) != 0 || name.rfind("aten::_foreach_", 0) == 0;
}

bool acceptsHostIndices(const std::string& name) {
  static const std::unordered_set<std::string> names = {
      "aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_",
      "aten::_unsafe_index", "aten::_unsafe_index_put",
  };
  return names.count(name) != 0;
}

// Ops whose meta kernels are known to disagree with their CPU kernels about
// output layouts: dtypes of statistics for half inputs (norms), strides of
// channels-last or transposed results (padding, unpooling, convolution,
// log_sigmoid's buffer, pixel_shuffle and pixel_unshuffle), conjugate bits
// (linalg solves), shapes of unused statistics (batch norm in eval mode).
// See Note [Meta layouts and CPU layouts].
bool layoutsFromCpuList(const std::string& name) {
  static const std::unordered_set<std::string> names = {
      "aten::native_layer_norm",        "aten::native_batch_norm",
      "aten::_native_batch_norm_legit", "aten::_native_batch_norm_legit_no_training",
      "aten::native_group_norm",        "aten::log_sigmoid_forward",
      "aten::reflection_pad1d",         "aten::reflection_pad2d",
      "aten::reflection_pad3d",         "aten::replication_pad1d",
      "aten::replication_pad2d",        "aten::replication_pad3d",
      "aten::reflection_pad1d_backward", "aten::reflection_pad2d_backward",
      "aten::reflection_pad3d_backward", "aten::replication_pad1d_backward",
      "aten::replication_pad2d_backward", "aten::replication_pad3d_backward",
      "aten::max_unpool2d",             "aten::max_unpool3d",
      "aten::convolution",              "aten::convolution_backward",
      "aten::linalg_solve_ex",          "aten::_linalg_solve_ex",
      "aten::linalg_lu_solve",          "aten::pixel_shuffle",
      "aten::pixel_unshuffle",
  };
  return names.count(name) != 0;
}

// The in-place ops that write every element of `self` without reading it.
// (KernelLaunch also clears fill_'s and zero_'s marks at launch.)
bool overwritesSelf(const c10::FunctionSchema& schema) {
  static const std::unordered_set<std::string> names = {
      "aten::fill_",      "aten::zero_",      "aten::uniform_",   "aten::normal_",
      "aten::random_",    "aten::exponential_", "aten::geometric_", "aten::log_normal_",
      "aten::cauchy_"};
  if (names.count(schema.name()) != 0) {
    return true;
  }
  // bernoulli_(float p): bernoulli_.Tensor reads its probabilities, not self.
  return schema.name() == "aten::bernoulli_";
}

std::unique_ptr<OpSchemaInfo> analyze(const c10::OperatorHandle& op) {
  auto info = std::make_unique<OpSchemaInfo>();
  const auto& schema = op.schema();
  info->schema = &schema;
  const auto& args = schema.arguments();
  for (const auto& arg : args) {
    info->arg_kinds.push_back(argKindOf(arg.type()));
    const c10::AliasInfo* alias = aliasOf(arg);
    const bool is_mutable = alias != nullptr && alias->isWrite();
    info->arg_is_mutable.push_back(is_mutable);
    info->arg_is_out.push_back(is_mutable && arg.kwarg_only());
    info->arg_is_overwritten.push_back(
        info->arg_is_out.back() ||
        (is_mutable && info->arg_is_mutable.size() == 1 && overwritesSelf(schema)));
    info->has_mutable_args |= is_mutable;
    info->has_out_args |= static_cast<bool>(info->arg_is_out.back());
  }
  for (const auto& ret : schema.returns()) {
    ReturnInfo r;
    const ArgKind kind = argKindOf(ret.type());
    r.is_list = kind == ArgKind::TensorList;
    if (kind != ArgKind::Tensor && kind != ArgKind::TensorList) {
      r.kind = ReturnKind::NonTensor;
      info->has_non_tensor_returns = true;
    } else if (const c10::AliasInfo* alias = aliasOf(ret); alias != nullptr) {
      r.kind = alias->isWrite() ? ReturnKind::Mutated : ReturnKind::View;
      for (size_t i = 0; i < args.size(); ++i) {
        const c10::AliasInfo* arg_alias = aliasOf(args[i]);
        if (arg_alias != nullptr && sharesAliasSet(*alias, *arg_alias)) {
          r.source = static_cast<int>(i);
          break;
        }
      }
      if (r.source < 0) {
        r.kind = ReturnKind::Fresh; // unannotated source: treat as new
      }
    }
    info->has_fresh_returns |= r.kind == ReturnKind::Fresh;
    info->has_view_returns |= r.kind == ReturnKind::View;
    info->returns.push_back(r);
  }
  info->is_data_dependent = info->has_non_tensor_returns || isDataDependent(schema.name());
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].name() == "sparse" && args[i].type()->kind() == c10::TypeKind::BoolType) {
      info->sparse_flag_arg = static_cast<int>(i);
    }
  }
  info->has_dynamic_output_shape = op.hasTag(at::Tag::dynamic_output_shape);
  info->has_meta_kernel = op.hasComputedKernelForDispatchKey(c10::DispatchKey::Meta);
  info->has_cpu_kernel = op.hasComputedKernelForDispatchKey(c10::DispatchKey::CPU);
  info->accepts_host_indices = acceptsHostIndices(schema.name());
  info->checks_empty_inputs = checksEmptyInputs(schema.name());
  info->scalar_values_irrelevant = scalarValuesIrrelevant(schema.name());
  info->layouts_from_cpu = layoutsFromCpuList(schema.name());
  // Only PyTorch's own kernels: they have no side effects an extra tiny run
  // could show (random ops get a throwaway generator), unlike custom ops.
  // Nor kernels that would trust what tiny images get wrong: integer
  // arguments describing sizes (ctc_loss's lengths, group_norm's N, C, HxW,
  // output sizes; a kernel may index by them unchecked), and LAPACK's pivots,
  // which are 1-based (lu_solve, lu_unpack). Enum arguments (a dtype, a
  // layout, a memory format) travel as ints but are not sizes: judged by
  // their real type, ops like cumsum(dtype=) are probed (their schema type
  // is int, which once kept `cumsum(bool, out=bool)` from raising at the
  // call). Nor ops told which device to build on (`*_like(device=)`,
  // `_to_copy`): a tiny run of their CPU kernel would allocate there.
  bool takes_tensors = false;
  bool takes_pivots = false;
  bool takes_sizes = false;
  bool takes_device = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const ArgKind kind = info->arg_kinds[i];
    takes_tensors |= kind == ArgKind::Tensor || kind == ArgKind::OptionalTensor ||
        kind == ArgKind::TensorList || kind == ArgKind::OptionalTensorList;
    takes_pivots |= !info->arg_is_out[i] && args[i].name().find("pivots") != std::string::npos;
    takes_sizes |= isIntegerType(args[i].real_type()) && !namesDimensionOrMode(args[i].name());
    takes_device |= args[i].real_type()->kind() == c10::TypeKind::DeviceObjType ||
        isOptionalOf(args[i].real_type(), c10::TypeKind::DeviceObjType);
  }
  info->checks_dtypes_at_call = schema.name().rfind("aten::", 0) == 0 && info->has_cpu_kernel &&
      !info->is_data_dependent && (info->has_mutable_args || info->has_fresh_returns) &&
      takes_tensors && !takes_pivots && !takes_sizes && !takes_device;
  return info;
}

} // namespace

bool metaLayoutsKnownWrong(const std::string& name) {
  return layoutsFromCpuList(name);
}

const OpSchemaInfo& opSchemaInfo(const c10::OperatorHandle& op) {
  static std::shared_mutex mutex;
  static auto* cache = new std::unordered_map<const c10::FunctionSchema*, std::unique_ptr<OpSchemaInfo>>();
  const c10::FunctionSchema* key = &op.schema();
  {
    std::shared_lock<std::shared_mutex> lock(mutex);
    const auto it = cache->find(key);
    if (it != cache->end()) {
      return *it->second;
    }
  }
  auto info = analyze(op);
  std::unique_lock<std::shared_mutex> lock(mutex);
  auto [it, inserted] = cache->emplace(key, std::move(info));
  return *it->second;
}

} // namespace at::kiln
