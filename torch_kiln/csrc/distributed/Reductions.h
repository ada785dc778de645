// Reductions.h — the arithmetic of kccl's reducing collectives (all_reduce,
// reduce, reduce_scatter), on host aliases of device memory and on slots of
// shared memory, with ATen's CPU kernels.
//
// Order and rounding: the result is the ranks' contributions combined in rank
// order, one ATen CPU elementwise op per rank, each rounded to the dtype:
//   SUM         ((x0 + x1) + x2) + ...           (torch.add)
//   PRODUCT     ((x0 * x1) * x2) * ...           (torch.mul)
//   MIN / MAX   torch.minimum / torch.maximum    (NaN propagates)
//   AVG         SUM, then divided by the world size (floating dtypes only)
//   PREMUL_SUM  (x0 * f) + (x1 * f) + ...        (f: a Python float factor)
//   BAND/BOR/BXOR  bitwise and / or / xor        (integer and bool dtypes)
// So a bf16/fp16 reduction gives exactly what doing the same sum of the same
// tensors with torch on the CPU gives. bool follows ProcessGroupNCCL: SUM and
// MAX are logical or, PRODUCT and MIN logical and.
//
// Errors: checkReduceOp throws c10::ValueError naming the collective, the op
// and the dtype when the combination is not allowed.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace c10d::kiln {

// Throws c10::ValueError if `op` cannot reduce `dtype` (or is not a reduction).
void checkReduceOp(const c10d::ReduceOp& op, c10::ScalarType dtype, const char* collective);

// The name of a ReduceOp, for messages ("SUM", "PREMUL_SUM", ...).
const char* reduceOpName(const c10d::ReduceOp& op);

// Writes the reduction of `parts` (same numel and dtype as `out`, contiguous,
// in rank order; none may alias `out`) into `out`. `world_size` divides AVG.
void reduceInto(at::Tensor& out, const std::vector<at::Tensor>& parts, const c10d::ReduceOp& op,
                int world_size);

} // namespace c10d::kiln
