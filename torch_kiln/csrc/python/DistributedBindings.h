// DistributedBindings.h — the Python entry point of the kccl c10d backend
// (torch_kiln/csrc/distributed/ProcessGroupKCCL.h); torch_kiln.distributed
// registers it with torch.distributed.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace torch_kiln {

// Adds _kccl_create_backend(store, rank, size, timeout_ms, group_name,
// hosts=[], gloo_leaders=None, gloo_all=None) to the _C module (`hosts`: the
// group ranks of each host; the Gloo groups join the hosts, Note [kccl across
// hosts] in distributed/CrossHost.h): makes a ProcessGroupKCCL (collective over the group's ranks;
// releases the GIL while the ranks set up their shared memory) and returns
// it as a torch._C._distributed_c10d.Backend. Call only after
// torch.distributed has been imported (it registers the Store and Backend
// Python types). Also _kccl_set_factory(make): how split() makes a group
// (Note [Splitting a kccl group], distributed/SplitKCCL.cc).
void bindDistributed(pybind11::module& m);

} // namespace torch_kiln
