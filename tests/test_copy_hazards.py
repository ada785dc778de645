"""Host buffers reused right after a copy, behind a busy stream.

Each test keeps the device stream busy (torch.kiln._sleep) so a copy that
returned early would still be queued, then overwrites, frees or reallocates
the host buffer at once and compares a checksum of every batch with what was
sent. Covers pinned and pageable memory, blocking and non_blocking copies in
both directions, kiln:0 and kiln:1, default and side streams, DataLoader
workers and copies issued from other threads (issue 10, item 1: blocking
pinned->kiln copies used to return before the copy ran, so the next
pin_memory() batch overwrote the block first). See Note [Kiln copies] in
torch_kiln/csrc/aten/Copy.cc.
"""

import contextlib
import threading

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import assert_same

BATCHES = 16
ROW = 4096


def batches():
    # Every batch differs in every element, so any mix-up changes the checksum.
    return torch.arange(BATCHES * ROW, dtype=torch.float32).reshape(BATCHES, ROW) * 0.5 + 1


def on_stream(device, side):
    if not side:
        return contextlib.nullcontext()
    return torch.kiln.stream(torch.kiln.Stream(device))


PLACES = [("kiln:0", False), ("kiln:0", True), ("kiln:1", False), ("kiln:1", True)]
PLACE_IDS = ["kiln0-default", "kiln0-side", "kiln1-default", "kiln1-side"]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("non_blocking", [False, True])
def test_dataloader_pin_memory_loop_delivers_every_batch(num_workers, non_blocking):
    # The everyday CUDA loop; the device results are only read at the end.
    data = batches()
    loader = DataLoader(TensorDataset(data), batch_size=1, pin_memory=True,
                        num_workers=num_workers)
    sums = []
    for (batch,) in loader:
        assert batch.is_pinned()
        torch.kiln._sleep(2)  # the device lags behind the loader
        sums.append(batch.to("kiln", non_blocking=non_blocking).sum())
    got = torch.stack(sums).cpu()
    assert_same(got, data.sum(dim=1))


@pytest.mark.parametrize("device,side", PLACES, ids=PLACE_IDS)
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_blocking_host_to_kiln_copy_lets_the_caller_overwrite_the_source(device, side, pinned):
    data = batches()
    host = torch.empty(ROW, pin_memory=pinned)
    results = []
    with on_stream(device, side):
        for row in data:
            host.copy_(row)
            torch.kiln._sleep(2)
            results.append(host.to(device))
            host.fill_(-1)  # immediate reuse, as a loader's next batch would
    assert_same(torch.stack(results), data)


@pytest.mark.parametrize("device,side", PLACES, ids=PLACE_IDS)
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_blocking_copy_into_existing_kiln_tensor(device, side, pinned):
    data = batches()
    host = torch.empty(ROW, pin_memory=pinned)
    dst = torch.empty(BATCHES, ROW, device=device)
    with on_stream(device, side):
        for i, row in enumerate(data):
            host.copy_(row)
            torch.kiln._sleep(2)
            dst[i].copy_(host)
            host.fill_(-1)
    assert_same(dst, data)


@pytest.mark.parametrize("device,side", PLACES, ids=PLACE_IDS)
def test_non_blocking_pinned_source_freed_at_once_is_not_reused_early(device, side):
    # The caller drops its pinned batch right after an async copy; the next
    # pin_memory() must not be handed that block while the copy is queued.
    data = batches()
    results = []
    with on_stream(device, side):
        for row in data:
            torch.kiln._sleep(2)
            results.append(row.pin_memory().to(device, non_blocking=True))
            torch.full((ROW,), -1.0).pin_memory()  # would land in the same block
    torch.kiln.synchronize(device)  # the side stream's copies, on that device
    assert_same(torch.stack(results), data)


@pytest.mark.parametrize("device,side", PLACES, ids=PLACE_IDS)
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_non_blocking_pageable_or_pinned_source_kept_until_copied(device, side, pinned):
    # non_blocking from pageable memory is staged at the call; from pinned
    # memory the caller keeps the buffer (CUDA's contract): each batch gets
    # its own buffer here, held until the end.
    data = batches()
    held, results = [], []
    with on_stream(device, side):
        for row in data:
            host = row.clone().pin_memory() if pinned else row.clone()
            torch.kiln._sleep(2)
            results.append(host.to(device, non_blocking=True))
            held.append(host)
            if not pinned:
                host.fill_(-1)  # staged: the caller may overwrite it at once
    torch.kiln.synchronize(device)  # the side stream's copies, on that device
    assert_same(torch.stack(results), data)


@pytest.mark.parametrize("device,side", PLACES, ids=PLACE_IDS)
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_blocking_kiln_to_host_copy_is_complete_on_return(device, side, pinned):
    data = batches()
    on_device = data.to(device)
    back = torch.empty(ROW, pin_memory=pinned)
    with on_stream(device, side):
        for i in range(BATCHES):
            torch.kiln._sleep(2)
            back.copy_(on_device[i] * 1)
            assert_same(back, data[i])  # read at once, no synchronize


@pytest.mark.parametrize("device,side", PLACES, ids=PLACE_IDS)
def test_non_blocking_copy_into_freed_pinned_block_does_not_hit_its_next_owner(device, side):
    # An async kiln->pinned copy whose destination is dropped at once: the
    # block must not be given to the next pin_memory() before the copy wrote.
    on_device = torch.full((ROW,), 7.0, device=device)
    with on_stream(device, side):
        for _ in range(BATCHES):
            torch.kiln._sleep(2)
            torch.empty(ROW, pin_memory=True).copy_(on_device, non_blocking=True)
            nxt = torch.full((ROW,), -1.0).pin_memory()
            torch.kiln.synchronize(device)
            assert_same(nxt, torch.full((ROW,), -1.0))


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_blocking_copy_on_a_side_stream_is_visible_on_the_default_stream(device):
    # CUDA's blocking copies synchronize, so using the result on another
    # stream without wait_stream is correct; it must be on kiln too.
    data = batches()
    side = torch.kiln.Stream(device)
    host = torch.empty(ROW, pin_memory=True)
    results, kept = [], []
    for row in data:
        host.copy_(row)
        with torch.kiln.stream(side):
            torch.kiln._sleep(2)
            d = host.to(device)
        host.fill_(-1)
        with torch.kiln.device(device):
            results.append(d * 1)  # default stream, no wait_stream
        # Kept alive: freed without record_stream, d's block would go back to
        # the side stream's pool while the default stream may still read it
        # (the same race as on CUDA).
        kept.append(d)
    assert_same(torch.stack(results), data)


def test_pinned_to_kiln1_while_kiln0_is_busy_and_peer_copy_back():
    data = batches()
    host = torch.empty(ROW, pin_memory=True)
    on0 = []
    for row in data:
        host.copy_(row)
        with torch.kiln.device(0):
            torch.kiln._sleep(1)
        with torch.kiln.device(1):
            torch.kiln._sleep(1)
        d1 = host.to("kiln:1")
        host.fill_(-1)
        on0.append(d1.to("kiln:0"))
    assert_same(torch.stack(on0), data)


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_copies_issued_from_other_threads(pinned):
    data = batches()
    results = [None] * 4
    errors = []

    def worker(k):
        try:
            host = torch.empty(ROW, pin_memory=pinned)
            out = []
            for row in data[k::4]:
                host.copy_(row)
                torch.kiln._sleep(1)
                out.append(host.to(f"kiln:{k % 2}"))
                host.fill_(-1)
            results[k] = torch.stack(out).cpu()
        except Exception as e:  # reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for k in range(4):
        assert_same(results[k], data[k::4])
