// AutogradExit.h — the binding that empties autograd's kiln device threads
// before the interpreter finalizes, added to torch_kiln._C by Module.cc.
// See Note [Autograd device threads at exit] in torch_kiln/kiln/_autograd_exit.py.
#pragma once

#include <pybind11/pybind11.h>

namespace torch_kiln {

void initAutogradExitBindings(pybind11::module_& m);

} // namespace torch_kiln
