"""Bad input gets PyTorch's standard errors, never an internal assert."""

import pytest
import torch

from conftest import assert_same


def test_mixing_cpu_and_kiln_tensors():
    k = torch.ones(3, device="kiln")
    c = torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device") as info:
        k + c
    assert "INTERNAL ASSERT" not in str(info.value)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.mm(k.reshape(1, 3), c.reshape(3, 1))
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        c + k


def test_mixing_kiln_devices():
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(3, device="kiln:0") + torch.ones(3, device="kiln:1")


def test_zero_dim_cpu_tensors_act_as_scalars():
    k = torch.arange(3.0, device="kiln")
    assert_same(k * torch.tensor(2.0), torch.arange(3.0) * 2)
    assert_same(k + torch.tensor(1, dtype=torch.int64), torch.arange(3.0) + 1)
    assert_same(torch.tensor(2.0) * k, torch.arange(3.0) * 2)
    assert (k * torch.tensor(2.0)).device.type == "kiln"
