// Recurrent layers and cells on kiln take CPU's path, and so give CPU's bits.
//
// ATen's recurrent operators (aten/src/ATen/native/RNN.cpp) are composites
// that pick an implementation by device:
//
// * aten::lstm on the CPU (use_mkldnn: oneDNN enabled, float32, bfloat16
//   where oneDNN supports it, float16 without grad mode where it supports
//   that, no projections, concrete sizes, a non-empty input) runs every
//   layer and direction as one oneDNN primitive, aten::mkldnn_rnn_layer
//   (aten/src/ATen/native/mkldnn/RNN.cpp, mkldnn_rnn), which autograd
//   differentiates with mkldnn_rnn_layer_backward.
// * Otherwise the CPU runs the cells step by step, computing each layer's
//   input projection for all time steps at once (FullLayer,
//   FullBidirectionalLayer: "if (input.device().is_cpu())"), with the gates
//   in their unfused form (LSTMCell, GRUCell).
// * Every other device runs the cells step by step with the input
//   projection per step, through the fused cells _thnn_fused_lstm_cell and
//   _thnn_fused_gru_cell (RecurrentCells.cc), which add the biases in
//   another order.
//
// Kiln runs CPU's kernels, so it registers these operators for kiln tensors
// with CPU's compositions, written here after RNN.cpp's: the same ATen
// operators in the same order (mkldnn_rnn_layer runs its CPU kernel through
// the op executor). Forward and backward (autograd records the composing
// operators) are then CPU's bits; before, kiln's LSTM, GRU and RNN differed
// from CPU's by up to ~3e-7. The kernels are registered for AutogradPrivateUse1,
// as dropout is (Dropout.cc), and for PrivateUse1, which inference_mode
// reaches without the autograd key.
//
// What keeps PyTorch's own composite, and so the fused cells: packed
// sequences (the .data overloads, not overridden), and arguments these
// compositions do not take (other devices, malformed lists, which the
// composite then rejects with its own errors). Traced tensors that reach
// these kernels (Dynamo's fake-tensor propagation; AOTAutograd and make_fx
// take PyTorch's Python decompositions instead, Note [Tracing kiln's eager
// compositions] in torch_kiln/compiler/traced_compositions.py) take the
// step-by-step path rather than oneDNN's: mkldnn_rnn_layer's meta kernel
// gives an empty workspace, which only Inductor's CPU lowering accounts for.
//
// Shapes are ATen's: input (T, B, F), or (B, T, F) with batch_first; hidden
// states (layers * directions, B, H) (c: (layers * directions, B, H_cell) for
// an LSTM with projections); params [w_ih, w_hh, b_ih, b_hh, w_hr] per layer
// and direction, without the biases if has_biases is false and without w_hr
// unless the LSTM has projections. Cells: input (B, F), hidden (B, H).
#include <algorithm>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/Context.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/gru_cell_native.h>
#include <ATen/ops/gru_native.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/lstm_cell_native.h>
#include <ATen/ops/lstm_native.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mkldnn_rnn_layer.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/rnn_relu_native.h>
#include <ATen/ops/rnn_tanh_native.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

namespace at::kiln {
namespace {

// ---------------------------------------------------------------------------
// Which arguments these compositions take.

bool isTraced(const at::Tensor& t) {
  return t.key_set().has(c10::DispatchKey::Python) ||
      t.key_set().has(c10::DispatchKey::Functionalize) ||
      t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
}

bool allOnKiln(at::TensorList tensors, c10::ScalarType dtype) {
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || !t.device().is_privateuseone() || t.layout() != c10::kStrided ||
        t.scalar_type() != dtype) {
      return false;
    }
  }
  return true;
}

// A layer's arguments as RNN.cpp's composite expects them: all dense kiln
// tensors of the input's dtype, a 3-D input, 3-D hidden states with one
// entry per layer and direction, and a parameter list of the right length.
bool takesLayerArguments(const at::Tensor& input, at::TensorList hidden, at::TensorList params,
                         size_t per_layer, int64_t num_layers, bool bidirectional) {
  const c10::ScalarType dtype = input.scalar_type();
  if (!allOnKiln({input}, dtype) || !allOnKiln(hidden, dtype) || !allOnKiln(params, dtype)) {
    return false;
  }
  const int64_t directions = bidirectional ? 2 : 1;
  if (input.dim() != 3 || num_layers < 1 ||
      params.size() != per_layer * static_cast<size_t>(num_layers * directions)) {
    return false;
  }
  for (const at::Tensor& h : hidden) {
    if (h.dim() != 3 || h.sym_size(0) != num_layers * directions) {
      return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------
// The oneDNN LSTM (mkldnn/RNN.cpp, mkldnn_rnn).

// ideep::rnn_kind::LSTM, the mode mkldnn_rnn_layer takes for an LSTM.
constexpr int64_t kOneDnnLstmMode = 2;

// Asks oneDNN's own device checks, registered as mkldnn::_is_mkldnn_*_supported.
bool oneDnnSupports(const char* check) {
  const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(check, "");
  return handle.typed<bool()>().call();
}

// RNN.cpp's use_mkldnn and the conditions lstm() adds (no projections,
// concrete sizes), for well-formed kiln arguments.
bool takesOneDnnPath(const at::Tensor& input, at::TensorList hx, bool has_projections) {
  // (Traced first: numel() refuses symbolic sizes.)
  if (isTraced(input) || isTraced(hx[0]) || isTraced(hx[1]) || !at::hasMKLDNN() ||
      !at::globalContext().userEnabledMkldnn() || has_projections || input.numel() == 0) {
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

// Whether the weights and states have an LSTM's shapes: hidden states
// (layers * directions, B, H), w_ih (4H, F) for the first layer and
// (4H, directions * H) after it, w_hh (4H, H), biases (4H). oneDNN's
// primitive reads them as the sizes it is given imply, unchecked: a
// wrong-shaped weight read past its end (garbage results, on the CPU too).
// Kiln sends such arguments down the step-by-step path, whose matrix
// products reject them with ATen's shape errors.
bool hasLstmShapes(const at::Tensor& input, at::TensorList hx, at::TensorList params,
                   bool has_biases, int64_t num_layers, bool bidirectional, bool batch_first) {
  const int64_t directions = bidirectional ? 2 : 1;
  const int64_t per_layer = has_biases ? 4 : 2;
  const int64_t hidden = hx[0].size(2);
  const int64_t batch = input.size(batch_first ? 0 : 1);
  const std::vector<int64_t> state_shape = {num_layers * directions, batch, hidden};
  if (hx[0].sizes() != at::IntArrayRef(state_shape) ||
      hx[1].sizes() != at::IntArrayRef(state_shape)) {
    return false;
  }
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const int64_t features = layer == 0 ? input.size(2) : directions * hidden;
    for (int64_t direction = 0; direction < directions; ++direction) {
      const int64_t first = (layer * directions + direction) * per_layer;
      const std::vector<int64_t> w_ih = {4 * hidden, features};
      const std::vector<int64_t> w_hh = {4 * hidden, hidden};
      const std::vector<int64_t> bias = {4 * hidden};
      if (params[first].sizes() != at::IntArrayRef(w_ih) ||
          params[first + 1].sizes() != at::IntArrayRef(w_hh) ||
          (has_biases && (params[first + 2].sizes() != at::IntArrayRef(bias) ||
                          params[first + 3].sizes() != at::IntArrayRef(bias)))) {
        return false;
      }
    }
  }
  return true;
}

// One mkldnn_rnn_layer per layer and direction, directions concatenated on
// the feature dimension, dropout between layers in training.
std::tuple<at::Tensor, at::Tensor, at::Tensor> oneDnnLstm(
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

// ---------------------------------------------------------------------------
// The step-by-step CPU path (RNN.cpp: CellParams, the cells' CPU branches,
// FullLayer, FullBidirectionalLayer, apply_layer_stack).

// One layer and direction's parameters; undefined tensors where absent.
struct CellParams {
  at::Tensor w_ih, w_hh, b_ih, b_hh, w_hr;

  at::Tensor linear_ih(const at::Tensor& x) const { return at::linear(x, w_ih, b_ih); }
  at::Tensor linear_hh(const at::Tensor& h) const { return at::linear(h, w_hh, b_hh); }
  at::Tensor matmul_hr(const at::Tensor& h) const {
    return w_hr.defined() ? at::matmul(h, w_hr.t()) : h;
  }
};

// RNN.cpp's gather_params, for a list takesLayerArguments accepted.
std::vector<CellParams> gatherParams(at::TensorList params, bool has_biases, bool has_projections) {
  const size_t per_layer = (has_biases ? 4 : 2) + (has_projections ? 1 : 0);
  std::vector<CellParams> result;
  for (size_t i = 0; i < params.size(); i += per_layer) {
    CellParams p{params[i], params[i + 1], {}, {}, {}};
    if (has_biases) {
      p.b_ih = params[i + 2];
      p.b_hh = params[i + 3];
    }
    if (has_projections) {
      p.w_hr = params[i + per_layer - 1];
    }
    result.push_back(std::move(p));
  }
  return result;
}

// A cell's hidden state: h, and c for an LSTM (undefined otherwise).
struct Hidden {
  at::Tensor h, c;
};

enum class CellKind { kLstm, kGru, kRnnTanh, kRnnRelu };

// One step. `x` is the input (B, F), or with `precomputed` its projection
// linear_ih(x) (B, gates * H).
Hidden cellStep(CellKind kind, const at::Tensor& x, const Hidden& hidden, const CellParams& p,
                bool precomputed) {
  switch (kind) {
    case CellKind::kLstm: {
      const at::Tensor gates = p.linear_hh(hidden.h).add_(precomputed ? x : p.linear_ih(x));
      auto chunks = gates.unsafe_chunk(4, 1);
      const at::Tensor ingate = chunks[0].sigmoid_();
      const at::Tensor forgetgate = chunks[1].sigmoid_();
      const at::Tensor cellgate = chunks[2].tanh_();
      const at::Tensor outgate = chunks[3].sigmoid_();
      at::Tensor cy = (forgetgate * hidden.c).add_(ingate * cellgate);
      at::Tensor hy = p.matmul_hr(outgate * cy.tanh());
      return {std::move(hy), std::move(cy)};
    }
    case CellKind::kGru: {
      const auto igates = precomputed ? x.unsafe_chunk(3, 1) : p.linear_ih(x).unsafe_chunk(3, 1);
      auto hgates = p.linear_hh(hidden.h).unsafe_chunk(3, 1);
      const at::Tensor reset_gate = hgates[0].add_(igates[0]).sigmoid_();
      const at::Tensor input_gate = hgates[1].add_(igates[1]).sigmoid_();
      const at::Tensor new_gate = igates[2].add(hgates[2].mul_(reset_gate)).tanh_();
      return {(hidden.h - new_gate).mul_(input_gate).add_(new_gate), {}};
    }
    case CellKind::kRnnTanh:
    case CellKind::kRnnRelu: {
      const at::Tensor pre = p.linear_hh(hidden.h).add_(precomputed ? x : p.linear_ih(x));
      return {kind == CellKind::kRnnTanh ? at::tanh(pre) : at::relu(pre), {}};
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unknown recurrent cell kind");
}

// One direction of one layer over all time steps of `input` (T, B, F),
// with its projection computed for all steps first; outputs in input order.
std::pair<std::vector<at::Tensor>, Hidden> runDirection(
    CellKind kind, const at::Tensor& input, const Hidden& initial, const CellParams& p,
    bool reverse) {
  std::vector<at::Tensor> steps = p.linear_ih(input).unbind(0);
  TORCH_CHECK(!steps.empty(), "Expected sequence length to be larger than 0 in RNN");
  if (reverse) {
    std::reverse(steps.begin(), steps.end());
  }
  std::vector<at::Tensor> outputs;
  outputs.reserve(steps.size());
  Hidden hidden = initial;
  for (const at::Tensor& step : steps) {
    hidden = cellStep(kind, step, hidden, p, /*precomputed=*/true);
    outputs.push_back(hidden.h);
  }
  if (reverse) {
    std::reverse(outputs.begin(), outputs.end());
  }
  return {std::move(outputs), std::move(hidden)};
}

// The layer stack: per layer one or two directions (the backward one over
// the reversed steps), concatenated on the feature dimension, dropout
// between layers in training. `initial` has one entry per layer and
// direction; returns (output (T, B, directions * H), final hidden states).
std::pair<at::Tensor, std::vector<Hidden>> runLayers(
    CellKind kind, const at::Tensor& input, const std::vector<Hidden>& initial,
    const std::vector<CellParams>& params, int64_t num_layers, double dropout, bool train,
    bool bidirectional) {
  const int64_t directions = bidirectional ? 2 : 1;
  std::vector<Hidden> final_hidden;
  at::Tensor layer_input = input;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const int64_t index = layer * directions;
    auto [forward_steps, forward_hidden] =
        runDirection(kind, layer_input, initial[index], params[index], /*reverse=*/false);
    const at::Tensor forward_output = at::stack(forward_steps, 0);
    final_hidden.push_back(std::move(forward_hidden));
    if (bidirectional) {
      auto [backward_steps, backward_hidden] =
          runDirection(kind, layer_input, initial[index + 1], params[index + 1], /*reverse=*/true);
      const at::Tensor backward_output = at::stack(backward_steps, 0);
      final_hidden.push_back(std::move(backward_hidden));
      layer_input = at::cat({forward_output, backward_output}, forward_output.dim() - 1);
    } else {
      layer_input = forward_output;
    }
    if (dropout != 0 && train && layer < num_layers - 1) {
      layer_input = at::dropout(layer_input, dropout, /*train=*/true);
    }
  }
  return {layer_input, std::move(final_hidden)};
}

// ---------------------------------------------------------------------------
// The operators.

std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm(
    const at::Tensor& input, at::TensorList hx, at::TensorList params, bool has_biases,
    int64_t num_layers, double dropout, bool train, bool bidirectional, bool batch_first) {
  const bool has_projections =
      hx.size() == 2 && hx[0].dim() == 3 && hx[1].dim() == 3 && hx[0].sym_size(2) != hx[1].sym_size(2);
  const size_t per_layer = (has_biases ? 4 : 2) + (has_projections ? 1 : 0);
  if (hx.size() != 2 ||
      !takesLayerArguments(input, hx, params, per_layer, num_layers, bidirectional)) {
    return at::native::lstm(input, hx, params, has_biases, num_layers, dropout, train,
                            bidirectional, batch_first);
  }
  if (takesOneDnnPath(input, hx, has_projections) &&
      hasLstmShapes(input, hx, params, has_biases, num_layers, bidirectional, batch_first)) {
    return oneDnnLstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                      batch_first);
  }
  const std::vector<at::Tensor> h0 = hx[0].unbind(0);
  const std::vector<at::Tensor> c0 = hx[1].unbind(0);
  std::vector<Hidden> initial;
  for (size_t i = 0; i < h0.size(); ++i) {
    initial.push_back({h0[i], c0[i]});
  }
  auto [output, final_hidden] =
      runLayers(CellKind::kLstm, batch_first ? input.transpose(0, 1) : input, initial,
                gatherParams(params, has_biases, has_projections), num_layers, dropout, train,
                bidirectional);
  std::vector<at::Tensor> h_n, c_n;
  for (Hidden& h : final_hidden) {
    h_n.push_back(std::move(h.h));
    c_n.push_back(std::move(h.c));
  }
  if (batch_first) {
    output = output.transpose(0, 1);
  }
  return {output, at::stack(h_n, 0), at::stack(c_n, 0)};
}

// GRU and the Elman RNNs: one hidden state (RNN.cpp's ONE_HIDDEN_RNN).
std::tuple<at::Tensor, at::Tensor> oneHiddenLayers(
    CellKind kind, const at::Tensor& input, const at::Tensor& hx, at::TensorList params,
    bool has_biases, int64_t num_layers, double dropout, bool train, bool bidirectional,
    bool batch_first) {
  std::vector<Hidden> initial;
  for (at::Tensor& h : hx.unbind(0)) {
    initial.push_back({std::move(h), {}});
  }
  auto [output, final_hidden] =
      runLayers(kind, batch_first ? input.transpose(0, 1) : input, initial,
                gatherParams(params, has_biases, /*has_projections=*/false), num_layers, dropout,
                train, bidirectional);
  std::vector<at::Tensor> h_n;
  for (Hidden& h : final_hidden) {
    h_n.push_back(std::move(h.h));
  }
  if (batch_first) {
    output.transpose_(0, 1);
  }
  return {output, at::stack(h_n, 0)};
}

#define KILN_ONE_HIDDEN_RNN(NAME, KIND)                                                         \
  std::tuple<at::Tensor, at::Tensor> NAME(                                                      \
      const at::Tensor& input, const at::Tensor& hx, at::TensorList params, bool has_biases,    \
      int64_t num_layers, double dropout, bool train, bool bidirectional, bool batch_first) {   \
    if (!takesLayerArguments(input, {hx}, params, has_biases ? 4 : 2, num_layers,               \
                             bidirectional)) {                                                  \
      return at::native::NAME(input, hx, params, has_biases, num_layers, dropout, train,        \
                              bidirectional, batch_first);                                      \
    }                                                                                           \
    return oneHiddenLayers(KIND, input, hx, params, has_biases, num_layers, dropout, train,     \
                           bidirectional, batch_first);                                         \
  }

KILN_ONE_HIDDEN_RNN(gru, CellKind::kGru)
KILN_ONE_HIDDEN_RNN(rnn_tanh, CellKind::kRnnTanh)
KILN_ONE_HIDDEN_RNN(rnn_relu, CellKind::kRnnRelu)
#undef KILN_ONE_HIDDEN_RNN

// The cells' arguments as RNN.cpp's checks accept them (the same dtype on
// kiln, input (B, F), hidden (B, H), weights (gates * H, F) and (gates * H, H));
// otherwise PyTorch's composite raises its own error.
bool takesCellArguments(const at::Tensor& input, at::TensorList hidden, const at::Tensor& w_ih,
                        const at::Tensor& w_hh, const at::Tensor& b_ih, const at::Tensor& b_hh,
                        int64_t gates) {
  const c10::ScalarType dtype = input.scalar_type();
  if (!allOnKiln({input, w_ih, w_hh}, dtype) || !allOnKiln(hidden, dtype) ||
      (b_ih.defined() && !allOnKiln({b_ih}, dtype)) ||
      (b_hh.defined() && !allOnKiln({b_hh}, dtype))) {
    return false;
  }
  if (input.dim() != 2 || w_ih.dim() != 2 || w_hh.dim() != 2 ||
      input.sym_size(1) != w_ih.sym_size(1) || w_ih.sym_size(0) != gates * w_hh.sym_size(1) ||
      w_hh.sym_size(0) != gates * w_hh.sym_size(1)) {
    return false;
  }
  for (const at::Tensor& h : hidden) {
    if (h.dim() != 2 || h.sym_size(0) != input.sym_size(0) || h.sym_size(1) != w_hh.sym_size(1)) {
      return false;
    }
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor> lstm_cell(
    const at::Tensor& input, at::TensorList hx, const at::Tensor& w_ih, const at::Tensor& w_hh,
    const std::optional<at::Tensor>& b_ih, const std::optional<at::Tensor>& b_hh) {
  const at::Tensor bias_ih = b_ih.value_or(at::Tensor());
  const at::Tensor bias_hh = b_hh.value_or(at::Tensor());
  if (hx.size() != 2 || !takesCellArguments(input, hx, w_ih, w_hh, bias_ih, bias_hh, 4)) {
    return at::native::lstm_cell(input, hx, w_ih, w_hh, b_ih, b_hh);
  }
  Hidden out = cellStep(CellKind::kLstm, input, {hx[0], hx[1]},
                        {w_ih, w_hh, bias_ih, bias_hh, {}}, /*precomputed=*/false);
  return {std::move(out.h), std::move(out.c)};
}

at::Tensor gru_cell(const at::Tensor& input, const at::Tensor& hx, const at::Tensor& w_ih,
                    const at::Tensor& w_hh, const std::optional<at::Tensor>& b_ih,
                    const std::optional<at::Tensor>& b_hh) {
  const at::Tensor bias_ih = b_ih.value_or(at::Tensor());
  const at::Tensor bias_hh = b_hh.value_or(at::Tensor());
  if (!takesCellArguments(input, {hx}, w_ih, w_hh, bias_ih, bias_hh, 3)) {
    return at::native::gru_cell(input, hx, w_ih, w_hh, b_ih, b_hh);
  }
  return cellStep(CellKind::kGru, input, {hx, {}}, {w_ih, w_hh, bias_ih, bias_hh, {}},
                  /*precomputed=*/false).h;
}

void registerRecurrentKernels(torch::Library& m) {
  m.impl("lstm.input", TORCH_FN(lstm));
  m.impl("gru.input", TORCH_FN(gru));
  m.impl("rnn_tanh.input", TORCH_FN(rnn_tanh));
  m.impl("rnn_relu.input", TORCH_FN(rnn_relu));
  m.impl("lstm_cell", TORCH_FN(lstm_cell));
  m.impl("gru_cell", TORCH_FN(gru_cell));
}

} // namespace

// The autograd key for training and no_grad; the backend key too, for
// inference_mode, which skips the autograd keys (without it the dispatcher
// would run PyTorch's composite there, and the fused cells' bits).
TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  registerRecurrentKernels(m);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  registerRecurrentKernels(m);
}

} // namespace at::kiln
