"""LSTM, GRU and RNN layers and cells on kiln. A float32 (or, where oneDNN
supports it, bfloat16) LSTM without projections takes CPU's oneDNN path
(OneDnnLstm.cc) and gives CPU's bits, forward and backward; the rest goes
through the fused cells (RecurrentCells.cc): CPU's results to rounding."""

import copy

import pytest
import torch

from conftest import assert_same


@pytest.mark.parametrize("cls", [torch.nn.GRU, torch.nn.RNN,
                                 lambda *a, **k: torch.nn.LSTM(*a, **k, proj_size=4),
                                 lambda *a, **k: torch.nn.LSTM(*a, **k).double()])
def test_recurrent_layers_match_cpu(cls):
    torch.manual_seed(0)
    cpu = cls(5, 7, num_layers=2, bidirectional=True, batch_first=True)
    kiln = cls(5, 7, num_layers=2, bidirectional=True, batch_first=True)
    kiln.load_state_dict(cpu.state_dict())
    kiln.to("kiln")
    x = torch.randn(3, 4, 5, dtype=next(cpu.parameters()).dtype)
    y_cpu, _ = cpu(x)
    y_kiln, _ = kiln(x.to("kiln"))
    torch.testing.assert_close(y_kiln.cpu(), y_cpu.detach(), rtol=1e-5, atol=1e-6)
    y_cpu.pow(2).sum().backward()
    y_kiln.pow(2).sum().backward()
    for k, c in zip(kiln.parameters(), cpu.parameters()):
        torch.testing.assert_close(k.grad.cpu(), c.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", [torch.nn.LSTMCell, torch.nn.GRUCell])
def test_recurrent_cells_match_cpu(cls):
    torch.manual_seed(0)
    cpu = cls(5, 7)
    kiln = cls(5, 7)
    kiln.load_state_dict(cpu.state_dict())
    kiln.to("kiln")
    x = torch.randn(3, 5)
    out_cpu, out_kiln = cpu(x), kiln(x.to("kiln"))
    first = (lambda o: o[0]) if isinstance(out_cpu, tuple) else (lambda o: o)
    torch.testing.assert_close(first(out_kiln).cpu(), first(out_cpu).detach(), rtol=1e-5, atol=1e-6)
    first(out_cpu).sum().backward()
    first(out_kiln).sum().backward()
    for k, c in zip(kiln.parameters(), cpu.parameters()):
        torch.testing.assert_close(k.grad.cpu(), c.grad, rtol=1e-5, atol=1e-5)


def lstm_step(lstm, x, hx, device, dtype=torch.float32):
    """(output, h_n, c_n, input gradient, h0 and c0 gradients, parameter
    gradients) of one forward and backward on ``device``, in ``dtype``."""
    lstm = copy.deepcopy(lstm).to(device, dtype)
    x = x.to(device, dtype).requires_grad_()
    hx = tuple(h.to(device, dtype).requires_grad_() for h in hx) if hx else None
    out, (h_n, c_n) = lstm(x, hx)
    weights = torch.linspace(-1, 1, out.numel(), device=device, dtype=dtype).view_as(out)
    ((out * weights).sum() + h_n.sum() * 0.5 + c_n.sum() * 0.25).backward()
    grads = [x.grad] + ([h.grad for h in hx] if hx else []) + [p.grad for p in lstm.parameters()]
    return [t.detach().cpu() for t in [out, h_n, c_n] + grads]


LSTM_CONFIGS = {
    "one layer": dict(),
    "two layers, bidirectional, batch first": dict(num_layers=2, bidirectional=True,
                                                   batch_first=True),
    "no bias": dict(bias=False, num_layers=2),
    "given state": dict(num_layers=2, bidirectional=True),
}


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("config", list(LSTM_CONFIGS))
def test_lstm_is_cpus_bits(config, device):
    """Before OneDnnLstm.cc, kiln's LSTM went through the fused cells and
    differed from CPU's oneDNN path by ~1e-7."""
    kwargs = LSTM_CONFIGS[config]
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(5, 7, **kwargs)
    batch_first = kwargs.get("batch_first", False)
    x = torch.randn(3, 4, 5) if batch_first else torch.randn(4, 3, 5)
    layers = kwargs.get("num_layers", 1) * (2 if kwargs.get("bidirectional") else 1)
    hx = (torch.randn(layers, 3, 7), torch.randn(layers, 3, 7)) if config == "given state" else None
    for got, expected in zip(lstm_step(lstm, x, hx, device), lstm_step(lstm, x, hx, "cpu")):
        assert_same(got, expected)


def test_lstm_dropout_between_layers_in_training_is_cpus():
    """The dropout between layers draws from the kiln generator in CPU's
    sequence (Note [Kiln random numbers]), so with one seed the masks and
    results are CPU's."""
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(5, 7, num_layers=3, dropout=0.5)
    x = torch.randn(6, 2, 5)
    results = []
    for device in ("kiln", "cpu"):
        torch.manual_seed(1)
        results.append(lstm_step(lstm, x, None, device))
    for got, expected in zip(*results):
        assert_same(got, expected)


def test_lstm_on_a_side_stream_without_grad_and_on_a_noncontiguous_input():
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(5, 7, num_layers=2)
    x = torch.randn(5, 8, 3).transpose(0, 2)  # (3, 8, 5), not contiguous
    kiln_lstm = copy.deepcopy(lstm).to("kiln")
    x_kiln = x.to("kiln").transpose(0, 2).contiguous().transpose(0, 2)
    assert not x_kiln.is_contiguous()
    stream = torch.kiln.Stream()
    with torch.inference_mode(), torch.kiln.stream(stream):
        out, (h_n, c_n) = kiln_lstm(x_kiln)
    stream.synchronize()
    with torch.inference_mode():
        expected, (expected_h, expected_c) = lstm(x)
    assert_same(out, expected)
    assert_same(h_n, expected_h)
    assert_same(c_n, expected_c)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="oneDNN has no bfloat16 LSTM on this CPU: CPU and kiln both take "
                           "another path, compared to rounding in the fused-cells test")
def test_bfloat16_lstm_is_cpus_bits():
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(5, 7, num_layers=2, bidirectional=True)
    x = torch.randn(4, 3, 5)
    got = lstm_step(lstm, x, None, "kiln", torch.bfloat16)
    expected = lstm_step(lstm, x, None, "cpu", torch.bfloat16)
    for g, e in zip(got, expected):
        assert_same(g, e)


def test_lstm_bad_arguments_raise_pytorchs_errors():
    lstm = torch.nn.LSTM(4, 3).to("kiln")
    x = torch.randn(5, 2, 4, device="kiln")
    with pytest.raises(RuntimeError, match="not at the same device"):
        lstm(x, (torch.zeros(1, 2, 3), torch.zeros(1, 2, 3)))
    with pytest.raises(RuntimeError, match=r"Expected hidden\[0\] size \(1, 2, 3\), got \[1, 2, 5\]"):
        lstm(x, (torch.zeros(1, 2, 5, device="kiln"), torch.zeros(1, 2, 3, device="kiln")))
    with pytest.raises(RuntimeError, match="larger than 0"):
        lstm(torch.randn(0, 2, 4, device="kiln"))
    weights = list(lstm._flat_weights)
    with pytest.raises(RuntimeError, match="lstm expects two hidden states"):
        torch._VF.lstm(x, [torch.zeros(1, 2, 3, device="kiln")], weights, True, 1, 0.0, True,
                       False, False)
    with pytest.raises(RuntimeError, match="incorrect number of RNN parameters"):
        torch._VF.lstm(x, [torch.zeros(1, 2, 3, device="kiln")] * 2, weights[:3], True, 1, 0.0,
                       True, False, False)


def test_compiled_lstm_with_allow_rnn_traces_on_kiln():
    """Traced LSTMs keep the fused cells: mkldnn_rnn_layer's meta kernel
    gives an empty workspace, which only Inductor's CPU lowering accounts
    for (the compiled kiln graph failed its size assertion). Compiled kiln
    is CPU's result to rounding there, as eager kiln was before
    OneDnnLstm.cc; by default Dynamo runs an LSTM eagerly (CPU's bits).
    (Compared with eager CPU: compiled CPU fails in 2.13 when the input does
    not require grad, "expected Tensor() for op mkldnn_rnn_layer".)"""
    import torch._dynamo
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(6, 8, batch_first=True)
    x = torch.randn(3, 4, 6)
    torch._dynamo.reset()
    model = copy.deepcopy(lstm).to("kiln")
    with torch._dynamo.config.patch(allow_rnn=True):
        out = torch.compile(model, fullgraph=True)(x.to("kiln"))[0]
    torch._dynamo.reset()
    out.sum().backward()
    expected = lstm(x)[0]
    expected.sum().backward()
    torch.testing.assert_close(out.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-6)
    for k, c in zip(model.parameters(), lstm.parameters()):
        torch.testing.assert_close(k.grad.cpu(), c.grad, rtol=1e-5, atol=1e-5)
