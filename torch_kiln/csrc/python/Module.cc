// torch_kiln._C: the Python bindings behind torch.kiln. Each binding is a thin
// call into the C++ layer; Python-facing behaviour (argument normalisation,
// docstrings) lives in torch_kiln/kiln/*.py.
#include <ATen/Context.h>
#include <c10/core/DeviceType.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/utils/device_lazy_init.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include "aten/AdaptiveEager.h"
#include "aten/FusedKernels.h"
#include "aten/KilnTask.h"
#include "aten/OpTracking.h"
#include "core/KilnFunctions.h"
#include "core/KilnException.h"
#include "core/KilnGenerator.h"
#include "core/KilnStream.h"
#include "python/AutogradExit.h"
#include "python/DistributedBindings.h"
#include "python/GeneratedKernelBindings.h"
#include "python/GraphBindings.h"
#include "python/HostWaitInterrupts.h"
#include "python/LegacyTensorTypes.h"
#include "python/MemoryTools.h"
#include "python/StorageSharing.h"
#include "python/TerminateReport.h"

namespace py = pybind11;

namespace {

py::tuple deviceProperties(int device) {
  c10::kiln::check_device_index(static_cast<c10::DeviceIndex>(device));
  kilnDeviceProp prop{};
  KILN_CHECK(kilnGetDeviceProperties(&prop, device));
  return py::make_tuple(std::string(prop.name), static_cast<uint64_t>(prop.totalGlobalMem),
                        prop.multiProcessorCount, prop.pciBusID);
}

py::object defaultGenerator(int device) {
  torch::utils::register_fork_handler_for_device_init(at::kPrivateUse1);
  const auto& generator =
      c10::kiln::getDefaultKilnGenerator(static_cast<c10::DeviceIndex>(device));
  return py::reinterpret_steal<py::object>(THPGenerator_initDefaultGenerator(generator));
}

py::dict toDict(const std::unordered_map<std::string, int64_t>& counts) {
  py::dict result;
  for (const auto& [name, count] : counts) {
    result[py::str(name)] = count;
  }
  return result;
}

} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Kiln's C++ layer (internal; use torch.kiln).";
  // A python_error (KeyboardInterrupt from a host wait, Note [Ctrl-C during
  // a host wait]) leaving one of these bindings is the Python exception it
  // holds, not a RuntimeError.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) {
        std::rethrow_exception(p);
      }
    } catch (python_error& e) {
      e.restore();
    }
  });
  torch_kiln::installHostWaitInterrupts();
  torch_kiln::installTerminateReport();
  torch_kiln::bindStorageSharing(m);
  torch_kiln::bindGeneratedKernels(m);
  torch_kiln::bindDistributed(m);
  torch_kiln::bindGraphs(m);
  torch_kiln::bindLegacyTensorTypes(m);

  m.def("_init", [] {
    torch::utils::register_fork_handler_for_device_init(at::kPrivateUse1);
    c10::kiln::device_count_ensure_non_zero();
  });
  m.def("_is_in_bad_fork", [] { return torch::utils::is_device_in_bad_fork(at::kPrivateUse1); });
  m.def("_get_device_count", [] { return static_cast<int>(c10::kiln::device_count()); });
  m.def("_get_device", [] { return static_cast<int>(c10::kiln::current_device()); });
  m.def("_set_device", [](int device) {
    c10::kiln::set_device(static_cast<c10::DeviceIndex>(device));
  });
  m.def("_exchange_device", [](int device) {
    if (device < 0) {
      return -1;
    }
    return static_cast<int>(c10::kiln::exchange_device(static_cast<c10::DeviceIndex>(device)));
  });
  m.def("_maybe_exchange_device", [](int device) {
    if (device < 0) {
      return -1;
    }
    return static_cast<int>(
        c10::kiln::maybe_exchange_device(static_cast<c10::DeviceIndex>(device)));
  });
  m.def("_synchronize", [](int device) {
    torch::PyWarningHandler warnings; // device warnings become Python warnings
    {
      py::gil_scoped_release no_gil;
      c10::kiln::device_synchronize(static_cast<c10::DeviceIndex>(device));
    }
  });
  m.def("_get_device_properties", &deviceProperties);
  m.def("_get_default_generator", &defaultGenerator);
  m.def("_launch_blocking", [] {
    int blocking = 0;
    KILN_CHECK(kilnGetLaunchBlocking(&blocking));
    return blocking != 0;
  });
  m.def("_stream_priority", [](int64_t stream_id) {
    return c10::kiln::KilnStream(
               c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::PrivateUse1, 0), stream_id))
        .priority();
  });
  m.def("_stream_from_external", [](uintptr_t handle, int device) {
    // torch.kiln.ExternalStream: (stream_id, device_index, device_type).
    const auto stream = c10::kiln::getStreamFromExternal(
        reinterpret_cast<kilnStream_t>(handle), static_cast<c10::DeviceIndex>(device));
    return py::make_tuple(stream.id(), static_cast<int>(stream.device_index()),
                          static_cast<int>(stream.device_type()));
  });
  m.def("_event_elapsed_time", [](uint64_t start, uint64_t end) {
    TORCH_CHECK(start != 0 && end != 0,
                "Both events must be recorded before calculating elapsed time.");
    float ms = 0;
    KILN_CHECK(kilnEventElapsedTime(&ms, reinterpret_cast<kilnEvent_t>(start),
                                    reinterpret_cast<kilnEvent_t>(end)));
    return static_cast<double>(ms);
  });
  m.def("_sleep", [](double milliseconds) {
    // Device work that just takes time (torch.cuda._sleep's counterpart), to
    // make stream-ordering tests independent of timing luck.
    const auto stream = c10::kiln::getCurrentKilnStream();
    at::kiln::launchTask(stream, "kiln::sleep", [milliseconds] {
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(milliseconds));
    });
  });
  m.def("_shutdown", [](unsigned drain_ms, unsigned timeout_ms) {
    // At exit: stop accepting device work, let the queues drain for
    // drain_ms, then drop what has not started (Note [Shutdown at exit]).
    // Returns (entries dropped, whether work was still running at the end).
    unsigned long long dropped = 0;
    kilnError_t status;
    {
      py::gil_scoped_release no_gil;
      status = kilnRuntimeShutdown(drain_ms, timeout_ms, &dropped);
    }
    if (status != kilnSuccess && status != kilnErrorNotReady) {
      KILN_CHECK(status);
    }
    return py::make_tuple(dropped, status == kilnErrorNotReady);
  });
  m.def("_pending_errors", [] {
    // At exit: errors of kernels nobody synchronized on would be lost.
    std::vector<std::string> messages;
    py::gil_scoped_release no_gil;
    for (c10::DeviceIndex d = 0; d < c10::kiln::device_count(); ++d) {
      try {
        c10::kiln::device_synchronize(d);
      } catch (const c10::Error& e) {
        messages.emplace_back(e.what_without_backtrace());
      }
    }
    return messages;
  });
  m.def("_set_sync_debug_mode", [](int mode) {
    TORCH_CHECK_VALUE(mode >= 0 && mode <= 2, "invalid sync debug mode ", mode,
                      ": expected 0 (default), 1 (warn) or 2 (error)");
    c10::kiln::set_sync_debug_mode(static_cast<c10::kiln::SyncDebugMode>(mode));
  });
  m.def("_get_sync_debug_mode",
        [] { return static_cast<int>(c10::kiln::get_sync_debug_mode()); });
  m.def("_get_error_string", [](int code) {
    // (name, description) of a runtime status code (torch.kiln.check_error).
    const auto error = static_cast<kilnError_t>(code);
    return py::make_tuple(std::string(kilnGetErrorName(error)),
                          std::string(kilnGetErrorString(error)));
  });
  m.def("_get_executed_ops", [] { return toDict(at::kiln::executedOps()); });
  m.def("_get_sync_ops", [] { return toDict(at::kiln::syncOps()); });
  m.def("_clear_op_tracking", [] {
    at::kiln::clearOpTracking();
    at::kiln::clearFusedOps();
  });
  m.def("_get_fused_ops", [] { return toDict(at::kiln::fusedOps()); });
  m.def("_adaptive_eager_enabled", &at::kiln::adaptiveEagerEnabled);
  m.def("_set_adaptive_eager", &at::kiln::setAdaptiveEager);
  m.def("_fusion_fail_op", &at::kiln::failNextFusedOp);
  // Generated kernels for fusion groups (Note [Generated kernels for fusion
  // groups]; torch_kiln/kiln/_fused_kernels.py registers the builder).
  static constexpr std::pair<const char*, at::kiln::FusedKernelMode> kFusedKernelModes[] = {
      {"aten", at::kiln::FusedKernelMode::Aten},
      {"interpreted", at::kiln::FusedKernelMode::Interpreted},
      {"specialized", at::kiln::FusedKernelMode::Specialized},
      {"adaptive", at::kiln::FusedKernelMode::Adaptive}};
  m.attr("_FUSED_KERNEL_HOT_PLAN_RUNS") = at::kiln::kHotPlanRuns;
  m.def("_fused_kernels_mode", [] {
    for (const auto& [name, mode] : kFusedKernelModes) {
      if (mode == at::kiln::fusedKernelMode()) {
        return std::string(name);
      }
    }
    return std::string("?");
  });
  m.def("_set_fused_kernels", [](const std::string& name) {
    for (const auto& [known, mode] : kFusedKernelModes) {
      if (name == known) {
        at::kiln::setFusedKernelMode(mode);
        return;
      }
    }
    TORCH_CHECK_VALUE(false, "_set_fused_kernels('", name, "'): expected 'aten', 'interpreted', "
                      "'specialized' or 'adaptive' (Note [Generated kernels for fusion groups])");
  });
  m.def("_set_fused_kernel_builder", [](py::function build) {
    // Called on the build thread: takes the GIL, unless Python is gone.
    auto* held = new py::function(std::move(build)); // leaked: used until exit
    at::kiln::setFusedKernelBuilder([held](const std::string& signature,
                                           const std::string& source) {
      TORCH_CHECK(Py_IsInitialized() && !_Py_IsFinalizing(), "the Python interpreter is exiting");
      py::gil_scoped_acquire gil;
      try {
        auto result = (*held)(signature, source).cast<std::pair<uintptr_t, int64_t>>();
        return at::kiln::BuiltLibrary{reinterpret_cast<void*>(result.first), result.second};
      } catch (py::error_already_set& e) {
        throw std::runtime_error(e.what());
      }
    });
  });
  m.def("_stop_fused_kernel_builds", &at::kiln::stopFusedKernelBuilds,
        py::call_guard<py::gil_scoped_release>());
  m.def("_wait_for_fused_kernels", &at::kiln::waitForFusedKernelBuilds,
        py::call_guard<py::gil_scoped_release>());
  m.def("_fused_kernel_stats", [] {
    py::dict stats;
    stats["built"] = at::kiln::builtFusedKernelCount();
    stats["interpreter"] = at::kiln::fusedInterpreterBuilt();
    stats["pending"] = at::kiln::pendingFusedKernelBuilds();
    stats["runs"] = at::kiln::fusedKernelRuns();
    stats["interpreted_runs"] = at::kiln::interpretedFusedKernelRuns();
    stats["failures"] = at::kiln::fusedKernelBuildFailures();
    return stats;
  });
  m.def("_gate_stream", [](double timeout_s) {
    // For tests: device work that waits until the returned gate is opened
    // (or timeout_s passed), so work queued behind it deterministically
    // waits in the queue (Note [Adaptive eager fusion] tests).
    struct Gate {
      std::mutex mutex;
      std::condition_variable cv;
      bool open = false;
    };
    auto gate = std::make_shared<Gate>();
    const auto stream = c10::kiln::getCurrentKilnStream();
    at::kiln::launchTask(stream, "kiln::gate", [gate, timeout_s] {
      std::unique_lock<std::mutex> lock(gate->mutex);
      gate->cv.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return gate->open; });
    });
    return py::cpp_function([gate] {
      {
        std::lock_guard<std::mutex> lock(gate->mutex);
        gate->open = true;
      }
      gate->cv.notify_all();
    });
  });
  torch_kiln::initMemoryToolsBindings(m);
  torch_kiln::initAutogradExitBindings(m);
}
