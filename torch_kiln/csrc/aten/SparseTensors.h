// SparseTensors.h — sparse COO and sparse compressed (CSR, CSC, BSR, BSC)
// tensors on kiln: see Note [Sparse tensors on kiln] in SparseTensors.cc.
//
// The one entry point other files need: the dense op executor's synchronous
// path meets host results with a sparse layout (dense.to_sparse(),
// dense.to_sparse_csr(), ...) and turns them into kiln tensors here.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/core/Device.h>

namespace at::kiln {

// A new kiln tensor on `device` with the layout, sizes, dtype, coalesced
// flag and member values of `host`, a sparse (COO or compressed) CPU tensor
// the caller owns, made by a kernel that ran over host aliases of
// `kiln_arguments`. A member that shares bytes with one of them becomes a
// view of it (as the CPU result's member is a view of the CPU argument);
// other members are copied with staged (non-blocking) copies, so `host` may
// be freed at once. Raises NotImplementedError for layouts kiln has no
// tensors for (mkldnn, ...).
at::Tensor sparseHostResultToKiln(const at::Tensor& host, c10::Device device,
                                  c10::ArrayRef<at::Tensor> kiln_arguments);

} // namespace at::kiln
