// Meta kernels for the kiln-specific operators that have none in PyTorch.
//
// Note [Kiln kernels under FakeTensorMode]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch.compile (Dynamo, AOTAutograd, export) runs a kiln program first on
// FakeTensors: tensors that report device kiln but have no memory, often with
// symbolic sizes (dynamic=True, automatic dynamic shapes). Every kernel kiln
// registers itself can be reached on that path, in one of three ways, and
// each has its rule:
//
//  1. Kernels PyTorch calls from inside a CompositeImplicitAutograd kernel or
//     a dispatch stub (SDPA's _fused_sdp_choice_stub, Attention.cc) and
//     kiln's AutogradPrivateUse1 kernels (dropout, Dropout.cc) run with the
//     FakeTensors themselves. They read metadata only, never a data pointer
//     (FakeTensors throw on one), and sizes only through the SymInt accessors
//     (sym_sizes, sym_numel, ...; sizes() throws on a symbolic tensor).
//  2. Operators with a PrivateUse1 kernel are run by FakeTensorMode with the
//     operator's Meta kernel. Where PyTorch has none (they exist only for
//     CUDA and "overrideable" backends: the fused GRU cell,
//     convolution_overrideable, _copy_from, record_stream), FakeTensorMode
//     would otherwise either fail with symbolic sizes
//     (UnsupportedOperatorException) or, with static sizes, silently run the
//     real kiln kernel on zero-filled device tensors while tracing. Kiln
//     registers a Meta kernel for each, next to the kiln kernel where that
//     is a composition (RecurrentCells.cc, Convolution.cc), here for the
//     rest. A Meta kernel runs with Python dispatch off, so the C++ kernels
//     it calls must take SymInts too: it allocates with empty_symint or
//     calls an operator whose own Meta kernel is symbolic (convolution),
//     never a C++ composite that reads sizes() (chunk, split).
//  3. The boxed fallback (KilnOpExecutor.cc) is never reached by
//     FakeTensors: every operator it serves has a CPU kernel and PyTorch's
//     meta kernel or decomposition.
//
// tests/test_compile_dynamo.py checks that every aten operator kiln
// registers for PrivateUse1 has one of these paths, and runs each operator
// named above under FakeTensorMode with symbolic sizes, comparing sizes and
// strides with the device kernel's and checking that no kiln kernel ran.
#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>
#include <torch/library.h>

namespace at::kiln {
namespace {

// Tensor.record_stream only informs the caching allocator; a meta tensor has
// no memory to protect.
void recordStreamMeta(at::Tensor&, c10::Stream) {}

// copy_ sends a copy that involves a kiln tensor to _copy_from. On meta
// tensors copy_ itself checks broadcasting and dtypes and moves no data.
at::Tensor copyFromMeta(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  at::Tensor out = dst;
  out.copy_(self, non_blocking);
  return dst;
}

at::Tensor copyFromAndResizeMeta(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize__symint(self.sym_sizes());
  at::Tensor out = dst;
  out.copy_(self);
  return dst;
}

} // namespace

TORCH_LIBRARY_IMPL(aten, Meta, m) {
  m.impl("record_stream", TORCH_FN(recordStreamMeta));
  m.impl("_copy_from", TORCH_FN(copyFromMeta));
  m.impl("_copy_from_and_resize", TORCH_FN(copyFromAndResizeMeta));
}

} // namespace at::kiln
