// GeneratedKernelBindings.h — torch_kiln._C._GeneratedKernel, which launches
// a kernel torch.compile generated for kiln on the current kiln stream.
// See GeneratedKernelBindings.cc for the argument packing.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace torch_kiln {

// Adds _GeneratedKernel(name, entry, signature) to the _C module; its
// launch(device, *args) enqueues one call (aten/GeneratedKernels.h).
void bindGeneratedKernels(pybind11::module& m);

} // namespace torch_kiln
