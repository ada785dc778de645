// torch.distributed.split_group for kccl: ProcessGroupKCCL's
// getBackendOptions(), split() and the factory they make groups with.
//
// Note [Splitting a kccl group]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// `split_group(parent_pg, split_ranks)` (distributed_c10d.py) is how
// DeviceMesh makes its sub-groups when the default group was made with
// `init_process_group(device_id=...)`, as TorchTitan-style programs do. It
// refuses a backend whose `supports_splitting` is false, deep-copies the
// parent backend's `options`, and calls c10d's ProcessGroup::splitGroup,
// which hands every device backend of the parent (Gloo's for "cpu:gloo,...",
// kccl's for kiln) a PrefixStore named after the new group and the sorted
// parent ranks of the caller's part; a backend returns null for a caller
// outside `ranks`.
//
// kccl makes the new group's backend exactly as c10d's new_group does: the
// Python creator torch_kiln.distributed._create_backend, given the
// PrefixStore, the caller's index in `ranks`, their count, the timeout and
// the group name from `opts`. So a split group has the same transport as any
// other kccl group (shared memory inside a host, Gloo between hosts, set up
// collectively over the new group's members only: NCCL's ncclCommSplit is
// collective over the parent, kccl needs only the members, which is
// compatible: every parent rank calls split_group). The creator is reached
// through a Factory that torch_kiln.distributed registers when it loads
// (Python: it holds the GIL while it runs).
#include <algorithm>
#include <mutex>

#include <c10/util/Exception.h>

#include "distributed/ProcessGroupKCCL.h"

namespace c10d::kiln {
namespace {

std::mutex factory_mutex;
ProcessGroupKCCL::Factory& factory() {
  static ProcessGroupKCCL::Factory instance;
  return instance;
}

} // namespace

void ProcessGroupKCCL::setFactory(Factory make) {
  std::lock_guard<std::mutex> lock(factory_mutex);
  factory() = std::move(make);
}

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupKCCL::getBackendOptions() {
  auto options = c10::make_intrusive<Options>(getBackendName(), timeout_);
  options->group_name = group_name_;
  return options;
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupKCCL::split(
    const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
    const c10::intrusive_ptr<Options>& opts) {
  TORCH_CHECK_VALUE(!ranks.empty(), "kccl: split_group needs at least one rank");
  for (int r : ranks) {
    TORCH_CHECK_VALUE(r >= 0 && r < getSize(), "kccl: split_group: rank ", r,
                      " is not a rank of the parent group (ranks 0..", getSize() - 1, ")");
  }
  const auto me = std::find(ranks.begin(), ranks.end(), getRank());
  if (me == ranks.end()) {
    return nullptr;
  }
  Factory make;
  {
    std::lock_guard<std::mutex> lock(factory_mutex);
    make = factory();
  }
  TORCH_CHECK(make, "kccl: split_group needs torch_kiln.distributed, which registers how kccl ",
              "groups are made (import torch_kiln)");
  const auto timeout = opts && opts->timeout.count() > 0 ? opts->timeout : timeout_;
  const std::string name = opts && !opts->group_name.empty()
                               ? opts->group_name
                               : group_name_ + ":split";
  return make(store, static_cast<int>(me - ranks.begin()), static_cast<int>(ranks.size()),
              timeout, name);
}

} // namespace c10d::kiln
