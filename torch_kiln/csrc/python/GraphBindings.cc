#include "python/GraphBindings.h"

#include <pybind11/stl.h>

#include "core/KilnFunctions.h"
#include "core/KilnGraph.h"

namespace py = pybind11;

namespace torch_kiln {

void bindGraphs(py::module_& m) {
  using c10::kiln::KilnGraph;
  // Subclassed by torch.kiln.KilnGraph (as torch.cuda.CUDAGraph subclasses
  // torch._C._CUDAGraph). Capture and replay release the GIL: capture_end
  // and reset may run release functions, replay may wait for queue room.
  py::class_<KilnGraph>(m, "_KilnGraph")
      .def(py::init<>())
      .def("capture_begin", &KilnGraph::capture_begin, py::arg("pool") = c10::MempoolId_t{0, 0},
           py::arg("capture_error_mode") = "global")
      .def("capture_end", &KilnGraph::capture_end, py::call_guard<py::gil_scoped_release>())
      .def("replay", &KilnGraph::replay, py::call_guard<py::gil_scoped_release>())
      .def("reset", &KilnGraph::reset, py::call_guard<py::gil_scoped_release>())
      .def("pool", &KilnGraph::pool)
      .def("num_nodes", &KilnGraph::num_nodes);
  m.def("_graph_pool_handle", &c10::kiln::graphPoolHandle);
  m.def("_is_current_stream_capturing", [] {
    return c10::kiln::isStreamCapturing(
        c10::kiln::getCurrentKilnStream(c10::kiln::current_device()));
  });
}

} // namespace torch_kiln
