"""print/repr, item, tolist, bool, float and numpy on kiln tensors behave as
on CUDA."""

import pytest
import torch


def test_repr_names_the_device_and_matches_cpu_values():
    x = torch.tensor([[1.5, -2.0], [3.25, 4.0]])
    text = repr(x.kiln())
    assert "device='kiln:0'" in text
    assert text.replace(", device='kiln:0'", "") == repr(x)
    assert "device='kiln:1'" in repr(x.to("kiln:1"))


def test_print_works(capsys):
    print(torch.arange(5, device="kiln"))
    assert capsys.readouterr().out.strip() == "tensor([0, 1, 2, 3, 4], device='kiln:0')"


def test_item_tolist_bool_float_int():
    x = torch.tensor([[1.5, 2.0], [3.0, 4.0]])
    k = x.kiln()
    assert k[0, 0].item() == 1.5
    assert k.tolist() == x.tolist()
    assert bool(k[0, 0]) is True
    assert bool(torch.zeros(1, device="kiln")) is False
    assert float(k[1, 1]) == 4.0
    assert int(k[1, 0]) == 3
    with pytest.raises(RuntimeError, match="ambiguous"):
        bool(k)


def test_numpy_requires_cpu_first():
    with pytest.raises(TypeError, match=r"can't convert kiln:0 device type tensor to numpy.*\.cpu\(\)"):
        torch.ones(2, device="kiln").numpy()
    assert torch.ones(2, device="kiln").cpu().numpy().tolist() == [1.0, 1.0]
