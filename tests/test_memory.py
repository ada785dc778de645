"""Device memory: the caching allocator's statistics (CUDA's key names),
torch.accelerator.memory_*, empty_cache, mem_get_info, out-of-memory."""

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
