#include "aten/LayoutCache.h"

#include <algorithm>
#include <cstring>
#include <unordered_map>
#include <utility>

#include <c10/core/GradMode.h>
#include <c10/util/hash.h>

namespace at::kiln {
namespace {

constexpr size_t kMaxEntries = 4096;

// Tags separating the encodings of different argument kinds.
enum Tag : int64_t {
  kNone = -1000001,
  kUndefinedTensor,
  kTensor,
  kList,
  kInt,
  kDouble,
  kBool,
  kString,
  kComplex,
  kSymInt,
};

int64_t bitsOf(double value) {
  int64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

void appendTensor(LayoutCache::Signature& sig, const at::Tensor& t,
                  c10::SmallVectorImpl<const c10::StorageImpl*>& storages) {
  if (!t.defined()) {
    sig.push_back(kUndefinedTensor);
    return;
  }
  sig.push_back(kTensor);
  sig.push_back(static_cast<int64_t>(t.device().type()) * 1024 + t.device().index());
  sig.push_back(static_cast<int64_t>(t.scalar_type()));
  const auto* impl = t.unsafeGetTensorImpl();
  sig.push_back((impl->is_conj() ? 1 : 0) | (impl->is_neg() ? 2 : 0) |
                (impl->is_wrapped_number() ? 4 : 0));
  sig.push_back(t.dim());
  for (const int64_t s : t.sizes()) {
    sig.push_back(s);
  }
  for (const int64_t s : t.strides()) {
    sig.push_back(s);
  }
  sig.push_back(t.storage_offset());
  // Which earlier tensor shares this storage (-1: none).
  const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  int64_t shared_with = -1;
  for (size_t i = 0; i < storages.size(); ++i) {
    if (storages[i] == storage) {
      shared_with = static_cast<int64_t>(i);
      break;
    }
  }
  storages.push_back(storage);
  sig.push_back(shared_with);
  sig.push_back(static_cast<int64_t>(t.storage().nbytes()));
}

// Appends `value`; returns false for values that cannot be keyed. With
// `types_only`, floating-point and complex scalars contribute their type alone.
bool appendValue(LayoutCache::Signature& sig, const c10::IValue& value,
                 c10::SmallVectorImpl<const c10::StorageImpl*>& storages, bool types_only) {
  if (value.isNone()) {
    sig.push_back(kNone);
  } else if (value.isTensor()) {
    appendTensor(sig, value.toTensor(), storages);
  } else if (value.isInt()) {
    sig.push_back(kInt);
    sig.push_back(value.toInt());
  } else if (value.isSymInt()) {
    const auto s = value.toSymInt();
    if (!s.is_heap_allocated()) {
      sig.push_back(kSymInt);
      sig.push_back(s.as_int_unchecked());
    } else {
      return false;
    }
  } else if (value.isDouble()) {
    sig.push_back(kDouble);
    if (!types_only) {
      sig.push_back(bitsOf(value.toDouble()));
    }
  } else if (value.isBool()) {
    sig.push_back(kBool);
    sig.push_back(value.toBool() ? 1 : 0);
  } else if (value.isComplexDouble()) {
    const auto c = value.toComplexDouble();
    sig.push_back(kComplex);
    if (!types_only) {
      sig.push_back(bitsOf(c.real()));
      sig.push_back(bitsOf(c.imag()));
    }
  } else if (value.isString()) {
    const auto& s = value.toStringRef();
    sig.push_back(kString);
    sig.push_back(static_cast<int64_t>(s.size()));
    for (size_t i = 0; i < s.size(); i += sizeof(int64_t)) {
      int64_t chunk = 0;
      std::memcpy(&chunk, s.data() + i, std::min(sizeof(int64_t), s.size() - i));
      sig.push_back(chunk);
    }
  } else if (value.isList()) {
    const auto list = value.toListRef();
    sig.push_back(kList);
    sig.push_back(static_cast<int64_t>(list.size()));
    for (const c10::IValue& element : list) {
      if (!appendValue(sig, element, storages, types_only)) {
        return false;
      }
    }
  } else if (value.isDevice()) {
    const auto d = value.toDevice();
    sig.push_back(kInt);
    sig.push_back(static_cast<int64_t>(d.type()) * 1024 + d.index());
  } else {
    return false; // Generator, Storage, objects, ...: not keyed
  }
  return true;
}

// Transparent hash and equality, so lookups take the stack-built signature
// without copying it into a key.
struct SignatureHash {
  using is_transparent = void;
  size_t operator()(c10::ArrayRef<int64_t> sig) const noexcept {
    size_t seed = sig.size();
    for (const int64_t v : sig) {
      seed = c10::hash_combine(seed, static_cast<size_t>(v));
    }
    return seed;
  }
};

struct SignatureEqual {
  using is_transparent = void;
  bool operator()(c10::ArrayRef<int64_t> a, c10::ArrayRef<int64_t> b) const noexcept {
    return a.equals(b);
  }
};

using Table = std::unordered_map<std::vector<int64_t>, MetaOutcome, SignatureHash, SignatureEqual>;

Table& table() {
  thread_local Table entries;
  return entries;
}

} // namespace

TensorLayout TensorLayout::of(const at::Tensor& t) {
  TensorLayout layout;
  if (!t.defined()) {
    return layout;
  }
  layout.defined = true;
  layout.sizes = t.sizes().vec();
  layout.strides = t.strides().vec();
  layout.storage_offset = t.storage_offset();
  layout.dtype = t.scalar_type();
  layout.is_conj = t.is_conj();
  layout.is_neg = t.is_neg();
  return layout;
}

bool TensorLayout::sameAs(const TensorLayout& other) const {
  if (defined != other.defined) {
    return false;
  }
  if (!defined) {
    return true;
  }
  if (dtype != other.dtype || sizes != other.sizes || is_conj != other.is_conj ||
      is_neg != other.is_neg) {
    return false;
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] > 1 && strides[i] != other.strides[i]) {
      return false;
    }
  }
  return true;
}

bool TensorLayout::showsDimensionOrder() const {
  if (!defined || sizes.size() < 2) {
    return true;
  }
  return std::count_if(sizes.begin(), sizes.end(), [](int64_t size) { return size > 1; }) >= 2;
}

std::optional<LayoutCache::Signature> LayoutCache::signatureOf(const OpSchemaInfo& info,
                                                             const torch::jit::Stack& stack,
                                                             size_t first) {
  Signature sig;
  sig.push_back(reinterpret_cast<int64_t>(info.schema));
  sig.push_back(info.layout_generation.load(std::memory_order_relaxed));
  sig.push_back(c10::GradMode::is_enabled()); // Note [Layout cache]: grad mode
  c10::SmallVector<const c10::StorageImpl*, 8> storages;
  for (size_t i = 0; i < info.arg_kinds.size(); ++i) {
    if (info.arg_kinds[i] == ArgKind::Generator) {
      sig.push_back(kNone); // generators do not affect layouts
      continue;
    }
    if (!appendValue(sig, stack[first + i], storages, info.scalar_values_irrelevant)) {
      return std::nullopt;
    }
  }
  return sig;
}

const MetaOutcome* LayoutCache::find(const Signature& signature) {
  auto& entries = table();
  const auto it = entries.find(c10::ArrayRef<int64_t>(signature));
  return it == entries.end() ? nullptr : &it->second;
}

void LayoutCache::insert(const Signature& signature, MetaOutcome outcome) {
  auto& entries = table();
  if (entries.size() >= kMaxEntries) {
    entries.clear();
  }
  entries.emplace(std::vector<int64_t>(signature.begin(), signature.end()), std::move(outcome));
}

namespace {

int64_t memoryFormatClass(const at::Tensor& t) {
  if (t.is_contiguous()) {
    return 0;
  }
  if (t.is_contiguous(c10::MemoryFormat::ChannelsLast) ||
      t.is_contiguous(c10::MemoryFormat::ChannelsLast3d)) {
    return 1;
  }
  return t.is_non_overlapping_and_dense() ? 2 : 3;
}

// The dimension order of a non-contiguous tensor, which decides the layout
// TensorIterator gives fresh outputs (at::TensorIteratorBase::
// reorder_dimensions sorts dimensions by stride, equal strides by size, and
// skips size-1 and stride-0 ones): per dimension, -1 for size 1, -2 for
// stride 0, else how many other such dimensions sort before it by
// (stride, size). Two tensors with the same order get the same output order.
void appendDimensionOrder(LayoutCache::Signature& sig, const at::Tensor& t) {
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  const auto ordered = [&](int64_t d) { return sizes[d] != 1 && strides[d] != 0; };
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (!ordered(d)) {
      sig.push_back(sizes[d] == 1 ? -1 : -2);
      continue;
    }
    int64_t before = 0;
    for (int64_t e = 0; e < t.dim(); ++e) {
      if (e != d && ordered(e) &&
          std::make_pair(strides[e], sizes[e]) < std::make_pair(strides[d], sizes[d])) {
        ++before;
      }
    }
    sig.push_back(before);
  }
}

void appendClass(LayoutCache::Signature& sig, const c10::IValue& value) {
  if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    sig.push_back(kTensor);
    if (t.defined()) {
      sig.push_back(static_cast<int64_t>(t.scalar_type()));
      sig.push_back(t.dim() * 16 + memoryFormatClass(t) * 4 + (t.is_conj() ? 2 : 0) +
                    (t.is_neg() ? 1 : 0));
      sig.push_back(t.numel() == 0 ? 1 : 0);
      if (!t.is_contiguous()) {
        appendDimensionOrder(sig, t);
      }
    }
  } else if (value.isList()) {
    sig.push_back(kList);
    for (const c10::IValue& element : value.toListRef()) {
      appendClass(sig, element);
    }
  } else if (value.isBool()) {
    sig.push_back(kBool);
    sig.push_back(value.toBool() ? 1 : 0);
  } else if (value.isString()) {
    sig.push_back(kString);
    sig.push_back(static_cast<int64_t>(std::hash<std::string>{}(value.toStringRef())));
  } else if (value.isNone()) {
    sig.push_back(kNone);
  } else if (value.isInt() && value.toInt() < 64 && value.toInt() > -64) {
    sig.push_back(kInt); // small ints are often modes or enum values (reduction, ...)
    sig.push_back(value.toInt());
  } else {
    sig.push_back(kDouble); // other numbers: their kind only
  }
}

using TrustTable = std::unordered_map<std::vector<int64_t>, LayoutCache::MetaTrust,
                                      SignatureHash, SignatureEqual>;

TrustTable& trustTable() {
  thread_local TrustTable entries;
  return entries;
}

using DtypeTable = std::unordered_map<std::vector<int64_t>, LayoutCache::DtypeSupport,
                                      SignatureHash, SignatureEqual>;

DtypeTable& dtypeTable() {
  thread_local DtypeTable entries;
  return entries;
}

} // namespace

std::optional<LayoutCache::Signature> LayoutCache::layoutClassOf(const OpSchemaInfo& info,
                                                                const torch::jit::Stack& stack,
                                                                size_t first) {
  Signature sig;
  sig.push_back(reinterpret_cast<int64_t>(info.schema));
  sig.push_back(c10::GradMode::is_enabled()); // Note [Layout cache]: grad mode
  for (size_t i = 0; i < info.arg_kinds.size(); ++i) {
    if (info.arg_kinds[i] != ArgKind::Generator) {
      appendClass(sig, stack[first + i]);
    }
  }
  return sig;
}

LayoutCache::MetaTrust LayoutCache::trust(const Signature& layout_class) {
  auto& entries = trustTable();
  const auto it = entries.find(c10::ArrayRef<int64_t>(layout_class));
  return it == entries.end() ? MetaTrust::Unknown : it->second;
}

void LayoutCache::setTrust(const Signature& layout_class, bool trusted) {
  auto& entries = trustTable();
  if (entries.size() >= kMaxEntries) {
    entries.clear();
  }
  entries[std::vector<int64_t>(layout_class.begin(), layout_class.end())] =
      trusted ? MetaTrust::Trusted : MetaTrust::Untrusted;
}

LayoutCache::DtypeSupport LayoutCache::dtypeSupport(const Signature& layout_class) {
  auto& entries = dtypeTable();
  const auto it = entries.find(c10::ArrayRef<int64_t>(layout_class));
  return it == entries.end() ? DtypeSupport::Unknown : it->second;
}

void LayoutCache::setDtypeSupport(const Signature& layout_class, DtypeSupport support) {
  auto& entries = dtypeTable();
  if (entries.size() >= kMaxEntries) {
    entries.clear();
  }
  entries[std::vector<int64_t>(layout_class.begin(), layout_class.end())] = support;
}

} // namespace at::kiln
