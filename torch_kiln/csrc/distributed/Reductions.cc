#include "distributed/Reductions.h"

#include <map>
#include <mutex>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace c10d::kiln {
namespace {

bool isIntegral(c10::ScalarType dtype) {
  return c10::isIntegralType(dtype, /*includeBool=*/true);
}

// Whether ATen's CPU kernels can reduce `dtype` with `op` (not every dtype
// has an add or a maximum kernel: float8 and uint16/32/64 have neither,
// complex has no maximum). Found by running the reduction on one element of
// two parts, once per (op, dtype), on the issuing thread: a combination
// without a kernel then fails there, before the collective is queued, instead
// of inside the task on one rank, which broke the group while the other
// ranks waited for their timeout.
bool cpuCanReduce(const c10d::ReduceOp& op, c10::ScalarType dtype) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, bool> known;
  const std::pair<int, int> key{static_cast<int>(op.op_), static_cast<int>(dtype)};
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = known.find(key); it != known.end()) {
    return it->second;
  }
  bool ok = true;
  try {
    const at::Tensor one = at::zeros({1}, at::TensorOptions().dtype(dtype));
    at::Tensor out = at::empty_like(one);
    if (op.op_ == c10d::ReduceOp::PREMUL_SUM) {
      at::mul_out(out, one, premulFactor(op));
    }
    const c10d::ReduceOp reducing =
        op.op_ == c10d::ReduceOp::PREMUL_SUM ? c10d::ReduceOp(c10d::ReduceOp::SUM) : op;
    reduceInto(out, {one, one.clone()}, reducing, 2);
  } catch (const c10::Error&) {
    ok = false;
  }
  known.emplace(key, ok);
  return ok;
}

} // namespace

double premulFactor(const c10d::ReduceOp& op) {
  auto* supplement = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK_VALUE(supplement != nullptr, "kccl: PREMUL_SUM without a factor");
  return supplement->double_factor;
}

const char* reduceOpName(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

namespace {

void checkReduceOpAndDtype(const c10d::ReduceOp& op, c10::ScalarType dtype, const char* collective) {
  const bool integral = isIntegral(dtype);
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::PRODUCT:
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX:
      return;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK_VALUE(!integral, collective, ": ReduceOp.AVG needs a floating-point tensor, got ",
                        dtype, " (allowed for AVG: float16, bfloat16, float32, float64); use SUM "
                        "and divide, as with NCCL for integers");
      return;
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      TORCH_CHECK_VALUE(integral, collective, ": ReduceOp.", reduceOpName(op),
                        " needs an integer or bool tensor, got ", dtype);
      return;
    case c10d::ReduceOp::PREMUL_SUM: {
      TORCH_CHECK_VALUE(!integral, collective, ": PREMUL_SUM needs a floating-point tensor, got ",
                        dtype);
      auto* supplement = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK_VALUE(supplement != nullptr, collective, ": PREMUL_SUM without a factor; make it "
                        "with torch.distributed._make_nccl_premul_sum(factor)");
      TORCH_CHECK_VALUE(!supplement->tensor_factor.defined(), collective,
                        ": PREMUL_SUM with a tensor factor is not supported by kccl yet; pass the "
                        "factor as a Python float");
      return;
    }
    default:
      TORCH_CHECK_VALUE(false, collective, ": unsupported ReduceOp (", static_cast<int>(op.op_),
                        "); kccl supports SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM");
  }
}

} // namespace

void checkReduceOp(const c10d::ReduceOp& op, c10::ScalarType dtype, const char* collective) {
  checkReduceOpAndDtype(op, dtype, collective);
  TORCH_CHECK_VALUE(cpuCanReduce(op, dtype), collective, ": ReduceOp.", reduceOpName(op),
                    " of ", dtype, " tensors is not supported: kccl reduces with ATen's CPU "
                    "kernels, which have none for it (collectives that only move data, such as "
                    "broadcast and all_gather, take any dtype)");
}

void reduceInto(at::Tensor& out, const std::vector<at::Tensor>& parts, const c10d::ReduceOp& op,
                int world_size) {
  TORCH_INTERNAL_ASSERT(!parts.empty());
  const bool is_bool = out.scalar_type() == at::kBool;
  if (parts.size() == 1) {
    out.copy_(parts[0]);
  }
  // The first op reads parts[0] and parts[1] and writes `out`, sparing a copy
  // (the same rounding as copying first: one op per rank either way).
  for (size_t k = 1; k < parts.size(); ++k) {
    const at::Tensor& acc = k == 1 ? parts[0] : out;
    const at::Tensor& part = parts[k];
    switch (op.op_) {
      case c10d::ReduceOp::SUM:
      case c10d::ReduceOp::AVG:
        if (is_bool) {
          at::logical_or_out(out, acc, part);
        } else {
          at::add_out(out, acc, part);
        }
        break;
      case c10d::ReduceOp::PRODUCT:
        if (is_bool) {
          at::logical_and_out(out, acc, part);
        } else {
          at::mul_out(out, acc, part);
        }
        break;
      case c10d::ReduceOp::MIN:
        if (is_bool) {
          at::logical_and_out(out, acc, part);
        } else {
          at::minimum_out(out, acc, part);
        }
        break;
      case c10d::ReduceOp::MAX:
        if (is_bool) {
          at::logical_or_out(out, acc, part);
        } else {
          at::maximum_out(out, acc, part);
        }
        break;
      case c10d::ReduceOp::BAND: at::bitwise_and_out(out, acc, part); break;
      case c10d::ReduceOp::BOR: at::bitwise_or_out(out, acc, part); break;
      case c10d::ReduceOp::BXOR: at::bitwise_xor_out(out, acc, part); break;
      default: TORCH_CHECK_VALUE(false, "kccl: unsupported ReduceOp ", static_cast<int>(op.op_));
    }
  }
  if (op.op_ == c10d::ReduceOp::AVG) {
    out.div_(world_size); // as Python's `total / world_size`
  }
}

} // namespace c10d::kiln
