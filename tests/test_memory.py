"""Device memory: the caching allocator's statistics (CUDA's key names),
torch.accelerator.memory_*, empty_cache, mem_get_info, out-of-memory."""

import gc

import pytest
import torch

MiB = 1024 * 1024


def test_allocated_grows_and_shrinks_with_tensors():
    torch.kiln.synchronize()
    before = torch.kiln.memory_allocated()
    x = torch.empty(MiB, dtype=torch.uint8, device="kiln")
    assert torch.kiln.memory_allocated() >= before + MiB
    assert torch.accelerator.memory_allocated() >= before + MiB
    assert torch.kiln.max_memory_allocated() >= torch.kiln.memory_allocated()
    assert torch.kiln.memory_reserved() >= torch.kiln.memory_allocated()
    assert torch.kiln.max_memory_reserved() >= torch.kiln.memory_reserved()
    del x
    assert torch.kiln.memory_allocated() == before


def test_cached_block_is_reused_and_empty_cache_releases_it():
    x = torch.empty(4 * MiB, dtype=torch.uint8, device="kiln")
    address = x.data_ptr()
    del x
    reserved = torch.kiln.memory_reserved()
    y = torch.empty(4 * MiB, dtype=torch.uint8, device="kiln")
    assert y.data_ptr() == address  # same stream, same size: reused at once
    assert torch.kiln.memory_reserved() == reserved
    del y
    torch.kiln.empty_cache()
    assert torch.kiln.memory_reserved() < reserved
    torch.accelerator.empty_cache()


def test_memory_stats_use_cuda_key_names():
    x = torch.ones(1000, device="kiln")
    stats = torch.kiln.memory_stats()
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak",
                "reserved_bytes.all.current", "active_bytes.all.current",
                "requested_bytes.all.current", "allocation.all.current",
                "segment.all.current", "allocated_bytes.small_pool.current",
                "allocated_bytes.large_pool.current", "num_alloc_retries", "num_ooms"):
        assert key in stats, key
    assert stats["allocated_bytes.all.current"] == torch.kiln.memory_allocated()
    assert stats == torch.accelerator.memory_stats()
    assert stats["requested_bytes.all.current"] >= 4000
    del x


def test_reset_peak_memory_stats():
    x = torch.empty(8 * MiB, dtype=torch.uint8, device="kiln")
    del x
    assert torch.kiln.max_memory_allocated() >= 8 * MiB
    torch.kiln.reset_peak_memory_stats()
    assert torch.kiln.max_memory_allocated() == torch.kiln.memory_allocated()
    torch.accelerator.reset_peak_memory_stats()
    torch.kiln.reset_accumulated_memory_stats()
    assert torch.kiln.memory_stats()["allocated_bytes.all.freed"] == 0


def test_mem_get_info():
    free, total = torch.kiln.mem_get_info()
    assert 0 < free <= total == 16 * 1024**3
    assert torch.accelerator.get_memory_info() == torch.kiln.mem_get_info()
    free1, total1 = torch.kiln.mem_get_info(1)
    assert total1 == total


def test_memory_summary_is_a_table_of_the_stats():
    x = torch.ones(1024, device="kiln")
    summary = torch.kiln.memory_summary()
    assert "Allocated memory" in summary and "Device reserved memory" in summary
    assert "kiln:0" in summary
    del x


def test_per_device_statistics():
    x = torch.empty(2 * MiB, dtype=torch.uint8, device="kiln:1")
    assert torch.kiln.memory_allocated(1) >= 2 * MiB
    assert torch.kiln.memory_allocated("kiln:1") == torch.kiln.memory_allocated(1)
    del x


def test_out_of_memory_names_device_and_size_and_device_recovers():
    with pytest.raises(torch.OutOfMemoryError) as info:
        torch.empty(1 << 50, dtype=torch.uint8, device="kiln")
    message = str(info.value)
    assert "kiln:0" in message
    assert str(1 << 50) in message
    assert "KILN_DEVICE_MEMORY" in message
    assert torch.kiln.memory_stats()["num_ooms"] >= 1
    y = torch.arange(10, device="kiln") * 2
    assert y.sum().item() == 90


def test_large_miss_returns_smaller_free_segments_first():
    code = (
        "import torch\n"
        "a = torch.empty(60 << 20, dtype=torch.uint8, device='kiln')\n"
        "del a  # cached, too small for the next request\n"
        "b = torch.empty(70 << 20, dtype=torch.uint8, device='kiln')\n"
        "s = torch.kiln.memory_stats()\n"
        "print(s['num_alloc_retries'], s['num_device_free'], torch.kiln.memory_reserved() >> 20)\n"
    )
    from conftest import run_python
    result = run_python(code, {"KILN_DEVICE_MEMORY": "1GiB"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "1", "70"]


def test_out_of_memory_after_filling_the_device_frees_cache_and_retries():
    code = (
        "import torch\n"
        "side = torch.kiln.Stream()\n"
        "with torch.kiln.stream(side):\n"
        "    a = torch.empty(60 << 20, dtype=torch.uint8, device='kiln')\n"
        "del a  # cached for the side stream, not released\n"
        "b = torch.empty(70 << 20, dtype=torch.uint8, device='kiln')  # needs the cache freed\n"
        "s = torch.kiln.memory_stats()\n"
        "print(s['num_alloc_retries'], s['num_ooms'])\n"
        "try:\n"
        "    torch.empty(60 << 20, dtype=torch.uint8, device='kiln')\n"
        "except torch.kiln.OutOfMemoryError as e:  # torch.OutOfMemoryError, as on CUDA\n"
        "    print('OOM', 'kiln:0' in str(e))\n"
        "print(torch.ones(3, device='kiln').sum().item())\n"
    )
    from conftest import run_python
    result = run_python(code, {"KILN_DEVICE_MEMORY": "100MiB"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "0", "OOM", "True", "3.0"]


# --- torch.kiln.set_per_process_memory_fraction ------------------------------

def capacity(device: int) -> int:
    return torch.kiln.mem_get_info(device)[1]


@pytest.fixture
def fraction_reset():
    yield
    for device in range(torch.kiln.device_count()):
        torch.kiln.set_per_process_memory_fraction(1.0, device)


@pytest.mark.parametrize("device", [0, 1])
def test_memory_fraction_limits_what_the_allocator_reserves(device, fraction_reset):
    torch.kiln.synchronize()
    torch.kiln.empty_cache()
    other = 1 - device
    assert torch.kiln.get_per_process_memory_fraction(device) == 1.0
    fraction = (16 * MiB) / capacity(device)
    torch.kiln.set_per_process_memory_fraction(fraction, f"kiln:{device}")
    assert torch.kiln.get_per_process_memory_fraction(device) == fraction
    assert torch.kiln.get_per_process_memory_fraction(other) == 1.0
    a = torch.empty(10 * MiB, dtype=torch.uint8, device=f"kiln:{device}")
    ooms = torch.kiln.memory_stats(device)["num_ooms"]
    with pytest.raises(torch.OutOfMemoryError) as info:
        torch.empty(10 * MiB, dtype=torch.uint8, device=f"kiln:{device}")
    message = str(info.value)
    reserved = torch.kiln.memory_reserved(device)
    assert f"kiln:{device}" in message and "at most 16.00 MiB" in message
    assert f"set_per_process_memory_fraction({fraction:g})" in message
    assert f"{reserved / MiB:.2f} MiB is reserved already" in message
    assert torch.kiln.memory_stats(device)["num_ooms"] == ooms + 1
    b = torch.empty(10 * MiB, dtype=torch.uint8, device=f"kiln:{other}")  # other device: no limit
    small = torch.ones(1000, device=f"kiln:{device}")  # fits beside `a`
    assert small.sum().item() == 1000.0
    del a
    c = torch.empty(10 * MiB, dtype=torch.uint8, device=f"kiln:{device}")  # `a`'s block, cached
    assert torch.kiln.memory_reserved(device) <= 16 * MiB
    del b, c


def test_memory_fraction_releases_the_cache_before_failing(fraction_reset):
    import gc
    gc.collect()
    torch.kiln.synchronize()
    torch.kiln.empty_cache()
    base = torch.kiln.memory_reserved()  # segments of live tensors
    side = torch.kiln.Stream()
    with torch.kiln.stream(side):
        cached = torch.empty(8 * MiB, dtype=torch.uint8, device="kiln")
    del cached  # cached for the side stream, useless to the default stream
    torch.kiln.set_per_process_memory_fraction((base + 12 * MiB) / capacity(0))
    retries = torch.kiln.memory_stats()["num_alloc_retries"]
    x = torch.empty(10 * MiB, dtype=torch.uint8, device="kiln")  # fits once the cache is gone
    assert torch.kiln.memory_stats()["num_alloc_retries"] == retries + 1
    # At most the live tensors' segments and x's (a leftover tensor of an
    # earlier test may be collected meanwhile and its segment released too).
    assert 10 * MiB <= torch.kiln.memory_reserved() <= base + 10 * MiB
    del x


def test_lowering_the_fraction_keeps_what_is_reserved(fraction_reset):
    torch.kiln.synchronize()
    torch.kiln.empty_cache()
    x = torch.empty(4 * MiB, dtype=torch.uint8, device="kiln:1")
    x.fill_(3)
    reserved = torch.kiln.memory_reserved(1)
    torch.kiln.set_per_process_memory_fraction(0.0, 1)
    assert torch.kiln.memory_reserved(1) == reserved >= 4 * MiB
    with pytest.raises(torch.OutOfMemoryError, match="at most 0 bytes"):
        torch.empty(MiB, dtype=torch.uint8, device="kiln:1")
    torch.kiln.set_per_process_memory_fraction(1.0, 1)
    assert x.sum().item() == 3 * 4 * MiB  # the tensor kept its memory
    del x


@pytest.mark.parametrize("device", [0, 1])
def test_memory_fraction_limits_small_tensors_too(device):
    """Small tensors (<= 256 KiB) come from 1 MiB small-pool segments; where
    one does not fit, the allocator takes a segment of just the block, and
    that fallback skipped the limit: 200 tensors of 256 KiB were reserved
    past a limit of 0 bytes (found by a fresh user). In a fresh process, so
    that no other test's cached blocks count."""
    from conftest import run_python
    code = f"""
import torch, torch_kiln
d = {device}
cap = torch.kiln.mem_get_info(d)[1]
limit = torch.kiln.memory_reserved(d) + 3 * 2**20
torch.kiln.set_per_process_memory_fraction(limit / cap, d)
kept = []
try:
    for _ in range(64):  # 16 MiB if the limit were not kept
        kept.append(torch.empty(256 * 1024, dtype=torch.uint8, device=f"kiln:{{d}}"))
    print("no OOM")
except torch.OutOfMemoryError:
    print(len(kept), torch.kiln.memory_reserved(d) <= limit)
torch.kiln.set_per_process_memory_fraction(0.0, d)
try:
    while True:
        kept.append(torch.empty(256 * 1024, dtype=torch.uint8, device=f"kiln:{{d}}"))
except torch.OutOfMemoryError as error:
    print("at most 0 bytes" in str(error), torch.kiln.memory_reserved(d) <= limit)
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["12", "True", "True", "True"], result.stdout


def test_memory_fraction_accepts_every_device_form(fraction_reset):
    for device, index in ((None, 0), (1, 1), ("kiln:1", 1), (torch.device("kiln", 0), 0), ("kiln", 0)):
        torch.kiln.set_per_process_memory_fraction(0.5, device)
        assert torch.kiln.get_per_process_memory_fraction(index) == 0.5
        assert torch.kiln.get_per_process_memory_fraction(device) == 0.5
        torch.kiln.set_per_process_memory_fraction(1.0, device)
    with torch.kiln.device(1):
        torch.kiln.set_per_process_memory_fraction(0.25)
    assert torch.kiln.get_per_process_memory_fraction(1) == 0.25


@pytest.mark.parametrize("fraction, error, match", [
    (1, TypeError, "must be a float"),         # CUDA's rule: an int is rejected
    ("0.5", TypeError, "must be a float"),
    (True, TypeError, "must be a float"),
    (None, TypeError, "must be a float"),
    (1.5, ValueError, "between 0 and 1"),
    (-0.1, ValueError, "between 0 and 1"),
    (float("nan"), ValueError, "between 0 and 1"),
    (float("inf"), ValueError, "between 0 and 1"),
])
def test_memory_fraction_rejects_bad_fractions(fraction, error, match, fraction_reset):
    with pytest.raises(error, match=match):
        torch.kiln.set_per_process_memory_fraction(fraction)
    assert torch.kiln.get_per_process_memory_fraction() == 1.0


@pytest.mark.parametrize("device, error, match", [
    (-1, ValueError, "expected a kiln device"),
    (2, RuntimeError, "Kiln has 2 devices"),
    ("cuda:0", ValueError, "Expected a kiln device"),
    (1.0, TypeError, "Expected a kiln device"),
])
def test_memory_fraction_rejects_bad_devices(device, error, match):
    with pytest.raises(error, match=match):
        torch.kiln.set_per_process_memory_fraction(0.5, device)
    with pytest.raises(error, match=match):
        torch.kiln.get_per_process_memory_fraction(device)


def test_memory_fraction_binding_rejects_bad_values():
    from torch_kiln import _C
    with pytest.raises(ValueError, match="must be between 0 and 1"):
        _C._set_memory_fraction(2.0, 0)
    with pytest.raises(RuntimeError, match="Kiln has 2 devices|device"):
        _C._set_memory_fraction(0.5, 9)


def test_a_device_smaller_than_a_segment_serves_small_tensors_and_blames_itself_when_full():
    code = (
        "import torch\n"
        "x = torch.ones(4, device='kiln')  # smaller than the 1 MiB small-pool segments\n"
        "print(x.sum().item())\n"
        "fill = torch.empty((512 << 10) - 4096, dtype=torch.uint8, device='kiln')\n"
        "kept = []\n"
        "try:\n"
        "    while True:\n"
        "        kept.append(torch.empty(4, device='kiln'))\n"
        "except torch.OutOfMemoryError as e:\n"
        "    print(len(kept) > 0, '|', e)\n"
    )
    from conftest import run_python
    result = run_python(code, {"KILN_DEVICE_MEMORY": "512KiB"})
    assert result.returncode == 0, result.stderr
    total, rest = result.stdout.split("\n", 1)
    assert total == "4.0"
    served, message = rest.split(" | ")
    assert served == "True"
    # The rounded block (512 bytes) is compared with the device's free memory.
    assert "Tried to allocate 16 bytes on kiln:0, which takes a block of 512 bytes" in message
    assert "total capacity of 512.00 KiB of which 0 bytes is free" in message
    assert "host" not in message


# --- torch.cuda.memory's other names ------------------------------------------

@pytest.mark.parametrize("device", [0, 1, "kiln:1", torch.device("kiln", 0), None])
def test_deprecated_aliases_warn_as_cuda_and_answer_the_new_names(device):
    # Peak == current right after a reset holds only if nothing is freed in
    # between. In one CI run 4608 bytes were (not reproduced; most likely a
    # kiln tensor an earlier test left in a reference cycle, freed by a
    # garbage collection). Collect first, and let no collection run during
    # the test.
    gc.collect()
    torch.kiln.synchronize()
    gc.disable()
    try:
        _check_deprecated_aliases(device)
    finally:
        gc.enable()


def _check_deprecated_aliases(device):
    x = torch.empty(3 * MiB, dtype=torch.uint8, device="kiln" if device is None else device)
    with pytest.warns(FutureWarning, match="renamed to `torch.kiln.memory_reserved`"):
        assert torch.kiln.memory_cached(device) == torch.kiln.memory_reserved(device) >= 3 * MiB
    with pytest.warns(FutureWarning, match="renamed to `torch.kiln.max_memory_reserved`"):
        assert torch.kiln.max_memory_cached(device) == torch.kiln.max_memory_reserved(device)
    del x
    for reset in (torch.kiln.reset_max_memory_allocated, torch.kiln.reset_max_memory_cached):
        y = torch.empty(5 * MiB, dtype=torch.uint8, device="kiln" if device is None else device)
        del y
        assert torch.kiln.max_memory_allocated(device) > torch.kiln.memory_allocated(device)
        with pytest.warns(FutureWarning, match="resets /all/ peak memory stats"):
            reset(device)
        assert torch.kiln.max_memory_allocated(device) == torch.kiln.memory_allocated(device)
        assert torch.kiln.max_memory_reserved(device) == torch.kiln.memory_reserved(device)


@pytest.mark.parametrize("device", [0, 1])
def test_nested_stats_hold_every_flat_key(device):
    x = torch.ones(1000, device=f"kiln:{device}")
    flat = torch.kiln.memory_stats(device)
    nested = torch.kiln.memory_stats_as_nested_dict(device)
    assert nested["allocated_bytes"]["all"]["current"] == flat["allocated_bytes.all.current"] > 0
    assert nested["num_ooms"] == flat["num_ooms"]
    count = 0
    for key, value in flat.items():
        level = nested
        for part in key.split("."):
            level = level[part]
        assert level == value, key
        count += 1
    assert count == len(flat) > 20
    del x


@pytest.mark.parametrize("call", [
    torch.kiln.memory_cached, torch.kiln.memory_stats_as_nested_dict,
    torch.kiln.reset_max_memory_allocated, torch.kiln.device_memory_used,
    torch.kiln.list_gpu_processes,
])
@pytest.mark.parametrize("device, error, match", [
    (7, RuntimeError, "Kiln has 2 devices"),
    ("cpu", ValueError, "Expected a kiln device"),
    (torch.device("cuda", 0), ValueError, "Expected a kiln device"),
])
def test_memory_queries_reject_bad_devices(call, device, error, match):
    import warnings
    with warnings.catch_warnings(), pytest.raises(error, match=match):
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated aliases warn first
        call(device)


def test_allocator_backend_is_native():
    assert torch.kiln.get_allocator_backend() == "native"


@pytest.mark.parametrize("device", [0, 1])
def test_device_memory_used_is_capacity_minus_free(device):
    torch.kiln.synchronize()
    x = torch.empty(8 * MiB, dtype=torch.uint8, device=f"kiln:{device}")
    free, total = torch.kiln.mem_get_info(device)
    used = torch.kiln.device_memory_used(device)
    assert used == total - free
    assert used >= torch.kiln.memory_reserved(device) >= 8 * MiB
    del x
    torch.kiln.empty_cache()
    assert torch.kiln.device_memory_used(device) < used


@pytest.mark.parametrize("device", [0, 1])
def test_list_gpu_processes_names_this_process_and_its_memory(device):
    import os
    x = torch.empty(4 * MiB, dtype=torch.uint8, device=f"kiln:{device}")
    lines = torch.kiln.list_gpu_processes(device).split("\n")
    assert lines[0] == f"kiln:{device}"
    words = lines[1].split()
    assert words[:2] == ["process", str(os.getpid())]
    assert words[-3:] == ["MB", "GPU", "memory"]
    assert float(words[3]) == pytest.approx(torch.kiln.device_memory_used(device) / MiB, abs=1e-3)
    del x


def test_list_gpu_processes_of_an_unused_device():
    code = "import torch\nprint(repr(torch.kiln.list_gpu_processes(1)))\n"
    from conftest import run_python
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == repr("kiln:1\nno processes are running")


# --- caching_allocator_alloc / caching_allocator_delete ------------------------

@pytest.mark.parametrize("device", [0, 1])
def test_raw_allocation_is_counted_usable_and_freed(device):
    torch.kiln.synchronize()
    before = torch.kiln.memory_allocated(device)
    ptr = torch.kiln.caching_allocator_alloc(3 * MiB, device)
    assert isinstance(ptr, int) and ptr != 0
    assert torch.kiln.memory_allocated(device) == before + 3 * MiB
    blocks = [b for s in torch.kiln.memory_snapshot() if s["device"] == device
              for b in s["blocks"] if b["address"] == ptr]
    assert [b["state"] for b in blocks] == ["active_allocated"]
    torch.kiln.caching_allocator_delete(ptr)
    assert torch.kiln.memory_allocated(device) == before
    # The freed block is reused by the next allocation of the size on the stream.
    again = torch.kiln.caching_allocator_alloc(3 * MiB, device)
    assert again == ptr
    torch.kiln.caching_allocator_delete(again)


def test_raw_allocation_on_a_side_stream_is_reused_only_there():
    side = torch.kiln.Stream()
    ptr = torch.kiln.caching_allocator_alloc(2 * MiB, stream=side)
    torch.kiln.caching_allocator_delete(ptr)
    on_default = torch.kiln.caching_allocator_alloc(2 * MiB)
    assert on_default != ptr  # another stream's cached block is not handed out
    on_side = torch.kiln.caching_allocator_alloc(2 * MiB, 0, side.kiln_stream)  # a runtime handle
    assert on_side == ptr
    for p in (on_default, on_side):
        torch.kiln.caching_allocator_delete(p)
    snapshot_streams = {s["stream"] for s in torch.kiln.memory_snapshot() if s["address"] <= ptr
                        < s["address"] + s["total_size"]}
    assert snapshot_streams == {side.stream_id}


def test_raw_allocation_on_stream_handle_zero_uses_the_devices_default_stream():
    ptr = torch.kiln.caching_allocator_alloc(4096, 1, 0)
    (segment,) = [s for s in torch.kiln.memory_snapshot()
                  if s["address"] <= ptr < s["address"] + s["total_size"]]
    assert (segment["device"], segment["stream"]) == (1, torch.kiln.default_stream(1).stream_id)
    torch.kiln.caching_allocator_delete(ptr)


def test_raw_allocation_of_zero_bytes_and_delete_of_zero():
    assert torch.kiln.caching_allocator_alloc(0) == 0
    torch.kiln.caching_allocator_delete(0)  # a no-op, as CUDA's


@pytest.mark.parametrize("kwargs, error, match", [
    ({"size": -1}, ValueError, "at least 0 bytes"),
    ({"size": 1.5}, TypeError, "size must be an int"),
    ({"size": 16, "device": 7}, RuntimeError, "Kiln has 2 devices"),
    ({"size": 16, "device": "cpu"}, ValueError, "Expected a kiln device"),
    ({"size": 16, "device": 1, "stream": "s"}, TypeError, "Invalid type for stream"),
    ({"size": 16, "stream": 12345}, ValueError, "0x3039 is not a kiln runtime stream"),
    ({"size": 16, "stream": -8}, ValueError, "is not a kiln runtime stream handle"),
    ({"size": 1 << 50}, torch.OutOfMemoryError, "kiln:0"),
])
def test_raw_allocation_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        torch.kiln.caching_allocator_alloc(**kwargs)


def test_raw_allocation_rejects_a_stream_of_another_device():
    with pytest.raises(ValueError, match="not a stream of kiln:1"):
        torch.kiln.caching_allocator_alloc(16, 1, torch.kiln.current_stream(0))
    with pytest.raises(ValueError, match="not a stream of kiln:1"):
        torch.kiln.caching_allocator_alloc(16, 1, torch.kiln.Stream(0).kiln_stream)


def test_raw_delete_rejects_unknown_and_double_frees():
    ptr = torch.kiln.caching_allocator_alloc(1024)
    torch.kiln.caching_allocator_delete(ptr)
    with pytest.raises(RuntimeError, match="is not memory from torch.kiln.caching_allocator_alloc"):
        torch.kiln.caching_allocator_delete(ptr)
    x = torch.ones(4, device="kiln")
    with pytest.raises(RuntimeError, match="is not memory from torch.kiln.caching_allocator_alloc"):
        torch.kiln.caching_allocator_delete(x.data_ptr())  # a tensor's memory is its own
    with pytest.raises(TypeError, match="mem_ptr must be an int"):
        torch.kiln.caching_allocator_delete("0x10")
    assert x.sum().item() == 4.0


# --- caching_allocator_enable / caching_allocator_disabled ---------------------

@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_with_caching_disabled_nothing_is_reused_and_frees_return_memory(device):
    torch.kiln.empty_cache()
    frees = torch.kiln.memory_stats(device)["num_device_free"]
    # (what earlier tests in this process still hold stays reserved: counted
    # from here)
    reserved_before = torch.kiln.memory_reserved(device)
    allocated_before = torch.kiln.memory_allocated(device)
    with torch.kiln.caching_allocator_disabled():
        a = torch.empty(2 * MiB, dtype=torch.uint8, device=device)
        b = torch.ones(100, device=device)  # small: a segment of its own size, not 1 MiB
        reserved = torch.kiln.memory_reserved(device)
        assert reserved - reserved_before == torch.kiln.memory_allocated(device) - allocated_before
        assert reserved - reserved_before == 2 * MiB + 512  # 400 bytes rounded to 512
        del a
        c = torch.empty(2 * MiB, dtype=torch.uint8, device=device)  # returns a's memory first
        assert torch.kiln.memory_reserved(device) == reserved
        assert torch.kiln.memory_stats(device)["num_device_free"] == frees + 1
        assert (b * 2).sum().item() == 200.0
    del b, c


def test_caching_allocator_enable_is_a_switch_and_checks_its_argument():
    from torch_kiln import _C
    torch.kiln.caching_allocator_enable(False)
    try:
        assert _C._caching_allocator_is_enabled() is False
        with torch.kiln.caching_allocator_disabled():
            assert _C._caching_allocator_is_enabled() is False
        assert _C._caching_allocator_is_enabled() is False  # restored to the previous state
    finally:
        torch.kiln.caching_allocator_enable()
    assert _C._caching_allocator_is_enabled() is True
    with pytest.raises(TypeError, match="value must be a bool"):
        torch.kiln.caching_allocator_enable(0)


def test_freed_memory_is_reused_again_after_caching_is_enabled_again():
    torch.kiln.empty_cache()
    with torch.kiln.caching_allocator_disabled():
        x = torch.empty(3 * MiB, dtype=torch.uint8, device="kiln")
    address = x.data_ptr()
    del x  # freed with caching on: cached
    y = torch.empty(3 * MiB, dtype=torch.uint8, device="kiln")
    assert y.data_ptr() == address
    del y


# --- host_memory_stats: the pinned host allocator -----------------------------

def test_host_memory_stats_follow_pinned_allocations():
    torch.accelerator.empty_host_cache()
    torch.kiln.reset_peak_host_memory_stats()
    torch.kiln.reset_accumulated_host_memory_stats()
    before = torch.kiln.host_memory_stats()
    for key in ("allocations.current", "allocated_bytes.peak", "active_requests.current",
                "active_bytes.freed", "num_host_alloc", "num_host_free", "host_alloc_time.total",
                "host_free_time.count"):
        assert key in before, key
    pinned = torch.empty(MiB, dtype=torch.uint8).pin_memory()
    during = torch.kiln.host_memory_stats()
    assert during["active_requests.current"] == before["active_requests.current"] + 1
    assert during["active_bytes.current"] >= before["active_bytes.current"] + MiB
    assert during["allocated_bytes.current"] >= MiB
    assert during["num_host_alloc"] >= 1
    nested = torch.kiln.host_memory_stats_as_nested_dict()
    assert nested["active_bytes"]["current"] == during["active_bytes.current"]
    del pinned
    after = torch.kiln.host_memory_stats()
    assert after["active_requests.current"] == before["active_requests.current"]
    assert after["active_bytes.peak"] >= MiB
    torch.kiln.reset_peak_host_memory_stats()
    assert torch.kiln.host_memory_stats()["active_bytes.peak"] == after["active_bytes.current"]
    torch.kiln.reset_accumulated_host_memory_stats()
    assert torch.kiln.host_memory_stats()["active_requests.allocated"] == 0
    torch.accelerator.empty_host_cache()
    assert torch.kiln.host_memory_stats()["allocations.current"] == 0
