// MemoryTools.h — bindings of torch.kiln's memory tools (memory history and
// snapshots, per-process memory fraction), added to torch_kiln._C by Module.cc.
#pragma once

#include <pybind11/pybind11.h>

namespace torch_kiln {

void initMemoryToolsBindings(pybind11::module_& m);

} // namespace torch_kiln
