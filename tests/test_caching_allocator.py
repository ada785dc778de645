"""The stream-ordered caching allocator: reuse on the same stream,
record_stream across streams, no leaks over many steps."""

import torch
import torch.nn as nn

from conftest import assert_same

N = 512


def side_stream_matmul(use_record_stream):
    """A side stream reads `a` (after a deliberate delay) while the default
    stream frees `a`, allocates a tensor of the same size and fills it."""
    a_cpu = torch.randn(N, N)
    a = a_cpu.to("kiln")
    side = torch.kiln.Stream()
    side.wait_stream(torch.kiln.current_stream())
    with torch.kiln.stream(side):
        torch.kiln._sleep(200)  # the read below happens well after the free
        result = a @ a
    if use_record_stream:
        a.record_stream(side)
    address = a.data_ptr()
    del a
    b = torch.empty(N, N, device="kiln")
    reused = b.data_ptr() == address
    b.fill_(1e6)
    torch.kiln.synchronize()
    return result, a_cpu @ a_cpu, reused


def test_record_stream_keeps_block_until_side_stream_is_done():
    result, expected, reused = side_stream_matmul(use_record_stream=True)
    assert not reused
    assert_same(result, expected)


def test_without_record_stream_the_block_is_reused_and_the_result_corrupted():
    result, expected, reused = side_stream_matmul(use_record_stream=False)
    assert reused  # freed on its stream: reusable at once, as on CUDA
    assert not torch.equal(result.cpu(), expected)


def test_recorded_block_returns_to_the_cache_after_the_work():
    a = torch.empty(N, N, device="kiln")
    side = torch.kiln.Stream()
    with torch.kiln.stream(side):
        torch.kiln._sleep(50)
    a.record_stream(side)
    address = a.data_ptr()
    del a
    side.synchronize()
    b = torch.empty(N, N, device="kiln")
    assert b.data_ptr() == address


def test_record_stream_rejects_other_device_streams():
    import pytest
    a = torch.empty(4, device="kiln:0")
    with pytest.raises(RuntimeError, match="own device"):
        a.record_stream(torch.kiln.Stream("kiln:1"))


def test_many_training_steps_do_not_leak():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to("kiln")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(8, 16, device="kiln")
    y = torch.randn(8, 4, device="kiln")

    def step():
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(10):  # optimizer state and caches settle
        step()
    torch.kiln.synchronize()
    torch.kiln.empty_cache()  # blocks cached by earlier tests would count as reserved
    allocated = torch.kiln.memory_allocated()
    torch.kiln.reset_peak_memory_stats()
    for _ in range(10_000):
        step()
    torch.kiln.synchronize()
    assert torch.kiln.memory_allocated() == allocated
    assert torch.kiln.max_memory_reserved() <= 1.25 * torch.kiln.max_memory_allocated() + (1 << 20)


def test_freed_block_is_split_for_smaller_requests_and_merged_back():
    torch.kiln.synchronize()
    torch.kiln.empty_cache()
    big = torch.empty(8 << 20, dtype=torch.uint8, device="kiln")
    reserved = torch.kiln.memory_reserved()
    base = big.data_ptr()
    del big
    # Two smaller requests come out of the cached 8 MiB segment, back to back.
    a = torch.empty(3 << 20, dtype=torch.uint8, device="kiln")
    b = torch.empty(4 << 20, dtype=torch.uint8, device="kiln")
    assert a.data_ptr() == base and b.data_ptr() == base + (3 << 20)
    assert torch.kiln.memory_reserved() == reserved
    assert torch.kiln.memory_stats()["inactive_split.all.current"] == 1  # the last 1 MiB
    del a, b
    # Merged again: the whole segment serves a request of its full size.
    c = torch.empty(8 << 20, dtype=torch.uint8, device="kiln")
    assert c.data_ptr() == base and torch.kiln.memory_reserved() == reserved
    assert torch.kiln.memory_stats()["inactive_split.all.current"] == 0
