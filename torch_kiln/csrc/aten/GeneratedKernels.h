// GeneratedKernels.h — launching kernels that torch.compile generated
// (Inductor's C++ code for the kiln device) and custom kernels loaded with
// torch_kiln.kernels (written against kiln/kernel.h) as tasks on kiln
// streams. Both are C++ in a shared library that kiln calls through one
// entry signature.
//
// A generated kernel is C++ code compiled into a shared library by Inductor;
// for kiln each one also gets a trampoline with one signature,
//     extern "C" void <kernel>_kiln_entry(const int64_t* packed);
// that unpacks its arguments (pointers, integers, doubles as bit patterns)
// and calls the kernel (torch_kiln/compiler/inductor/kernels.py emits it).
// launchGeneratedKernel enqueues one call of such an entry on a stream
// through launchTask (KilnTask.h), the same mechanism eager ops use, so
// ordering, sticky errors, intra-op threads and the caching allocator's
// stream-ordered reuse hold with no second implementation.
// See Note [Compiled code runs in stream order] (torch_kiln/compiler/inductor/
// __init__.py) for the design.
//
// Ownership: the task owns a copy of the packed arguments. The pointers in it
// are kiln device memory (host-addressable on the reference device), kept
// valid by stream order and the caching allocator exactly as for eager tasks
// (KilnTask.h's ownership rule); the kernel's shared library stays loaded for
// the life of the process (Inductor's code cache never unloads it).
//
// Errors: an exception thrown by the kernel (an index out of range, an integer
// division by zero) becomes the stream's sticky error, "<name>: <what>",
// raised at the next synchronization. The storages the kernel writes are then
// marked as holding no valid result, and so are they when the kernel is
// skipped or reads a marked storage (Note [Results of failed kernels]).
//
// Thread-safety: launchGeneratedKernel may be called from any thread.
#pragma once

#include <cstdint>
#include <vector>

#include "core/KilnStream.h"

namespace at::kiln {

// The one signature of every generated kernel's kiln entry.
using GeneratedKernelEntry = void (*)(const int64_t* packed);

struct GeneratedKernelCall {
  GeneratedKernelEntry entry = nullptr;
  // The kernel's name in error messages; must outlive the task (use
  // internKernelName).
  const char* name = nullptr;
  std::vector<int64_t> packed;
  // Values of 0-dim CPU tensor arguments (scalars), copied at the call; the
  // packed slot of such an argument points into this vector, which must not
  // change size after those pointers are taken.
  std::vector<int64_t> host_scalars;
  // First bytes of the kiln storages the kernel reads / writes, for
  // Note [Results of failed kernels]. Never dereferenced here.
  std::vector<const void*> read_storages;
  std::vector<const void*> written_storages;
  // What the kernel is, in error messages; must outlive the task.
  const char* description = "a kernel compiled by torch.compile";
  // Count each launch in torch.kiln.get_executed_ops() under `name` (custom
  // kernels, torch_kiln.kernels; compiled kernels are not ops).
  bool counted_as_op = false;
  // Inductor's indirect-index check (a TORCH_CHECK whose message holds
  // "index out of bounds:") raises IndexError, as eager indexing does; false
  // keeps it a RuntimeError, as eager gather and scatter (Note [Index errors
  // of compiled kernels] in torch_kiln/compiler/inductor/kernels.py).
  bool index_check_raises_index_error = true;
};

// A stable copy of `name` that lives for the rest of the process.
const char* internKernelName(const std::string& name);

// Enqueues call.entry(call.packed.data()) on `stream`; returns at once.
// Throws c10::Error if the launch itself fails (e.g. the runtime is shut
// down); with KILN_LAUNCH_BLOCKING=1 the kernel runs here and its error is
// raised here.
void launchGeneratedKernel(const c10::kiln::KilnStream& stream, GeneratedKernelCall call);

} // namespace at::kiln
