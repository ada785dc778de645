// ArgumentTensors.h — the tensors inside one boxed operator argument or
// return value, given its ArgKind (OpSchemaInfo.h): visiting them, replacing
// them, and naming the operator in errors. Shared by the eager op executor
// (KilnOpExecutor.cc) and the sparse fallback (SparseTensors.cc).
//
// A Tensor or Tensor? argument holds one tensor or None; a Tensor[] holds
// tensors; a Tensor?[] (index's indices) holds tensors and Nones. Undefined
// tensors are visited like defined ones (callers check t.defined()). Values
// of other kinds hold no tensors and come back unchanged.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "aten/OpSchemaInfo.h"

namespace at::kiln {

// The operator as PyTorch's own errors name it: "aten::add.Tensor", or
// "aten::relu" for the default overload.
inline std::string opName(const c10::FunctionSchema& schema) {
  return schema.overload_name().empty() ? schema.name()
                                        : schema.name() + "." + schema.overload_name();
}

inline std::string opName(const OpSchemaInfo& info) {
  return opName(*info.schema);
}

// The kind of the value a return slot holds (a tensor or a list of them).
inline ArgKind returnArgKind(const ReturnInfo& ret) {
  return ret.is_list ? ArgKind::TensorList : ArgKind::Tensor;
}

// Calls f(tensor) for each tensor in `value`.
template <typename F>
void forEachTensorIn(const c10::IValue& value, ArgKind kind, F&& f) {
  switch (kind) {
    case ArgKind::Tensor:
    case ArgKind::OptionalTensor:
      if (value.isTensor()) {
        f(value.toTensor());
      }
      break;
    case ArgKind::TensorList:
    case ArgKind::OptionalTensorList:
      if (value.isList()) {
        for (const c10::IValue& element : value.toListRef()) {
          if (element.isTensor()) {
            f(element.toTensor());
          }
        }
      }
      break;
    default:
      break;
  }
}

// `value` with every tensor in it replaced by f(tensor), lists and optionals
// kept as they are.
template <typename F>
c10::IValue mapTensors(const c10::IValue& value, ArgKind kind, F&& f) {
  switch (kind) {
    case ArgKind::Tensor:
    case ArgKind::OptionalTensor:
      return value.isTensor() ? c10::IValue(f(value.toTensor())) : value;
    case ArgKind::TensorList: {
      if (!value.isList()) {
        return value;
      }
      std::vector<at::Tensor> tensors;
      for (const c10::IValue& element : value.toListRef()) {
        tensors.push_back(f(element.toTensor()));
      }
      return c10::IValue(c10::List<at::Tensor>(tensors));
    }
    case ArgKind::OptionalTensorList: {
      if (!value.isList()) {
        return value;
      }
      std::vector<std::optional<at::Tensor>> tensors;
      for (const c10::IValue& element : value.toListRef()) {
        if (element.isTensor()) {
          tensors.emplace_back(f(element.toTensor()));
        } else {
          tensors.emplace_back(std::nullopt);
        }
      }
      return c10::IValue(c10::List<std::optional<at::Tensor>>(tensors));
    }
    default:
      return value;
  }
}

} // namespace at::kiln
