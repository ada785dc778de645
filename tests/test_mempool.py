"""torch.kiln.MemPool and use_mem_pool: allocations inside `use_mem_pool`
come from the pool, its blocks are reused only inside it (per stream), its
snapshot and use count follow CUDA's; options and bad input."""

import threading

import pytest
import torch

from conftest import assert_same, run_python

MiB = 1024 * 1024


def pool_addresses(pool):
    return {b["address"] for s in pool.snapshot() for b in s["blocks"]}


def allocated_in(pool, tensor):
    start = tensor.untyped_storage().data_ptr()
    return any(s["address"] <= start < s["address"] + s["total_size"] for s in pool.snapshot())


@pytest.mark.parametrize("device", [0, 1])
def test_allocations_inside_use_mem_pool_come_from_the_pool(device):
    with torch.kiln.device(device):
        pool = torch.kiln.MemPool()
        assert pool.device == device and pool.id[0] == 0 and pool.id[1] > 0
        outside = torch.randn(1000, device="kiln")
        with torch.kiln.use_mem_pool(pool):
            inside = torch.randn(1000, device="kiln")
            big = torch.empty(3 * MiB, dtype=torch.uint8, device="kiln")
        after = torch.randn(1000, device="kiln")
    assert allocated_in(pool, inside) and allocated_in(pool, big)
    assert not allocated_in(pool, outside) and not allocated_in(pool, after)
    segments = pool.snapshot()
    assert {s["segment_pool_id"] for s in segments} == {pool.id}
    assert {s["device"] for s in segments} == {device}
    assert segments == [s for s in torch.kiln.memory_snapshot() if s["segment_pool_id"] == pool.id]
    assert segments == torch.kiln.memory_snapshot(pool.id)
    # The pool's memory is ordinary device memory: results are CPU's.
    cpu = torch.arange(6.0).reshape(2, 3)
    with torch.kiln.use_mem_pool(pool, device):
        y = cpu.to(f"kiln:{device}") @ cpu.t().to(f"kiln:{device}")
    assert allocated_in(pool, y)
    assert_same(y, cpu @ cpu.t())


def test_freed_pool_blocks_are_reused_inside_the_pool_only():
    pool = torch.kiln.MemPool()
    with torch.kiln.use_mem_pool(pool):
        x = torch.empty(2 * MiB, dtype=torch.uint8, device="kiln")
    address = x.data_ptr()
    del x  # back to the pool, not to ordinary allocations
    ordinary = torch.empty(2 * MiB, dtype=torch.uint8, device="kiln")
    assert ordinary.data_ptr() != address
    with torch.kiln.use_mem_pool(pool):
        again = torch.empty(2 * MiB, dtype=torch.uint8, device="kiln")
    assert again.data_ptr() == address
    torch.kiln.empty_cache()  # the pool is alive: its free blocks stay
    del again
    torch.kiln.empty_cache()
    assert address in pool_addresses(pool)


def test_pool_blocks_keep_stream_ordered_reuse():
    pool = torch.kiln.MemPool()
    side = torch.kiln.Stream()
    with torch.kiln.use_mem_pool(pool):
        with torch.kiln.stream(side):
            a = torch.empty(2 * MiB, dtype=torch.uint8, device="kiln")
        address = a.data_ptr()
        del a
        on_default = torch.empty(2 * MiB, dtype=torch.uint8, device="kiln")
        assert on_default.data_ptr() != address  # another stream's block is not taken
        with torch.kiln.stream(side):
            on_side = torch.empty(2 * MiB, dtype=torch.uint8, device="kiln")
    assert on_side.data_ptr() == address
    streams = {s["stream"] for s in pool.snapshot()}
    assert streams == {0, side.stream_id}


def test_use_count_is_cudas():
    pool = torch.kiln.MemPool()
    assert pool.use_count() == 1
    with torch.kiln.use_mem_pool(pool):
        assert pool.use_count() == 2
        with torch.kiln.use_mem_pool(pool):
            assert pool.use_count() == 3
        assert pool.use_count() == 2
    assert pool.use_count() == 1


def test_nested_pools_route_to_the_innermost():
    outer, inner = torch.kiln.MemPool(), torch.kiln.MemPool()
    with torch.kiln.use_mem_pool(outer):
        a = torch.empty(MiB, dtype=torch.uint8, device="kiln")
        with torch.kiln.use_mem_pool(inner):
            b = torch.empty(MiB, dtype=torch.uint8, device="kiln")
        c = torch.empty(MiB, dtype=torch.uint8, device="kiln")
    assert allocated_in(outer, a) and allocated_in(inner, b) and allocated_in(outer, c)
    assert not allocated_in(outer, b)


def test_only_the_calling_thread_allocates_from_the_pool():
    pool = torch.kiln.MemPool()
    result = {}

    def other_thread():
        result["t"] = torch.empty(MiB, dtype=torch.uint8, device="kiln")

    with torch.kiln.use_mem_pool(pool):
        mine = torch.empty(MiB, dtype=torch.uint8, device="kiln")
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert allocated_in(pool, mine) and not allocated_in(pool, result["t"])


def test_use_mem_pool_routes_only_the_devices_it_names():
    pool = torch.kiln.MemPool()  # made on kiln:0
    with torch.kiln.use_mem_pool(pool):
        on_1 = torch.empty(MiB, dtype=torch.uint8, device="kiln:1")
    assert not allocated_in(pool, on_1)
    with torch.kiln.use_mem_pool(pool, device="kiln:1"):  # as CUDA: that device, same id
        routed = torch.empty(MiB, dtype=torch.uint8, device="kiln:1")
    assert allocated_in(pool, routed)
    assert {s["device"] for s in pool.snapshot()} == {1}


def test_destroying_the_pool_returns_its_free_memory_and_live_tensors_survive():
    torch.kiln.synchronize()
    torch.kiln.empty_cache()
    reserved = torch.kiln.memory_reserved()
    pool = torch.kiln.MemPool()
    with torch.kiln.use_mem_pool(pool):
        freed = torch.empty(4 * MiB, dtype=torch.uint8, device="kiln")
        kept = torch.full((1000,), 3.0, device="kiln")
    del freed
    assert torch.kiln.memory_reserved() >= reserved + 4 * MiB
    pool_id = pool.id
    del pool  # its free segments go back; `kept` is still a valid tensor
    assert torch.kiln.memory_reserved() < reserved + 4 * MiB
    assert kept.sum().item() == 3000.0
    assert [s["segment_pool_id"] for s in torch.kiln.memory_snapshot(pool_id)] != []
    del kept
    torch.kiln.empty_cache()
    assert torch.kiln.memory_snapshot(pool_id) == []


def test_a_graph_captures_into_a_mem_pool():
    pool = torch.kiln.MemPool()
    static = torch.ones(256, device="kiln")
    (static * 2).sum()  # warm-up
    torch.kiln.synchronize()
    g = torch.kiln.KilnGraph()
    with torch.kiln.graph(g, pool=pool.id):
        out = static * 2
    assert g.pool() == pool.id
    assert pool.use_count() == 2  # the pool and the graph
    assert allocated_in(pool, out)
    static.fill_(5.0)
    g.replay()
    assert out.sum().item() == 2560.0
    g.reset()
    assert pool.use_count() == 1


def test_no_split_pool_gives_each_allocation_a_whole_block():
    split_pool, whole_pool = torch.kiln.MemPool(), torch.kiln.MemPool(no_split=True)
    for pool in (split_pool, whole_pool):
        with torch.kiln.use_mem_pool(pool):
            x = torch.empty(2000, dtype=torch.uint8, device="kiln")
            y = torch.empty(2000, dtype=torch.uint8, device="kiln")
        del x, y
    # A split pool carves small tensors out of a 1 MiB segment; no_split
    # makes a segment of the rounded request each.
    assert [s["total_size"] for s in split_pool.snapshot()] == [MiB]
    assert sorted(s["total_size"] for s in whole_pool.snapshot()) == [2048, 2048]


def test_use_on_oom_pool_lends_its_free_memory_to_ordinary_allocations():
    code = (
        "import torch\n"
        "pool = torch.kiln.MemPool(use_on_oom=True)\n"
        "with torch.kiln.use_mem_pool(pool):\n"
        "    a = torch.empty(60 << 20, dtype=torch.uint8, device='kiln')\n"
        "address = a.data_ptr()\n"
        "del a  # free in the pool, which keeps it reserved\n"
        "b = torch.empty(60 << 20, dtype=torch.uint8, device='kiln')  # no room but the pool's\n"
        "print(b.data_ptr() == address, torch.kiln.memory_stats()['num_ooms'])\n"
        "plain = torch.kiln.MemPool()\n"
        "with torch.kiln.use_mem_pool(plain):\n"
        "    c = torch.empty(30 << 20, dtype=torch.uint8, device='kiln')\n"
        "del c\n"
        "try:\n"
        "    torch.empty(60 << 20, dtype=torch.uint8, device='kiln')\n"
        "except torch.OutOfMemoryError:\n"
        "    print('OOM')\n"
    )
    result = run_python(code, {"KILN_DEVICE_MEMORY": "100MiB"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "0", "OOM"]


def test_caching_disabled_does_not_apply_inside_a_pool():
    pool = torch.kiln.MemPool()
    with torch.kiln.caching_allocator_disabled(), torch.kiln.use_mem_pool(pool):
        x = torch.empty(MiB, dtype=torch.uint8, device="kiln")
        address = x.data_ptr()
        del x
        y = torch.empty(MiB, dtype=torch.uint8, device="kiln")
    assert y.data_ptr() == address


@pytest.mark.parametrize("kwargs, error, match", [
    ({"allocator": object()}, NotImplementedError, "custom allocators"),
    ({"use_on_oom": 1}, TypeError, "use_on_oom must be a bool"),
    ({"no_split": "yes"}, TypeError, "no_split must be a bool"),
])
def test_mem_pool_rejects_what_kiln_cannot_do(kwargs, error, match):
    with pytest.raises(error, match=match):
        torch.kiln.MemPool(**kwargs)


@pytest.mark.parametrize("pool, device, error, match", [
    ((0, 1), None, TypeError, "pool must be a torch.kiln.MemPool"),
    ("pool", None, TypeError, "pool must be a torch.kiln.MemPool"),
    (None, 7, RuntimeError, "Kiln has 2 devices"),
    (None, "cpu", ValueError, "Expected a kiln device"),
    (None, -1, ValueError, "expected a kiln device"),
])
def test_use_mem_pool_rejects_bad_arguments(pool, device, error, match):
    real = torch.kiln.MemPool()
    with pytest.raises(error, match=match):
        with torch.kiln.use_mem_pool(real if pool is None else pool, device):
            pass
    assert real.use_count() == 1
    x = torch.empty(MiB, dtype=torch.uint8, device="kiln")
    assert not allocated_in(real, x)  # nothing stayed routed


@pytest.mark.parametrize("mempool_id, error, match", [
    ((0, 10**9), ValueError, "not a memory pool kiln made"),
    ((10**9, 0), ValueError, "not a memory pool kiln made"),
    ((1, 1), ValueError, "not a memory pool kiln made"),
    ((0,), TypeError, "mempool_id must be None or a pool id"),
    ("pool", TypeError, "mempool_id must be None or a pool id"),
])
def test_memory_snapshot_rejects_made_up_pool_ids(mempool_id, error, match):
    with pytest.raises(error, match=match):
        torch.kiln.memory_snapshot(mempool_id)


def test_mem_pool_is_exported_as_in_torch_cuda():
    from torch.kiln import MemPool, use_mem_pool  # noqa: F401
    assert torch.kiln.MemPool is MemPool
    assert torch.kiln.MemPool().allocator is None


def test_mempool_names_import_from_torch_kiln_memory_as_from_torch_cuda_memory():
    from torch.kiln.memory import MemPool, is_initialized, use_mem_pool

    assert MemPool is torch.kiln.MemPool and use_mem_pool is torch.kiln.use_mem_pool
    torch.zeros(1, device="kiln")
    assert is_initialized() is torch.kiln.is_initialized() is True
    pool = MemPool()
    with use_mem_pool(pool):
        x = torch.empty(4096, device="kiln")
    assert pool.snapshot(), "the allocation inside use_mem_pool came from the pool"
    del x
