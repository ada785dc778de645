// LSTM and GRU cells on kiln.
//
// For accelerators PyTorch's recurrent layers (aten/src/ATen/native/RNN.cpp)
// compute the gate matrix products with matmul and hand the element-wise
// rest of the cell to fused kernels, _thnn_fused_lstm_cell and
// _thnn_fused_gru_cell, which only CUDA implements. Kiln implements them, and
// their backward kernels, as compositions of ATen operators with the math of
// CUDA's fused kernels (aten/src/ATen/native/cuda/RNN.cu): gate order
// (i, f, g, o) for LSTM and (r, z, n) for GRU, and the same workspace layout,
// so PyTorch's autograd formulas apply unchanged. Because the fused path adds
// the biases after the matrix products where CPU's unfused path adds them
// inside, results agree with CPU to rounding, not bit for bit. Kiln's
// layers and cells take CPU's path instead (RecurrentLayers.cc); these
// kernels remain for what that file leaves to PyTorch's composites (packed
// sequences) and for direct calls.
//
// PyTorch has Meta kernels for the LSTM cell's two operators but none for
// the GRU cell's; kiln registers them (fusedGruCellMeta, ...), so
// torch.compile traces GRUs, with symbolic sizes too (Note [Kiln kernels
// under FakeTensorMode], FakeKernels.cc). They allocate what the
// compositions return: contiguous tensors of the gates' dtype.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace at::kiln {
namespace {

at::Tensor withBias(const at::Tensor& gates, const std::optional<at::Tensor>& bias) {
  return bias.has_value() && bias->defined() ? gates + *bias : gates;
}

// workspace = [i, f, g, o] after their activations; (hy, cy, workspace).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fusedLstmCell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& cx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  const at::Tensor gates = withBias(withBias(input_gates + hidden_gates, input_bias), hidden_bias);
  const auto chunks = gates.chunk(4, 1);
  const at::Tensor i = chunks[0].sigmoid();
  const at::Tensor f = chunks[1].sigmoid();
  const at::Tensor g = chunks[2].tanh();
  const at::Tensor o = chunks[3].sigmoid();
  const at::Tensor cy = f * cx + i * g;
  const at::Tensor hy = o * cy.tanh();
  return {hy, cy, at::cat({i, f, g, o}, 1)};
}

// (grad_gates, grad_cx, grad_bias) from the activated gates in `workspace`.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fusedLstmCellBackward(
    const std::optional<at::Tensor>& grad_hy, const std::optional<at::Tensor>& grad_cy,
    const at::Tensor& cx, const at::Tensor& cy, const at::Tensor& workspace, bool has_bias) {
  const auto gates = workspace.chunk(4, 1);
  const at::Tensor &i = gates[0], &f = gates[1], &g = gates[2], &o = gates[3];
  const at::Tensor tanh_cy = cy.tanh();
  const bool has_grad_hy = grad_hy.has_value() && grad_hy->defined();
  at::Tensor grad_c = grad_cy.has_value() && grad_cy->defined() ? *grad_cy : at::zeros_like(cy);
  at::Tensor grad_o = at::zeros_like(o);
  if (has_grad_hy) {
    grad_c = grad_c + *grad_hy * o * (1 - tanh_cy * tanh_cy);
    grad_o = *grad_hy * tanh_cy * o * (1 - o);
  }
  const at::Tensor grad_i = grad_c * g * i * (1 - i);
  const at::Tensor grad_f = grad_c * cx * f * (1 - f);
  const at::Tensor grad_g = grad_c * i * (1 - g * g);
  const at::Tensor grad_gates = at::cat({grad_i, grad_f, grad_g, grad_o}, 1);
  const at::Tensor grad_bias = has_bias ? grad_gates.sum(0) : at::Tensor();
  return {grad_gates, grad_c * f, grad_bias};
}

// workspace = [r, z, n, hx, hidden n-gate]; (hy, workspace).
std::tuple<at::Tensor, at::Tensor> fusedGruCell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& hx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  const auto in = withBias(input_gates, input_bias).chunk(3, 1);
  const auto hid = withBias(hidden_gates, hidden_bias).chunk(3, 1);
  const at::Tensor r = (in[0] + hid[0]).sigmoid();
  const at::Tensor z = (in[1] + hid[1]).sigmoid();
  const at::Tensor n = (in[2] + r * hid[2]).tanh();
  const at::Tensor hy = n + z * (hx - n);
  return {hy, at::cat({r, z, n, hx, hid[2]}, 1)};
}

// (grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fusedGruCellBackward(
    const at::Tensor& grad_hy, const at::Tensor& workspace, bool has_bias) {
  const auto parts = workspace.chunk(5, 1);
  const at::Tensor &r = parts[0], &z = parts[1], &n = parts[2], &hx = parts[3], &hn = parts[4];
  const at::Tensor grad_n = grad_hy * (1 - z) * (1 - n * n);
  const at::Tensor grad_z = grad_hy * (hx - n) * z * (1 - z);
  const at::Tensor grad_r = grad_n * hn * r * (1 - r);
  const at::Tensor grad_input_gates = at::cat({grad_r, grad_z, grad_n}, 1);
  const at::Tensor grad_hidden_gates = at::cat({grad_r, grad_z, grad_n * r}, 1);
  return {grad_input_gates, grad_hidden_gates, grad_hy * z,
          has_bias ? grad_input_gates.sum(0) : at::Tensor(),
          has_bias ? grad_hidden_gates.sum(0) : at::Tensor()};
}

// Meta kernels (allocation only, SymInt sizes: the compositions above call
// chunk, whose C++ kernel needs concrete sizes). N = batch, H = hidden size.
std::tuple<at::Tensor, at::Tensor> fusedGruCellMeta(
    const at::Tensor& input_gates, const at::Tensor&, const at::Tensor& hx,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&) {
  const c10::SymInt n = hx.sym_size(0), h = hx.sym_size(1);
  const auto options = input_gates.options();
  return {at::empty_symint({n, h}, options), at::empty_symint({n, h * 5}, options)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fusedGruCellBackwardMeta(
    const at::Tensor& grad_hy, const at::Tensor& workspace, bool has_bias) {
  const c10::SymInt n = workspace.sym_size(0), h = grad_hy.sym_size(1);
  const auto options = grad_hy.options();
  return {at::empty_symint({n, h * 3}, options), at::empty_symint({n, h * 3}, options),
          at::empty_symint({n, h}, options),
          has_bias ? at::empty_symint({h * 3}, options) : at::Tensor(),
          has_bias ? at::empty_symint({h * 3}, options) : at::Tensor()};
}

} // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_thnn_fused_lstm_cell", TORCH_FN(fusedLstmCell));
  m.impl("_thnn_fused_lstm_cell_backward_impl", TORCH_FN(fusedLstmCellBackward));
  m.impl("_thnn_fused_gru_cell", TORCH_FN(fusedGruCell));
  m.impl("_thnn_fused_gru_cell_backward", TORCH_FN(fusedGruCellBackward));
}

TORCH_LIBRARY_IMPL(aten, Meta, m) {
  m.impl("_thnn_fused_gru_cell", TORCH_FN(fusedGruCellMeta));
  m.impl("_thnn_fused_gru_cell_backward", TORCH_FN(fusedGruCellBackwardMeta));
}

} // namespace at::kiln
