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


def test_kernel_warnings_become_python_warnings():
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.ones(1, device="kiln").std()
        torch.kiln.synchronize()
    assert any("degrees of freedom" in str(w.message) for w in caught)


def test_kiln_generator_with_cpu_tensors_is_named():
    with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator but found 'kiln'"):
        torch.randn(3, generator=torch.Generator(device="kiln"))


def test_reading_past_a_shrunk_storage_is_a_clear_error():
    x = torch.ones(2, device="kiln")
    x.untyped_storage().resize_(4)
    with pytest.raises(RuntimeError, match="extend past its storage"):
        x.cpu()


@pytest.mark.parametrize("reduction", [
    lambda e: torch.max(e),
    lambda e: torch.aminmax(e),
    lambda e: torch.linalg.vector_norm(e, ord=float("inf")),
])
def test_reduction_of_an_empty_tensor_raises_at_the_call_without_a_sync(reduction):
    empty = torch.empty(0, device="kiln")
    torch.kiln.synchronize()
    torch.kiln.clear_op_tracking()
    with pytest.raises(RuntimeError) as on_kiln:
        reduction(empty)
    with pytest.raises(RuntimeError) as on_cpu:
        reduction(torch.empty(0))
    assert str(on_kiln.value) == str(on_cpu.value)
    assert torch.kiln.get_sync_ops() == {}
