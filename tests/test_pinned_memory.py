"""Pinned host memory: pin_memory(), is_pinned(), pin_memory=True,
DataLoader(pin_memory=True), and asynchronous non_blocking copies."""

import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import assert_same


def test_pinned_round_trip_with_non_blocking_copies():
    c = torch.randn(1 << 16)
    p = c.pin_memory()
    assert p.is_pinned() and not c.is_pinned()
    d = p.to("kiln", non_blocking=True)
    back = torch.empty_like(c).pin_memory()
    back.copy_(d, non_blocking=True)
    torch.accelerator.synchronize()
    assert_same(d, c)
    assert_same(back, c)


def test_non_blocking_copy_to_pinned_memory_does_not_wait():
    d = torch.ones(1 << 16, device="kiln")
    back = torch.empty(1 << 16).pin_memory()
    torch.kiln._sleep(200)
    back.copy_(d, non_blocking=True)
    assert not torch.kiln.current_stream().query()  # the copy is still queued
    torch.kiln.synchronize()
    assert back.sum().item() == float(1 << 16)


def test_blocking_copy_to_host_waits_for_the_stream():
    d = torch.ones(1 << 16, device="kiln")
    torch.kiln._sleep(100)
    host = d.cpu()
    assert torch.kiln.current_stream().query()
    assert host.sum().item() == float(1 << 16)


def test_empty_with_pin_memory():
    t = torch.empty(100, pin_memory=True)
    assert t.is_pinned()
    z = torch.zeros(10, pin_memory=True)
    assert z.is_pinned() and z.sum().item() == 0


def test_dataloader_pin_memory_yields_pinned_batches():
    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4, pin_memory=True)
    batches = list(loader)
    assert len(batches) == 2
    for (batch,) in batches:
        assert batch.is_pinned()
        assert batch.to("kiln", non_blocking=True).device.type == "kiln"
    torch.kiln.synchronize()
