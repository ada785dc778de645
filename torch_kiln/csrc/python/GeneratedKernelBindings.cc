// torch_kiln._C._GeneratedKernel: the object the wrapper code torch.compile
// generates for kiln calls to launch one generated C++ kernel on the current
// kiln stream, and torch_kiln.kernels' launcher of custom kernels
// (`description` names what the kernel is in errors; `counted_as_op` counts
// its launches in torch.kiln.get_executed_ops()) (aten/GeneratedKernels.h; Note [Compiled code runs in stream
// order] in torch_kiln/compiler/inductor/__init__.py).
//
// Arguments are packed here, on the calling thread, from the Python objects
// the wrapper passes, following the kernel's signature string (one letter per
// argument of the generated kernel, in order):
//   'r'  a kiln tensor the kernel reads     -> its data_ptr()
//        (or a 0-dim CPU tensor, a scalar   -> a pointer to a copy of its
//         value that the task owns)
//   'w'  a kiln tensor the kernel writes    -> its data_ptr()
//   'i'  an integer (size, stride, offset)  -> int64
//   'f'  a floating-point scalar            -> the bits of a double
// The trampoline generated next to the kernel unpacks the same layout.
#include "python/GeneratedKernelBindings.h"

#include <cstring>
#include <optional>
#include <string>

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include "aten/GeneratedKernels.h"
#include "core/KilnFunctions.h"
#include "core/KilnStream.h"

namespace py = pybind11;

namespace torch_kiln {
namespace {

class GeneratedKernel {
 public:
  GeneratedKernel(const std::string& name, uintptr_t entry, std::string signature,
                  const std::optional<std::string>& description, bool counted_as_op,
                  bool index_check_raises_index_error)
      : name_(at::kiln::internKernelName(name)),
        entry_(reinterpret_cast<at::kiln::GeneratedKernelEntry>(entry)),
        signature_(std::move(signature)),
        description_(description ? at::kiln::internKernelName(*description)
                                 : at::kiln::GeneratedKernelCall{}.description),
        counted_as_op_(counted_as_op),
        index_check_raises_index_error_(index_check_raises_index_error) {
    TORCH_CHECK_VALUE(entry != 0, "kiln: compiled kernel ", name, " has no entry point");
    for (char kind : signature_) {
      TORCH_CHECK_VALUE(kind == 'r' || kind == 'w' || kind == 'i' || kind == 'f',
                        "kiln: compiled kernel ", name, ": unknown argument kind '", kind,
                        "' in signature '", signature_, "' (expected r, w, i or f)");
    }
  }

  // Launches the kernel on the current stream of kiln:`device` with `args`.
  void call(int device, const py::args& args) const {
    c10::kiln::check_device_index(static_cast<c10::DeviceIndex>(device));
    TORCH_CHECK_TYPE(args.size() == signature_.size(), "kiln: compiled kernel ", name_,
                     " takes ", signature_.size(), " arguments, got ", args.size());
    at::kiln::GeneratedKernelCall call;
    call.entry = entry_;
    call.name = name_;
    call.description = description_;
    call.counted_as_op = counted_as_op_;
    call.index_check_raises_index_error = index_check_raises_index_error_;
    call.packed.reserve(signature_.size());
    std::vector<size_t> host_scalar_slots; // indices into call.packed
    for (size_t i = 0; i < signature_.size(); ++i) {
      PyObject* arg = args[i].ptr();
      switch (signature_[i]) {
        case 'r':
        case 'w': {
          TORCH_CHECK_TYPE(THPVariable_Check(arg), "kiln: compiled kernel ", name_, ": argument ",
                           i, " must be a tensor, got ", Py_TYPE(arg)->tp_name);
          const at::Tensor& tensor = THPVariable_Unpack(arg);
          if (signature_[i] == 'r' && tensor.device().is_cpu() && tensor.dim() == 0) {
            // A 0-dim CPU tensor acts as a scalar, as in eager: its value at
            // the call is copied into the task, which must not read host
            // memory the program may change before it runs (KilnTask.h).
            TORCH_CHECK_VALUE(tensor.element_size() <= static_cast<int64_t>(sizeof(int64_t)),
                              "kiln: compiled kernel ", name_, ": argument ", i,
                              " is a 0-dim CPU tensor of dtype ", tensor.scalar_type(),
                              ", wider than the 8 bytes a scalar argument can hold");
            call.packed.push_back(0); // replaced by a pointer into call.host_scalars below
            host_scalar_slots.push_back(call.packed.size() - 1);
            int64_t value = 0;
            std::memcpy(&value, tensor.const_data_ptr(), tensor.element_size());
            call.host_scalars.push_back(value);
            break;
          }
          const c10::Device expected(c10::DeviceType::PrivateUse1,
                                     static_cast<c10::DeviceIndex>(device));
          TORCH_CHECK_VALUE(tensor.device() == expected, "kiln: compiled kernel ", name_,
                            ": argument ", i, " is on ", tensor.device(), ", expected ",
                            expected,
                            " (every tensor of a compiled kiln kernel lives on its device)");
          call.packed.push_back(reinterpret_cast<int64_t>(tensor.data_ptr()));
          const void* storage = tensor.storage().data();
          if (storage != nullptr) {
            (signature_[i] == 'w' ? call.written_storages : call.read_storages)
                .push_back(storage);
          }
          break;
        }
        case 'i': {
          TORCH_CHECK_TYPE(PyLong_Check(arg), "kiln: compiled kernel ", name_, ": argument ", i,
                           " must be an int, got ", Py_TYPE(arg)->tp_name);
          const long long value = PyLong_AsLongLong(arg);
          if (value == -1 && PyErr_Occurred()) {
            throw py::error_already_set();
          }
          call.packed.push_back(static_cast<int64_t>(value));
          break;
        }
        case 'f': {
          const double value = PyFloat_AsDouble(arg);
          if (value == -1.0 && PyErr_Occurred()) {
            throw py::error_already_set();
          }
          int64_t bits = 0;
          std::memcpy(&bits, &value, sizeof(bits));
          call.packed.push_back(bits);
          break;
        }
      }
    }
    // host_scalars no longer grows: its elements keep their addresses when
    // the call moves into the task.
    for (size_t k = 0; k < host_scalar_slots.size(); ++k) {
      call.packed[host_scalar_slots[k]] = reinterpret_cast<int64_t>(&call.host_scalars[k]);
    }
    const auto stream = c10::kiln::getCurrentKilnStream(static_cast<c10::DeviceIndex>(device));
    at::kiln::launchGeneratedKernel(stream, std::move(call));
  }

  const char* name() const { return name_; }
  const std::string& signature() const { return signature_; }

 private:
  const char* name_;
  at::kiln::GeneratedKernelEntry entry_;
  std::string signature_;
  const char* description_;
  bool counted_as_op_;
  bool index_check_raises_index_error_;
};

} // namespace

void bindGeneratedKernels(py::module& m) {
  py::class_<GeneratedKernel>(m, "_GeneratedKernel")
      .def(py::init<const std::string&, uintptr_t, std::string,
                    const std::optional<std::string>&, bool, bool>(),
           py::arg("name"), py::arg("entry"), py::arg("signature"),
           py::arg("description") = py::none(), py::arg("counted_as_op") = false,
           py::arg("index_check_raises_index_error") = true)
      .def("launch", &GeneratedKernel::call)
      .def_property_readonly("name", &GeneratedKernel::name)
      .def_property_readonly("signature", &GeneratedKernel::signature);
}

} // namespace torch_kiln
