"""LSTM and GRU layers and cells on kiln (fused cells, see RecurrentCells.cc):
CPU's results to rounding, forward and backward."""

import pytest
import torch


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN])
def test_recurrent_layers_match_cpu(cls):
    torch.manual_seed(0)
    cpu = cls(5, 7, num_layers=2, bidirectional=True, batch_first=True)
    kiln = cls(5, 7, num_layers=2, bidirectional=True, batch_first=True)
    kiln.load_state_dict(cpu.state_dict())
    kiln.to("kiln")
    x = torch.randn(3, 4, 5)
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
