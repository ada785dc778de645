// Note [Legacy typed tensor classes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch.cuda.FloatTensor, DoubleTensor, HalfTensor, BFloat16Tensor,
// ByteTensor, CharTensor, ShortTensor, IntTensor, LongTensor and BoolTensor
// are made by PyTorch's torch/csrc/tensor/python_tensor.cpp for the backends
// of torch::utils::all_declared_types() only (CPU, CUDA and their sparse
// forms; "do not add more types here"), so a PrivateUse1 backend gets none.
// The string forms already work for kiln without us: Tensor.type() returns
// "torch.kiln.FloatTensor" and Tensor.type("torch.kiln.FloatTensor") converts,
// because options_from_string knows the PrivateUse1 backend's name. What is
// missing is the classes, so this file makes them the way python_tensor.cpp
// makes CUDA's:
//   - each class is a static type object whose tp_name is the full dotted
//     name ("torch.kiln.FloatTensor"), so __module__ is "torch.kiln",
//     __name__ "FloatTensor", and Tensor.type(torch.kiln.FloatTensor) works
//     (it parses the class's tp_name);
//   - calling it is PyTorch's legacy constructor for (PrivateUse1, dtype)
//     (torch::utils::legacy_tensor_ctor), so sizes, data, storages, tensors
//     and device= behave, and fail, exactly as for torch.cuda.FloatTensor,
//     on the current kiln device unless device= says otherwise; it warns
//     once that these constructors are not recommended, as CUDA's do;
//   - a metaclass of ours gives __instancecheck__ (the tensor's backend is
//     kiln and its dtype the class's, as PyTorch tests legacyExtractDispatchKey
//     and scalar_type) and the class properties dtype, layout, is_cuda
//     (False), is_kiln (True), is_sparse and is_sparse_csr;
//   - the classes carry torch.Tensor's methods (torch.kiln.FloatTensor.add is
//     torch.Tensor.add) and cannot be subclassed, like CUDA's.
// PyTorch's own metaclass (torch.tensortype) is not reused: its methods read a
// private struct layout from the type object. torch.set_default_tensor_type
// accepts only PyTorch's own classes, so it raises TypeError for these, as it
// would for any class it did not make.
#include "python/LegacyTensorTypes.h"

#include <c10/core/DispatchKeySet.h>
#include <c10/core/ScalarType.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/utils/wrap_outputs.h>
#include <torch/csrc/utils/device_lazy_init.h>
#include <torch/csrc/utils/tensor_new.h>

#include <array>
#include <cstring>
#include <string>

namespace py = pybind11;

namespace torch_kiln {
namespace {

// Layout of each class object: the type object first, so a PyTypeObject* of
// one of our classes is a KilnTensorType*.
struct KilnTensorType {
  PyTypeObject py_type;
  THPDtype* dtype;
  THPLayout* layout;
  at::ScalarType scalar_type;
  char name[64];
};
static_assert(std::is_standard_layout_v<KilnTensorType>);

constexpr std::array<at::ScalarType, 10> kScalarTypes = {
    at::kByte,  at::kChar, at::kDouble, at::kFloat, at::kInt,
    at::kLong,  at::kShort, at::kHalf,  at::kBool,  at::kBFloat16};

std::array<KilnTensorType, kScalarTypes.size()> g_types;
PyTypeObject g_metaclass;
bool g_initialized = false;

PyObject* KilnTensorType_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  HANDLE_TH_ERRORS
  const auto& self = *reinterpret_cast<KilnTensorType*>(type);
  TORCH_WARN_ONCE(
      "The torch.kiln.*DtypeTensor constructors are no longer recommended. It's best to use "
      "methods such as torch.tensor(data, dtype=*, device='kiln') to create tensors.");
  torch::utils::device_lazy_init(at::kPrivateUse1);
  return THPVariable_Wrap(torch::utils::legacy_tensor_ctor(c10::DispatchKey::PrivateUse1,
                                                          self.scalar_type, args, kwargs));
  END_HANDLE_TH_ERRORS
}

PyObject* KilnTensorType_instancecheck(PyObject* cls, PyObject* arg) {
  HANDLE_TH_ERRORS
  const auto& self = *reinterpret_cast<KilnTensorType*>(cls);
  if (THPVariable_Check(arg)) {
    const at::Tensor& t = THPVariable_Unpack(arg);
    if (c10::legacyExtractDispatchKey(t.key_set()) == c10::DispatchKey::PrivateUse1 &&
        t.scalar_type() == self.scalar_type) {
      Py_RETURN_TRUE;
    }
  }
  Py_RETURN_FALSE;
  END_HANDLE_TH_ERRORS
}

PyObject* KilnTensorType_dtype(PyObject* cls, void*) {
  return torch::autograd::utils::wrap(reinterpret_cast<KilnTensorType*>(cls)->dtype);
}

PyObject* KilnTensorType_layout(PyObject* cls, void*) {
  return torch::autograd::utils::wrap(reinterpret_cast<KilnTensorType*>(cls)->layout);
}

PyObject* returnTrue(PyObject*, void*) { Py_RETURN_TRUE; }
PyObject* returnFalse(PyObject*, void*) { Py_RETURN_FALSE; }

PyMethodDef g_metaclass_methods[] = {
    {"__instancecheck__", KilnTensorType_instancecheck, METH_O, nullptr},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef g_metaclass_properties[] = {
    {"dtype", KilnTensorType_dtype, nullptr, nullptr, nullptr},
    {"layout", KilnTensorType_layout, nullptr, nullptr, nullptr},
    {"is_cuda", returnFalse, nullptr, nullptr, nullptr},
    {"is_kiln", returnTrue, nullptr, nullptr, nullptr},
    {"is_sparse", returnFalse, nullptr, nullptr, nullptr},
    {"is_sparse_csr", returnFalse, nullptr, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

// torch.Tensor's attributes (its own and torch._C.TensorBase's), copied into
// each class as python_tensor.cpp does.
py::dict tensorAttributes() {
  py::object tensor = py::module::import("torch").attr("Tensor");
  auto* type = reinterpret_cast<PyTypeObject*>(tensor.ptr());
  py::dict attrs;
  if (PyDict_Merge(attrs.ptr(), type->tp_dict, 0) < 0) throw python_error();
  if (type->tp_base != nullptr && PyDict_Merge(attrs.ptr(), type->tp_base->tp_dict, 0) < 0)
    throw python_error();
  return attrs;
}

void initializeTypes() {
  std::memset(&g_metaclass, 0, sizeof(g_metaclass));
  Py_SET_REFCNT(reinterpret_cast<PyObject*>(&g_metaclass), 1);
  g_metaclass.tp_name = "torch.kiln.tensortype";
  g_metaclass.tp_basicsize = sizeof(PyTypeObject);
  g_metaclass.tp_flags = Py_TPFLAGS_DEFAULT;
  g_metaclass.tp_methods = g_metaclass_methods;
  g_metaclass.tp_getset = g_metaclass_properties;
  g_metaclass.tp_base = &PyType_Type;
  if (PyType_Ready(&g_metaclass) < 0) throw python_error();

  const py::dict attrs = tensorAttributes();
  for (size_t i = 0; i < kScalarTypes.size(); ++i) {
    KilnTensorType& t = g_types[i];
    std::memset(&t, 0, sizeof(t));
    t.scalar_type = kScalarTypes[i];
    t.dtype = torch::getTHPDtype(t.scalar_type);
    t.layout = torch::getTHPLayout(at::kStrided);
    const std::string name = std::string("torch.kiln.") + c10::toString(t.scalar_type) + "Tensor";
    std::strncpy(t.name, name.c_str(), sizeof(t.name) - 1);

    PyObject* obj = reinterpret_cast<PyObject*>(&t.py_type);
    Py_SET_REFCNT(obj, 1);
    Py_SET_TYPE(obj, &g_metaclass);
    t.py_type.tp_name = t.name;
    t.py_type.tp_basicsize = sizeof(KilnTensorType);
    t.py_type.tp_flags = Py_TPFLAGS_DEFAULT;  // no Py_TPFLAGS_BASETYPE: as CUDA's
    t.py_type.tp_new = KilnTensorType_new;
    if (PyType_Ready(&t.py_type) < 0) throw python_error();
    if (PyDict_Merge(t.py_type.tp_dict, attrs.ptr(), 0) < 0) throw python_error();
    PyType_Modified(&t.py_type);
  }
  g_initialized = true;
}

void addLegacyTensorTypes(const py::module& module) {
  if (!g_initialized) initializeTypes();
  py::object tensor_classes = py::module::import("torch").attr("_tensor_classes");
  for (KilnTensorType& t : g_types) {
    py::handle cls(reinterpret_cast<PyObject*>(&t.py_type));
    const std::string name(t.name);
    module.attr(name.substr(name.rfind('.') + 1).c_str()) = cls;
    tensor_classes.attr("add")(cls);
  }
}

} // namespace

void bindLegacyTensorTypes(py::module& m) {
  m.def("_add_legacy_tensor_types", &addLegacyTensorTypes, py::arg("module"));
}

} // namespace torch_kiln
