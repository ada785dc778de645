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


def test_device_properties_answer_cudas_other_fields():
    """Code reading CUDA's fields got AttributeError (found by a fresh user);
    they describe the host cores the kernels run on."""
    import uuid

    zero, one = torch.kiln.get_device_properties(0), torch.kiln.get_device_properties(1)
    assert isinstance(zero.uuid, uuid.UUID) and zero.uuid != one.uuid
    assert zero.uuid == torch.kiln.get_device_properties("kiln:0").uuid  # fixed per device
    assert zero.L2_cache_size >= 0 and zero.L2_cache_size % 1024 == 0
    assert (zero.warp_size, zero.max_threads_per_multi_processor) == (1, 1)
    assert (zero.is_integrated, zero.is_multi_gpu_board) == (0, 0)
    assert (one.pci_bus_id, one.pci_device_id, one.pci_domain_id) == (1, 0, 0)


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


@pytest.mark.parametrize("bad", [-1, -100])
def test_a_negative_index_is_rejected_by_the_queries_of_one_device(bad):
    """get_device_capability(-1) answered (1, 0) and get_rng_state(-1) the
    current device's state, where get_device_properties(-1) raised (and
    torch.cuda's raise for all of them); found by a fresh user."""
    for query in (torch.kiln.get_device_properties, torch.kiln.get_device_name,
                  torch.kiln.get_device_capability):
        with pytest.raises(RuntimeError, match=f"^Invalid device kiln:{bad}: Kiln has 2 devices"):
            query(bad)
    with pytest.raises(ValueError, match=f"get_rng_state: expected a kiln device .* got {bad}"):
        torch.kiln.get_rng_state(bad)
    with pytest.raises(ValueError, match=f"set_rng_state: expected a kiln device .* got {bad}"):
        torch.kiln.set_rng_state(torch.kiln.get_rng_state(), bad)


# --- torch.cuda's hardware queries, answered for the reference device ---------

def test_peer_access_between_different_devices_only_as_cuda_answers():
    assert torch.kiln.can_device_access_peer(0, 1) is True
    assert torch.kiln.can_device_access_peer("kiln:1", torch.device("kiln", 0)) is True
    assert torch.kiln.can_device_access_peer(0, 0) is False
    assert torch.kiln.can_device_access_peer(None, 1) is (torch.kiln.current_device() != 1)
    # What it promises: a direct copy between the two devices gives the data.
    x = torch.arange(8.0, device="kiln:0")
    assert x.to("kiln:1").cpu().tolist() == list(range(8))


@pytest.mark.parametrize("device, peer, error, match", [
    (0, 7, RuntimeError, "Kiln has 2 devices"),
    (7, 0, RuntimeError, "Kiln has 2 devices"),
    (0, None, ValueError, "Expected a kiln device, got None"),
    ("cpu", 1, ValueError, "Expected a kiln device"),
    (0, torch.device("cuda", 1), ValueError, "Expected a kiln device"),
    (-1, 0, ValueError, "device must be a kiln device index >= 0"),
    (0, 1.0, TypeError, "Expected a kiln device"),
])
def test_peer_access_rejects_bad_devices(device, peer, error, match):
    with pytest.raises(error, match=match):
        torch.kiln.can_device_access_peer(device, peer)


def test_tf32_arch_list_and_half_are_answered_for_a_cpu_kernel_device():
    assert torch.kiln.is_tf32_supported() is False
    assert torch.kiln.get_arch_list() == []
    assert torch.kiln.get_gencode_flags() == ""
    assert torch.kiln.has_half is True
    x = torch.ones(4, dtype=torch.half, device="kiln")
    assert (x + x).dtype == torch.half and (x + x).sum().item() == 8.0


@pytest.mark.parametrize("query", ["utilization", "memory_usage", "temperature", "power_draw",
                                   "clock_rate"])
@pytest.mark.parametrize("device", [None, 0, 1, "kiln:1"])
def test_sensor_queries_raise_naming_the_query(query, device):
    with pytest.raises(NotImplementedError, match=f"torch.kiln.{query}: the kiln reference device "
                                                  "does not measure"):
        getattr(torch.kiln, query)(device)


@pytest.mark.parametrize("query", ["utilization", "temperature", "clock_rate"])
def test_sensor_queries_name_the_device_count_for_a_bad_device_first(query):
    with pytest.raises(RuntimeError, match="Kiln has 2 devices"):
        getattr(torch.kiln, query)(7)
    with pytest.raises(ValueError, match="Expected a kiln device"):
        getattr(torch.kiln, query)("cpu")


def test_check_error_raises_a_kiln_error_with_the_runtimes_words():
    torch.kiln.check_error(0)  # kilnSuccess
    with pytest.raises(torch.kiln.KilnError, match=r"^kilnErrorMemoryAllocation: .* \(2\)$") as info:
        torch.kiln.check_error(2)
    assert info.value.code == 2 and isinstance(info.value, RuntimeError)
    with pytest.raises(torch.kiln.KilnError, match=r"\(12345\)$"):
        torch.kiln.check_error(12345)  # an unknown code still names itself
    with pytest.raises(TypeError, match="res must be an int"):
        torch.kiln.check_error("0")


def test_check_error_reads_a_status_from_the_runtime_itself():
    from conftest import kiln_runtime
    lib = kiln_runtime()  # the C API, as a library calling it through ctypes sees it
    assert lib.kilnSetDevice(0) == 0
    torch.kiln.check_error(lib.kilnSetDevice(0))
    status = lib.kilnSetDevice(99)
    with pytest.raises(torch.kiln.KilnError, match="kilnErrorInvalidDevice"):
        torch.kiln.check_error(status)
    assert torch.kiln.current_device() == 0
