// nn.LSTM on kiln takes CPU's oneDNN path, and so gives CPU's bits.
//
// ATen's aten::lstm (aten/src/ATen/native/RNN.cpp) picks an implementation
// by device. On the CPU (use_mkldnn: oneDNN enabled, float32, bfloat16 where
// oneDNN supports it, float16 without grad mode where it supports that, no
// projections, concrete sizes, a non-empty input) it runs every layer and
// direction as one oneDNN primitive, aten::mkldnn_rnn_layer
// (aten/src/ATen/native/mkldnn/RNN.cpp, mkldnn_rnn), which autograd
// differentiates with mkldnn_rnn_layer_backward. Every other device goes
// step by step through the fused cells (RecurrentCells.cc), which compute
// the same function in another order: kiln's LSTM differed from CPU's by
// ~1e-7. Kiln runs CPU's kernels, so for kiln tensors in the CPU's case it
// composes aten::lstm from aten::mkldnn_rnn_layer exactly as the CPU does
// (the op executor runs that operator's CPU kernel on the device), above
// autograd as for dropout (Dropout.cc): forward and backward are CPU's
// bits. Every other case keeps PyTorch's own composite
// (at::native::lstm), as before: float64, float16 in grad mode, LSTMs with
// projections, traced tensors (under torch.compile, whose default runs an
// LSTM eagerly anyway) and packed sequences (aten::lstm.data, which kiln
// does not override).
//
// Argument shapes are aten::lstm.input's: input (T, B, F), or (B, T, F)
// with batch_first; hx = [h0, c0], each (layers * directions, B, H);
// params = [w_ih, w_hh, b_ih, b_hh] per layer and direction (without the
// biases if has_biases is false). Returns (output (T, B, directions * H) or
// batch-first, h_n, c_n).
#include <vector>

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/lstm_native.h>
#include <ATen/ops/mkldnn_rnn_layer.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

namespace at::kiln {
namespace {

// ideep::rnn_kind::LSTM, the mode mkldnn_rnn_layer takes for an LSTM.
constexpr int64_t kOneDnnLstmMode = 2;

// Asks oneDNN's own device checks, registered as mkldnn::_is_mkldnn_*_supported.
bool oneDnnSupports(const char* check) {
  const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(check, "");
  return handle.typed<bool()>().call();
}

bool allOnKiln(at::TensorList tensors) {
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || !t.device().is_privateuseone() || t.layout() != c10::kStrided) {
      return false;
    }
  }
  return true;
}

// RNN.cpp's use_mkldnn and its conditions in lstm(), with "on the CPU"
// read as "on kiln". Malformed arguments answer false, so that PyTorch's
// own composite raises its own error for them.
bool takesCpuOneDnnPath(const at::Tensor& input, at::TensorList hx, at::TensorList params,
                        bool has_biases, int64_t num_layers, bool bidirectional) {
  if (!at::hasMKLDNN() || !at::globalContext().userEnabledMkldnn()) {
    return false;
  }
  if (hx.size() != 2 || !allOnKiln({input}) || !allOnKiln(hx) || !allOnKiln(params)) {
    return false;
  }
  const size_t per_layer = has_biases ? 4 : 2;
  if (num_layers < 1 || params.size() != per_layer * num_layers * (bidirectional ? 2 : 1)) {
    return false;
  }
  for (const at::Tensor& t : {input, hx[0], hx[1]}) {
    if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
      return false;
    }
    // Traced (torch.compile with torch._dynamo.config.allow_rnn, make_fx):
    // mkldnn_rnn_layer's meta kernel gives an empty workspace, which only
    // Inductor's CPU lowering of the operator accounts for; the fused cells
    // trace and compile on kiln.
    if (t.key_set().has(c10::DispatchKey::Python) ||
        t.key_set().has(c10::DispatchKey::Functionalize)) {
      return false;
    }
  }
  if (input.numel() == 0 || input.dim() != 3 || hx[0].dim() != 3 || hx[1].dim() != 3 ||
      hx[0].size(2) != hx[1].size(2)) { // projections: h is smaller than c
    return false;
  }
  switch (input.scalar_type()) {
    case c10::kFloat:
      return true;
    case c10::kBFloat16:
      return oneDnnSupports("mkldnn::_is_mkldnn_bf16_supported");
    case c10::kHalf:
      return !c10::GradMode::is_enabled() && oneDnnSupports("mkldnn::_is_mkldnn_fp16_supported");
    default:
      return false;
  }
}

// mkldnn_rnn's composition: one mkldnn_rnn_layer per layer and direction,
// directions concatenated on the feature dimension, dropout between layers
// in training.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lstmByLayers(
    const at::Tensor& input, at::TensorList hx, at::TensorList params, bool has_biases,
    int64_t num_layers, double dropout, bool train, bool bidirectional, bool batch_first) {
  const int64_t hidden_size = hx[0].size(2);
  const int64_t directions = bidirectional ? 2 : 1;
  const int64_t per_layer = has_biases ? 4 : 2;
  at::Tensor layer_input = (batch_first ? input.transpose(0, 1) : input).contiguous();
  const at::Tensor h0 = hx[0].contiguous();
  const at::Tensor c0 = hx[1].contiguous();
  std::vector<at::Tensor> h_n(num_layers * directions);
  std::vector<at::Tensor> c_n(num_layers * directions);
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    std::vector<at::Tensor> outputs(directions);
    for (int64_t direction = 0; direction < directions; ++direction) {
      const int64_t index = layer * directions + direction;
      const at::Tensor& w_ih = params[index * per_layer];
      const at::Tensor& w_hh = params[index * per_layer + 1];
      // Without biases CPU passes zeros shaped like the weights.
      const at::Tensor b_ih = has_biases ? params[index * per_layer + 2] : at::zeros(w_ih.sizes(), w_ih.options());
      const at::Tensor b_hh = has_biases ? params[index * per_layer + 3] : at::zeros(w_hh.sizes(), w_hh.options());
      auto [output, hy, cy, workspace] = at::mkldnn_rnn_layer(
          layer_input, w_ih, w_hh, b_ih, b_hh, h0[index], c0[index], /*reverse=*/direction > 0,
          /*batch_sizes=*/{}, kOneDnnLstmMode, hidden_size, num_layers, has_biases,
          bidirectional, batch_first, train);
      outputs[direction] = std::move(output);
      h_n[index] = std::move(hy);
      c_n[index] = std::move(cy);
    }
    layer_input = directions == 1 ? outputs[0] : at::cat(outputs, -1);
    if (dropout != 0 && train && layer < num_layers - 1) {
      layer_input = at::dropout(layer_input, dropout, /*train=*/true);
    }
  }
  at::Tensor output = batch_first ? layer_input.transpose(0, 1) : layer_input;
  return {output, at::stack(h_n, 0), at::stack(c_n, 0)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm(
    const at::Tensor& input, at::TensorList hx, at::TensorList params, bool has_biases,
    int64_t num_layers, double dropout, bool train, bool bidirectional, bool batch_first) {
  if (takesCpuOneDnnPath(input, hx, params, has_biases, num_layers, bidirectional)) {
    return lstmByLayers(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                        batch_first);
  }
  return at::native::lstm(input, hx, params, has_biases, num_layers, dropout, train,
                          bidirectional, batch_first);
}

} // namespace

// The autograd key for training and no_grad; the backend key too, for
// inference_mode, which skips the autograd keys (without it the dispatcher
// would run PyTorch's composite there, and the fused cells' bits).
TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("lstm.input", TORCH_FN(lstm));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("lstm.input", TORCH_FN(lstm));
}

} // namespace at::kiln
