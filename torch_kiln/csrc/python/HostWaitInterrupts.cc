// Note [Ctrl-C during a host wait]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Python runs a signal handler (SIGINT -> KeyboardInterrupt) only when the
// main thread is in the interpreter. A main thread waiting for a kiln device
// — torch.kiln.synchronize(), .item(), a blocking copy, a launch onto a full
// queue (Note [Bounded launch queues]) — is inside C++ with the GIL released,
// so Ctrl-C used to take effect only once all queued work had run. The
// runtime calls a host-wait callback every kCheckIntervalMs of a wait (Note
// [Interruptible host waits] in runtime/src/host_wait.cc); ours runs on the
// main thread only, takes the GIL and calls PyErr_CheckSignals(). If a
// handler raised, the Python exception is moved into a python_error kept in a
// thread-local and the wait is abandoned: the runtime call returns
// kilnErrorInterrupted, KILN_CHECK calls the thrower below, and the
// python_error unwinds to the binding that entered C++ (PyTorch's
// HANDLE_TH_ERRORS and our pybind translator restore it), so the program sees
// its own KeyboardInterrupt. The device keeps running what was queued; the
// process can still exit (Note [Shutdown at exit]). Never during interpreter
// finalization, and never on other threads, where PyErr_CheckSignals would
// do nothing but cost a GIL round trip.
#include "python/HostWaitInterrupts.h"

#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <thread>

#include "core/KilnException.h"

namespace torch_kiln {
namespace {

// How often a blocked main thread looks at Python's pending signals: the
// issue's bound for Ctrl-C is about 100 ms.
constexpr unsigned kCheckIntervalMs = 50;

std::thread::id g_main_thread;
thread_local std::unique_ptr<python_error> t_pending_interrupt;

int checkPythonSignals(void* /*user*/) {
  if (std::this_thread::get_id() != g_main_thread || !Py_IsInitialized() || _Py_IsFinalizing()) {
    return 0;
  }
  const PyGILState_STATE gil = PyGILState_Ensure();
  int interrupted = 0;
  if (PyErr_CheckSignals() != 0) {
    auto error = std::make_unique<python_error>();
    error->persist(); // takes (and clears) the exception the handler raised
    t_pending_interrupt = std::move(error);
    interrupted = 1;
  }
  PyGILState_Release(gil);
  return interrupted;
}

void throwPendingInterrupt() {
  if (!t_pending_interrupt) {
    return;
  }
  python_error error(std::move(*t_pending_interrupt));
  t_pending_interrupt.reset();
  throw std::move(error);
}

// KeyboardInterrupt, SystemExit: exceptions that are not Exceptions.
// A Python exception reaches C++ as torch's python_error or as pybind11's
// error_already_set, depending on who called the Python code.
bool isPythonInterrupt(const std::exception& e) {
  PyObject* type = nullptr;
  if (const auto* error = dynamic_cast<const python_error*>(&e)) {
    type = error->type;
  }
  const auto* pybind_error = dynamic_cast<const pybind11::error_already_set*>(&e);
  if (type == nullptr && pybind_error == nullptr) {
    return false;
  }
  pybind11::gil_scoped_acquire gil;
  if (pybind_error != nullptr) {
    type = pybind_error->type().ptr();
  }
  return type != nullptr && PyErr_GivenExceptionMatches(type, PyExc_BaseException) &&
      !PyErr_GivenExceptionMatches(type, PyExc_Exception);
}

} // namespace

void installHostWaitInterrupts() {
  g_main_thread = std::this_thread::get_id();
  c10::kiln::setHostWaitInterruptThrower(&throwPendingInterrupt);
  c10::kiln::setInterruptTest(&isPythonInterrupt);
  KILN_CHECK(kilnSetHostWaitCallback(&checkPythonSignals, nullptr, kCheckIntervalMs));
}

} // namespace torch_kiln
