// OpTracking.h — counts of the ATen ops kiln executed and of those that
// forced a synchronization (torch.kiln.get_executed_ops / get_sync_ops /
// clear_op_tracking).
//
// An op is counted under its full ATen name ("aten::add.out") each time a kiln
// kernel runs it; a "sync op" is one whose result on the host depended on
// device data (item(), nonzero, masked_select, blocking copies to the host, …)
// and so had to wait for the device. One-time checks of an op's meta kernel
// also wait; they are listed separately as "<op> (layout check)". Thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>

#include <ATen/core/operator_name.h>

namespace at::kiln {

void recordExecutedOp(const c10::OperatorName& op);
// `name` must have static storage (a string literal).
void recordExecutedOp(const char* name);
// Counts a sync op. Call it before the op waits or enqueues work whose
// host memory the wait protects: it may raise (a capture underway on the
// stream, or the sync debug mode "error": c10::kiln::warn_or_error_on_sync).
void recordSyncOp(const c10::OperatorName& op);
void recordSyncOp(const char* name); // `name`: a string literal
// A synchronization made once per layout class to check the op's meta
// kernel (Note [Verifying meta kernels]); listed as "<op> (layout check)".
void recordLayoutCheck(const c10::OperatorName& op);

std::unordered_map<std::string, int64_t> executedOps();
std::unordered_map<std::string, int64_t> syncOps();
void clearOpTracking();

} // namespace at::kiln
