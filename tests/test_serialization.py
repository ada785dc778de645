"""torch.save / torch.load of kiln tensors and modules, every map_location
form, weights_only=True, and state dicts across devices."""

import io

import pytest
import torch
import torch.nn as nn

from conftest import assert_same


def saved(obj) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def test_views_keep_sharing_storage():
    t = torch.arange(12.0).reshape(3, 4).to("kiln")
    loaded = torch.load(saved({"w": t, "row": t[1]}))
    assert loaded["w"].device == loaded["row"].device == torch.device("kiln:0")
    assert_same(loaded["w"], t.cpu())
    assert_same(loaded["row"], t.cpu()[1])
    assert loaded["row"].untyped_storage().data_ptr() == loaded["w"].untyped_storage().data_ptr()
    loaded["w"][1, 0] = 100.0  # still one storage: the view sees the write
    assert loaded["row"][0].item() == 100.0


@pytest.mark.parametrize("map_location,expected", [
    ("kiln", "kiln:0"), ("kiln:1", "kiln:1"), (torch.device("kiln", 1), "kiln:1"),
    ({"kiln:0": "kiln:1"}, "kiln:1"), ("cpu", "cpu"),
    (lambda storage, location: storage, "cpu"),
])
def test_map_location_forms(map_location, expected):
    t = torch.randn(5).to("kiln")
    loaded = torch.load(saved(t), map_location=map_location)
    assert loaded.device == torch.device(expected)
    assert_same(loaded, t.cpu())


def test_cpu_checkpoint_onto_kiln_with_dict_map_location():
    t = torch.randn(3)
    loaded = torch.load(saved(t), map_location={"cpu": "kiln"})
    assert loaded.device == torch.device("kiln:0")
    assert_same(loaded, t)


def test_weights_only_load_of_kiln_tensors():
    t = torch.randn(4).to("kiln:1")
    loaded = torch.load(saved({"t": t}), weights_only=True)
    assert loaded["t"].device == torch.device("kiln:1")
    assert_same(loaded["t"], t.cpu())


def test_module_save_load_and_state_dict_across_devices():
    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    kiln_model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).to("kiln")
    kiln_model.load_state_dict(cpu_model.state_dict())  # CPU checkpoint into a kiln model
    x = torch.randn(5, 3)
    assert_same(kiln_model(x.to("kiln")), cpu_model(x).detach())
    back = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    back.load_state_dict(kiln_model.state_dict())  # and the reverse
    assert_same(back(x).detach(), cpu_model(x).detach())
    whole = torch.load(saved(kiln_model), weights_only=False)
    assert next(whole.parameters()).device.type == "kiln"
    assert_same(whole(x.to("kiln")), cpu_model(x).detach())
    state = torch.load(saved(kiln_model.state_dict()), map_location="cpu", weights_only=True)
    assert all(v.device.type == "cpu" for v in state.values())
