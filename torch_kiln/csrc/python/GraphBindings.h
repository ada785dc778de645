// GraphBindings.h — bindings of kiln graphs (torch_kiln._C._KilnGraph,
// _graph_pool_handle, _is_current_stream_capturing), added to torch_kiln._C
// by Module.cc. Python API: torch_kiln/kiln/graphs.py.
#pragma once

#include <pybind11/pybind11.h>

namespace torch_kiln {

void bindGraphs(pybind11::module_& m);

} // namespace torch_kiln
