// _drain_autograd_device_thread(index): runs a one-node backward pass through
// autograd's device thread for kiln:<index> and returns once it has run (Note
// [Autograd device threads at exit] in torch_kiln/kiln/_autograd_exit.py).
//
// Everything here is C++: the tensors have no Python objects and the call
// stashes nothing in thread-local storage, so when the device thread later
// frees this pass's GraphTask (it may do so while Python finalizes) it frees
// no Python object and never asks for the GIL.
#include "python/AutogradExit.h"

#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/utils/pybind.h>

#include "core/KilnFunctions.h"

namespace py = pybind11;

namespace torch_kiln {

void initAutogradExitBindings(py::module_& m) {
  m.def("_drain_autograd_device_thread", [](c10::DeviceIndex index) {
    c10::kiln::check_device_index(index);
    py::gil_scoped_release no_gil; // the engine waits for the device thread
    const at::TensorOptions options =
        at::TensorOptions().device(c10::Device(c10::DeviceType::PrivateUse1, index));
    c10::AutoGradMode grad_mode(true);
    at::Tensor x = at::zeros({}, options);
    x.set_requires_grad(true);
    const at::Tensor y = x.mul(1.0); // MulBackward0 runs on the device thread
    torch::autograd::backward({y}, {at::ones({}, options)});
  });
}

} // namespace torch_kiln
