"""KILN_VISIBLE_DEVICES: which of the KILN_DEVICE_COUNT devices a process
sees, with CUDA_VISIBLE_DEVICES's rules (Note [KILN_VISIBLE_DEVICES] in
runtime/src/env.cc). The runtime reads it once per process, so every case
runs in a fresh interpreter."""

import json

import pytest

from conftest import run_python

DEVICES = """
import json, torch
n = torch.kiln.device_count()
print(json.dumps([torch.kiln.get_device_properties(i).pci_bus_id for i in range(n)]))
"""


def cuda_model(value, count, monkeypatch):
    """What PyTorch's own model of CUDA_VISIBLE_DEVICES gives for the same
    value (torch/cuda/__init__.py: _parse_visible_devices, then
    _device_count_nvml's cut at the first device the machine does not have;
    a UUID names no kiln device)."""
    import torch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    visible = []
    for index in torch.cuda._parse_visible_devices():
        if not isinstance(index, int) or index >= count:
            break
        visible.append(index)
    return visible


def visible_devices(value, count="2"):
    env = {"KILN_DEVICE_COUNT": count, "KILN_VISIBLE_DEVICES": value}
    r = run_python(DEVICES, env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


# The runtime's own tests (runtime/tests/test_env.cc) cover more values.
@pytest.mark.parametrize("value, count, expected", [
    ("1,0", "2", [1, 0]),
    ("", "2", []),              # set but empty: no device, as CUDA_VISIBLE_DEVICES=
    ("-1", "2", []),            # the usual way to hide every GPU
    ("0,-1,1", "3", [0]),       # the list ends at a negative entry
    ("0,5,1", "2", [0]),        # ... and at an index the machine does not have
    ("1,1", "2", []),           # a repeated index: no device
    ("1gpu,2", "3", [1, 2]),    # read like strtoul
])
def test_selects_and_renumbers_as_cuda_visible_devices(value, count, expected, monkeypatch):
    assert visible_devices(value, count) == expected
    assert cuda_model(value, int(count), monkeypatch) == expected


def test_unset_shows_every_device():
    r = run_python(DEVICES, {"KILN_DEVICE_COUNT": "3", "KILN_VISIBLE_DEVICES": None})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == [0, 1, 2]


def test_renumbered_devices_work_and_errors_name_the_variable():
    code = """
import torch
assert torch.kiln.device_count() == 2 and torch.accelerator.device_count() == 2
assert [torch.kiln.get_device_properties(i).pci_bus_id for i in (0, 1)] == [2, 0]
cpu = torch.arange(6.0).reshape(2, 3)
for index in (0, 1):
    with torch.kiln.device(index):
        x = cpu.to("kiln")
        assert x.device == torch.device("kiln", index)
        side = torch.kiln.Stream()
        with torch.kiln.stream(side):
            y = (x * 2).to("kiln:" + str(1 - index), non_blocking=True)
        side.synchronize()
    assert torch.equal(y.cpu(), cpu * 2)
try:
    torch.ones(1, device="kiln:2")
except RuntimeError as e:
    message = str(e)
else:
    raise AssertionError("kiln:2 should not exist")
assert "Invalid device kiln:2: Kiln has 2 devices (kiln:0 to kiln:1)" in message, message
assert "KILN_VISIBLE_DEVICES" in message, message
print("OK")
"""
    r = run_python(code, {"KILN_DEVICE_COUNT": "3", "KILN_VISIBLE_DEVICES": "2,0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "OK"


def test_no_visible_device_says_why():
    code = """
import torch
assert not torch.kiln.is_available() and torch.kiln.device_count() == 0
try:
    torch.ones(1, device="kiln")
except RuntimeError as e:
    print(e)
"""
    r = run_python(code, {"KILN_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    assert ("No kiln devices: KILN_VISIBLE_DEVICES='' makes none of the KILN_DEVICE_COUNT "
            "devices visible") in r.stdout


FORK_RNG = """
import warnings, torch
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    before = torch.randn(3, device="kiln")
    state = torch.kiln.get_rng_state()
    with torch.random.fork_rng(device_type="kiln"):
        torch.randn(5, device="kiln")
    assert torch.equal(torch.kiln.get_rng_state(), state)
print([str(w.message) for w in caught if "fork_rng" in str(w.message)])
"""


def test_fork_rng_warning_names_a_variable_that_exists_and_its_advice_works():
    # Two devices: PyTorch's warning tells the user to set KILN_VISIBLE_DEVICES...
    r = run_python(FORK_RNG, {"KILN_VISIBLE_DEVICES": None})
    assert r.returncode == 0, r.stderr
    messages = eval(r.stdout.splitlines()[-1])
    assert len(messages) == 1 and "KILN_VISIBLE_DEVICES=0" in messages[0], messages
    # ... and doing so leaves one device, so fork_rng has nothing to warn about.
    r = run_python(FORK_RNG, {"KILN_VISIBLE_DEVICES": "0"})
    assert r.returncode == 0, r.stderr
    assert eval(r.stdout.splitlines()[-1]) == []
