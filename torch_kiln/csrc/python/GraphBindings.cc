#include "python/GraphBindings.h"

#include <memory>

#include <ATen/core/GraphImplInterface.h>
#include <c10/core/DeviceType.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "core/KilnFunctions.h"
#include "core/KilnGraph.h"

namespace py = pybind11;

namespace torch_kiln {
namespace {

// torch.accelerator.Graph on kiln: PyTorch's device-generic graph
// (ATen/accelerator/Graph.h) creates its implementation from
// at::GraphImplRegistry under the device type's name; this one is a
// KilnGraph.
class KilnGraphImpl final : public at::GraphImplInterface {
 public:
  explicit KilnGraphImpl(const at::GraphImplArgs& /*args: keep_graph changes nothing on kiln*/) {}
  void capture_begin(c10::MempoolId_t pool, at::GraphCaptureMode mode) override {
    const char* name = mode == at::GraphCaptureMode::ThreadLocal ? "thread_local"
        : mode == at::GraphCaptureMode::Relaxed                  ? "relaxed"
                                                                 : "global";
    graph_.capture_begin(pool, name);
  }
  void capture_end() override { graph_.capture_end(); }
  void instantiate() override {} // kiln graphs are launchable once captured
  void replay() override { graph_.replay(); }
  void reset() override { graph_.reset(); }
  c10::MempoolId_t pool() const override { return graph_.pool(); }
  void enable_debug_mode() override {
    TORCH_CHECK(false, "kiln graphs have no debug mode (enable_debug_mode/debug_dump) yet");
  }
  void debug_dump(const std::string& /*path*/) override { enable_debug_mode(); }

 private:
  c10::kiln::KilnGraph graph_;
};

} // namespace

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
  // Called by torch_kiln.kiln.graphs at import, after the backend was renamed
  // (the registry key is the device type's name, "KILN").
  m.def("_register_accelerator_graph", [] {
    const std::string key = c10::DeviceTypeName(c10::DeviceType::PrivateUse1, /*lower_case=*/false);
    if (!at::GraphImplRegistry()->Has(key)) {
      at::GraphImplRegistry()->Register(key, [](at::GraphImplArgs args) {
        return std::unique_ptr<at::GraphImplInterface>(std::make_unique<KilnGraphImpl>(args));
      });
    }
  });
  // torch.compile(mode="reduce-overhead") on kiln marks the outputs of a
  // replay that a later replay overwrites, as CUDA graph trees do with
  // torch._C._set_storage_access_error_msg (a CUDA-build-only binding): any
  // later access to the storage's data raises `msg` instead of reading
  // overwritten memory. Only for storages that do not own their memory (the
  // aliases torch_kiln/compiler/inductor/reduce_overhead.py hands out); the data
  // pointer itself is kept. See Note [Kiln graphs for reduce-overhead].
  // `storage` is a StorageImpl address (torch.UntypedStorage._cdata, or the
  // cdata of a live torch.multiprocessing.reductions.StorageWeakRef).
  m.def("_set_storage_access_error_msg", [](uintptr_t storage, std::string msg) {
    reinterpret_cast<c10::StorageImpl*>(storage)->release_data_and_set_meta_custom_data_ptr_error_msg_(
        std::move(msg));
  });
  m.def("_is_current_stream_capturing", [] {
    return c10::kiln::isStreamCapturing(
        c10::kiln::getCurrentKilnStream(c10::kiln::current_device()));
  });
}

} // namespace torch_kiln
