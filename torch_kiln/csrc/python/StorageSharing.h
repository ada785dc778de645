// StorageSharing.h — kiln storages between processes (torch.multiprocessing).
// See Note [Sharing kiln tensors between processes] in StorageSharing.cc.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace torch_kiln {

// Adds _share_storage and _import_storage to the _C module.
void bindStorageSharing(pybind11::module& m);

} // namespace torch_kiln
