#include "python/DistributedBindings.h"

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "distributed/ProcessGroupKCCL.h"

namespace torch_kiln {

void bindDistributed(pybind11::module& m) {
  m.def(
      "_kccl_create_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, int64_t timeout_ms,
         const std::string& group_name, std::vector<std::vector<int>> hosts,
         std::optional<c10::intrusive_ptr<c10d::Backend>> gloo_leaders,
         std::optional<c10::intrusive_ptr<c10d::Backend>> gloo_all) -> c10::intrusive_ptr<c10d::Backend> {
        TORCH_CHECK_VALUE(size >= 1 && rank >= 0 && rank < size, "kccl: invalid rank ", rank,
                          " for a group of ", size, " ranks");
        TORCH_CHECK_VALUE(timeout_ms > 0, "kccl: the timeout must be positive, got ", timeout_ms,
                          " ms");
        return c10::make_intrusive<c10d::kiln::ProcessGroupKCCL>(
            store, rank, size, std::chrono::milliseconds(timeout_ms), group_name, std::move(hosts),
            gloo_leaders.value_or(nullptr), gloo_all.value_or(nullptr));
      },
      pybind11::arg("store"), pybind11::arg("rank"), pybind11::arg("size"),
      pybind11::arg("timeout_ms"), pybind11::arg("group_name"),
      pybind11::arg("hosts") = std::vector<std::vector<int>>{},
      pybind11::arg("gloo_leaders") = pybind11::none(), pybind11::arg("gloo_all") = pybind11::none(),
      pybind11::call_guard<pybind11::gil_scoped_release>());
  // Note [Splitting a kccl group] (distributed/SplitKCCL.cc): `make(store,
  // rank, size, timeout_ms, group_name)` returns a new kccl Backend.
  m.def("_kccl_set_factory", [](pybind11::function make) {
    // Kept for the process (never destroyed: no GIL at static destruction).
    auto* held = new pybind11::function(std::move(make));
    c10d::kiln::ProcessGroupKCCL::setFactory(
        [held](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
               std::chrono::milliseconds timeout,
               const std::string& group_name) -> c10::intrusive_ptr<c10d::Backend> {
          pybind11::gil_scoped_acquire gil;
          pybind11::object backend =
              (*held)(store, rank, size, static_cast<int64_t>(timeout.count()), group_name);
          return backend.cast<c10::intrusive_ptr<c10d::Backend>>();
        });
  });
  // torch_kiln.distributed's atexit handler (Note [kccl completion thread]).
  m.def("_kccl_abandon_completions_at_exit", &c10d::kiln::abandonAllKcclCompletionsAtExit,
        pybind11::call_guard<pybind11::gil_scoped_release>());
}

} // namespace torch_kiln
