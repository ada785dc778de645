"""The torch.kiln device API (mirroring torch.cuda) and torch.accelerator."""

import pytest
import torch

from conftest import run_python


def test_availability_and_count():
    assert torch.kiln.is_available()
    assert torch.kiln.device_count() == 2
    assert torch.accelerator.is_available()
    assert torch.accelerator.device_count() == 2
    assert torch.accelerator.current_accelerator() == torch.device("kiln")


def test_device_count_from_environment():
    code = "import torch; print(torch.kiln.device_count(), torch.kiln.is_available())"
    assert run_python(code, {"KILN_DEVICE_COUNT": "3"}).stdout.split() == ["3", "True"]
    assert run_python(code, {"KILN_DEVICE_COUNT": "1"}).stdout.split() == ["1", "True"]
    zero = run_python(code, {"KILN_DEVICE_COUNT": "0"})
    assert zero.returncode == 0, zero.stderr
    assert zero.stdout.split() == ["0", "False"]


def test_invalid_device_count_warns_and_reports_zero_devices():
    result = run_python("import torch; print(torch.kiln.device_count())",
                        {"KILN_DEVICE_COUNT": "two"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0"
    assert "KILN_DEVICE_COUNT" in result.stderr


def test_current_device_and_set_device():
    assert torch.kiln.current_device() == 0
    torch.kiln.set_device(1)
    try:
        assert torch.kiln.current_device() == 1
        assert torch.accelerator.current_device_index() == 1
        assert torch.empty(2, device="kiln").device == torch.device("kiln:1")
    finally:
        torch.kiln.set_device(0)
    torch.accelerator.set_device_index(1)
    assert torch.kiln.current_device() == 1
    torch.accelerator.set_device_index(0)


def test_device_context_manager_restores_previous_device():
    with torch.kiln.device(1):
        assert torch.kiln.current_device() == 1
        with torch.kiln.device("kiln:0"):
            assert torch.kiln.current_device() == 0
        assert torch.kiln.current_device() == 1
    assert torch.kiln.current_device() == 0
    with torch.kiln.device(None):
        assert torch.kiln.current_device() == 0
    x = torch.ones(1, device="kiln:1")
    with torch.kiln.device_of(x):
        assert torch.kiln.current_device() == 1
    assert torch.kiln.current_device() == 0


def test_synchronize_forms():
    x = torch.ones(1000, device="kiln") * 3
    torch.kiln.synchronize()
    torch.kiln.synchronize(0)
    torch.kiln.synchronize("kiln:1")
    torch.kiln.synchronize(torch.device("kiln", 0))
    torch.accelerator.synchronize()
    assert x.sum().item() == 3000.0


def test_device_properties_and_name():
    props = torch.kiln.get_device_properties(0)
    assert props.name == torch.kiln.get_device_name(0)
    assert "Kiln" in props.name
    assert props.total_memory == 16 * 1024**3
    assert props.multi_processor_count >= 1
    assert "total_memory=16384MB" in repr(props)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_device_capability_lists_the_dtypes_kiln_holds_and_converts():
    capability = torch.accelerator.get_device_capability()
    assert capability == torch.accelerator.get_device_capability("kiln:1")
    dtypes = capability["supported_dtypes"]
    assert {torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool,
            torch.complex64, torch.float8_e4m3fn, torch.uint32} <= dtypes
    assert not {torch.qint8, torch.quint8, torch.qint32} & dtypes  # no quantized tensors
    source = torch.arange(6.0).reshape(2, 3)
    for dtype in dtypes:  # allocated on kiln and converted to and from it, as on CPU
        on_cpu = source.to(dtype)
        on_kiln = source.to("kiln").to(dtype)
        assert on_kiln.dtype == dtype and on_kiln.device.type == "kiln"
        assert torch.equal(on_kiln.cpu().reshape(-1).view(torch.uint8),
                           on_cpu.reshape(-1).view(torch.uint8)), dtype
        assert torch.equal(on_kiln.to(torch.float64).cpu(), on_cpu.to(torch.float64)), dtype
    with pytest.raises(RuntimeError, match="Invalid device kiln:7"):
        torch.accelerator.get_device_capability("kiln:7")
    # CUDA's (major, minor) fields: kiln has no levels, the same (1, 0) everywhere.
    properties = torch.kiln.get_device_properties(1)
    assert (properties.major, properties.minor) == torch.kiln.get_device_capability(1) == (1, 0)


def test_device_memory_capacity_from_environment():
    code = "import torch; print(torch.kiln.get_device_properties(0).total_memory)"
    assert run_python(code, {"KILN_DEVICE_MEMORY": "512MiB"}).stdout.strip() == str(512 * 1024**2)
    assert run_python(code, {"KILN_DEVICE_MEMORY": "1048576"}).stdout.strip() == "1048576"
    assert run_python(code, {"KILN_DEVICE_MEMORY": "2GiB"}).stdout.strip() == str(2 * 1024**3)


@pytest.mark.parametrize("bad", [7, "kiln:7", torch.device("kiln", 7)])
def test_bad_device_index_names_the_count(bad):
    with pytest.raises(RuntimeError, match=r"kiln:7.*2 devices"):
        torch.kiln.set_device(bad)
    with pytest.raises(RuntimeError, match=r"kiln:7.*2 devices"):
        torch.kiln.get_device_properties(bad)


def test_allocation_on_missing_device_names_the_count():
    with pytest.raises(RuntimeError, match=r"kiln:7.*2 devices"):
        torch.empty(3, device="kiln:7")
    with pytest.raises(RuntimeError, match=r"kiln:7.*2 devices"):
        torch.ones(3).to("kiln:7")
    # The device is still usable afterwards.
    assert torch.ones(3, device="kiln").sum().item() == 3.0


def test_wrong_device_type_is_rejected():
    with pytest.raises(ValueError, match="Expected a kiln device, got cpu"):
        torch.kiln.set_device("cpu")


def test_tensor_and_module_methods():
    x = torch.arange(4.0)
    y = x.kiln()
    assert y.is_kiln and not x.is_kiln
    assert y.device == torch.device("kiln:0")
    assert x.kiln(1).device == torch.device("kiln:1")
    module = torch.nn.Linear(2, 3).kiln()
    assert all(p.is_kiln for p in module.parameters())
    storage = x.untyped_storage().kiln()
    assert storage.is_kiln and storage.device == torch.device("kiln:0")
    assert torch.equal(y.cpu(), x)


def test_get_device_module():
    assert torch.get_device_module("kiln") is torch.kiln
    assert torch.get_device_module(torch.device("kiln:1")) is torch.kiln


def test_a_bad_device_index_gives_one_message_in_every_api():
    assert torch.kiln.device_count() == 2  # the default count these tests run with
    expected = ("Invalid device kiln:5: Kiln has 2 devices (kiln:0 to kiln:1). Use an index in "
                "that range, or set KILN_DEVICE_COUNT to change the number of devices.")
    calls = [lambda: torch.ones(1, device="kiln:5"), lambda: torch.ones(1).to("kiln:5"),
             lambda: torch.kiln.set_device(5), lambda: torch.kiln.Stream(device=5),
             lambda: torch.kiln.get_device_properties(5), lambda: torch.kiln.synchronize(5),
             lambda: torch.kiln.memory_allocated(5)]
    for call in calls:
        with pytest.raises(RuntimeError) as error:
            call()
        assert str(error.value).splitlines()[0] == expected
