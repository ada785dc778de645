// AdaptiveEager.h — adaptive eager fusion, first increment: runs of
// elementwise float32 ops that wait in a kiln stream's queue are run as ONE
// task, tile by tile (Note [Adaptive eager fusion] in AdaptiveEager.cc).
//
// Switch: KILN_ADAPTIVE_EAGER=0|1, default 0 (off). Any other value raises
// ValueError naming the variable from the first op that consults it.
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>

#include "aten/OpSchemaInfo.h"
#include "core/KilnStream.h"

namespace at::kiln {

// Whether KILN_ADAPTIVE_EAGER=1 (read once, at the first call). Raises
// ValueError for a value other than unset, "", "0" or "1".
bool adaptiveEagerEnabled();
// Turns fusion on or off from now on, whatever KILN_ADAPTIVE_EAGER says (for
// tests: torch.kiln._set_adaptive_eager). Groups already open run as formed.
void setAdaptiveEager(bool enabled);

// Whether `op` is on the fusion whitelist (its arguments are checked by
// enqueueFusible).
bool mayFuse(const c10::OperatorHandle& op, const OpSchemaInfo& info);

// Step 3 of Note [How an eager op runs on kiln] for an op the fusion may take:
// if `op` is on the whitelist and its arguments qualify (float32, contiguous,
// one shape, 0-dim CPU scalars allowed), it joins the stream's open fusion
// group or starts a new one (a task launched on `stream`) and this returns
// true; otherwise it returns false and the caller launches the op as usual.
// `args`: the op's arguments as its CPU kernel takes them (host scalars
// snapshot, kiln tensors as kiln tensors); `fresh`: its fresh outputs, in
// return order, already allocated.
bool enqueueFusible(const c10::OperatorHandle& op, const OpSchemaInfo& info,
                    c10::ArrayRef<c10::IValue> args, c10::ArrayRef<at::Tensor> fresh,
                    const c10::kiln::KilnStream& stream);

// Closes the calling thread's open fusion groups on every stream: ops issued
// after this call start new groups (record_stream calls it).
void closeFusionGroups();

// How often each sequence of two or more ops ran as one fused task since the
// last clearFusedOps(): "aten::mul.out, aten::add.out" -> runs.
std::unordered_map<std::string, int64_t> fusedOps();
void clearFusedOps();

// For tests only (torch.kiln._fusion_fail_op): the next fusion group that
// contains `op_name` ("aten::mul.out") fails at that op as if its kernel had
// raised RuntimeError. An empty name cancels it.
void failNextFusedOp(const std::string& op_name);

} // namespace at::kiln
