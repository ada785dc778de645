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
//   PREMUL_SUM  (x0 * f0) + (x1 * f1) + ...      (f_r: rank r's Python float factor;
//               each rank scales its own input first, then the ranks SUM:
//               Note [kccl PREMUL_SUM] in ProcessGroupKCCL.cc)
//   BAND/BOR/BXOR  bitwise and / or / xor        (integer and bool dtypes)
// So a bf16/fp16 reduction gives exactly what doing the same sum of the same
// tensors with torch on the CPU gives. bool follows ProcessGroupNCCL: SUM and
// MAX are logical or, PRODUCT and MIN logical and.
//
// Errors: checkReduceOp throws c10::ValueError naming the collective, the op
// and the dtype when the combination is not allowed, or when ATen's CPU
// kernels cannot reduce the dtype with the op (float8 and uint16/32/64 have no
// add or maximum, complex no maximum; found by trying, once per op and dtype).
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace c10d::kiln {

// Throws c10::ValueError if `op` cannot reduce `dtype` (or is not a reduction).
void checkReduceOp(const c10d::ReduceOp& op, c10::ScalarType dtype, const char* collective);

// The name of a ReduceOp, for messages ("SUM", "PREMUL_SUM", ...).
const char* reduceOpName(const c10d::ReduceOp& op);

// The factor of a PREMUL_SUM op (checkReduceOp accepted it).
double premulFactor(const c10d::ReduceOp& op);

// Writes the reduction of `parts` (same numel and dtype as `out`, contiguous,
// in rank order; none may alias `out`) into `out`. `world_size` divides AVG.
// PREMUL_SUM is not reduced here: its callers scale and SUM.
void reduceInto(at::Tensor& out, const std::vector<at::Tensor>& parts, const c10d::ReduceOp& op,
                int world_size);

} // namespace c10d::kiln
