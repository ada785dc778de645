// LegacyTensorTypes.h — torch.kiln.FloatTensor and the other legacy typed
// tensor classes, the counterparts of torch.cuda.FloatTensor & co.
// See Note [Legacy typed tensor classes] in LegacyTensorTypes.cc.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace torch_kiln {

// Adds _add_legacy_tensor_types(module) to the _C module: it creates the ten
// classes once and binds them as attributes of `module` (torch.kiln) and in
// torch._tensor_classes, as PyTorch does for torch.cuda.
void bindLegacyTensorTypes(pybind11::module& m);

} // namespace torch_kiln
