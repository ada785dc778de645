// The bindings behind torch.kiln's memory tools: the per-process memory
// fraction (torch.kiln.set_per_process_memory_fraction).
#include "python/MemoryTools.h"

#include <torch/csrc/utils/pybind.h>

#include "core/KilnCachingAllocator.h"

namespace py = pybind11;

namespace torch_kiln {
namespace {

namespace alloc = c10::kiln::KilnCachingAllocator;

} // namespace

void initMemoryToolsBindings(py::module_& m) {
  m.def("_set_memory_fraction", [](double fraction, int device) {
    alloc::setMemoryFraction(fraction, static_cast<c10::DeviceIndex>(device));
  });
  m.def("_get_memory_fraction", [](int device) {
    return alloc::getMemoryFraction(static_cast<c10::DeviceIndex>(device));
  });
}

} // namespace torch_kiln
