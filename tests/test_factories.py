"""Tensor creation on kiln, views (metadata only, sharing storage), resize_
and set_, compared with CPU."""

import pytest
import torch

from conftest import assert_same


def test_factories_match_cpu():
    assert_same(torch.zeros(3, 4, device="kiln"), torch.zeros(3, 4))
    assert_same(torch.ones(2, 5, dtype=torch.int64, device="kiln"), torch.ones(2, 5, dtype=torch.int64))
    assert_same(torch.full((3,), 2.5, device="kiln"), torch.full((3,), 2.5))
    assert_same(torch.full((2, 2), 7, device="kiln"), torch.full((2, 2), 7))
    assert_same(torch.arange(10, device="kiln"), torch.arange(10))
    assert_same(torch.arange(1.0, 4.0, 0.25, device="kiln"), torch.arange(1.0, 4.0, 0.25))
    assert_same(torch.arange(5, 0, -2, device="kiln"), torch.arange(5, 0, -2))
    assert_same(torch.tensor([[1, 2], [3, 4]], device="kiln"), torch.tensor([[1, 2], [3, 4]]))
    assert_same(torch.tensor(3.5, device="kiln"), torch.tensor(3.5))
    assert_same(torch.tensor([True, False], device="kiln"), torch.tensor([True, False]))
    assert_same(torch.linspace(0, 1, 7, device="kiln"), torch.linspace(0, 1, 7))
    assert_same(torch.eye(3, device="kiln"), torch.eye(3))
    assert_same(torch.zeros_like(torch.ones(2, 3, device="kiln")), torch.zeros(2, 3))
    assert_same(torch.full_like(torch.ones(2, device="kiln"), 9), torch.full((2,), 9.0))


def test_empty_and_empty_strided():
    e = torch.empty(2, 3, device="kiln")
    assert e.shape == (2, 3) and e.device.type == "kiln" and e.dtype == torch.float32
    s = torch.empty_strided((2, 3), (1, 2), device="kiln")
    assert s.stride() == (1, 2)
    cl = torch.empty(2, 3, 4, 5, device="kiln", memory_format=torch.channels_last)
    assert cl.stride() == torch.empty(2, 3, 4, 5, memory_format=torch.channels_last).stride()
    with pytest.raises(RuntimeError, match="pinned"):
        torch.empty(3, device="kiln", pin_memory=True)


def test_views_share_storage_and_launch_nothing():
    base_cpu = torch.arange(24.0).reshape(2, 3, 4)
    base = base_cpu.kiln()
    torch.kiln.synchronize()
    torch.kiln.clear_op_tracking()
    views = {
        "view": lambda t: t.view(6, 4),
        "as_strided": lambda t: t.as_strided((3, 2), (4, 1), 2),
        "reshape": lambda t: t.reshape(4, 6),
        "transpose": lambda t: t.transpose(0, 2),
        "permute": lambda t: t.permute(2, 0, 1),
        "slice": lambda t: t[:, 1:, ::2],
        "select": lambda t: t[1, 2],
        "expand": lambda t: t[:, :1, :].expand(2, 5, 4),
        "unsqueeze": lambda t: t.unsqueeze(1),
        "flatten": lambda t: t.flatten(),
        "unfold": lambda t: t.unfold(2, 2, 1),
        "diagonal": lambda t: t.diagonal(0, 1, 2),
    }
    made = {name: fn(base) for name, fn in views.items()}
    executed = torch.kiln.get_executed_ops()
    # Only metadata kernels ran: nothing went to a stream.
    assert all(("copy" not in op and "clone" not in op) for op in executed), executed
    for name, v in made.items():
        assert v.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), name
        assert_same(v, views[name](base_cpu))
        assert v.stride() == views[name](base_cpu).stride(), name
        assert v.storage_offset() == views[name](base_cpu).storage_offset(), name


def test_writes_through_views_reach_the_base():
    base_cpu = torch.zeros(4, 4)
    base = base_cpu.kiln()
    base.t()[0].fill_(1)
    base_cpu.t()[0].fill_(1)
    base[1:3, 2:].copy_(torch.tensor([[5.0, 6.0], [7.0, 8.0]]))
    base_cpu[1:3, 2:].copy_(torch.tensor([[5.0, 6.0], [7.0, 8.0]]))
    assert_same(base, base_cpu)


def test_as_strided_outside_storage_is_an_error():
    x = torch.zeros(4, device="kiln")
    with pytest.raises(RuntimeError, match="out of bounds for storage"):
        x.as_strided((3,), (2,), 0)


def test_resize_grows_and_keeps_data():
    x = torch.arange(6.0, device="kiln")
    x.resize_(2, 3)
    assert x.shape == (2, 3)
    assert_same(x, torch.arange(6.0).reshape(2, 3))
    x.resize_(4, 5)
    assert x.shape == (4, 5)
    assert_same(x.flatten()[:6], torch.arange(6.0))
    assert x.untyped_storage().nbytes() >= 80
    x.resize_(0)
    assert x.numel() == 0
    y = torch.empty(0, device="kiln")
    y.resize_(2, 3, 4, 5, memory_format=torch.channels_last)
    assert y.stride() == torch.empty(0).resize_(2, 3, 4, 5, memory_format=torch.channels_last).stride()
    with pytest.raises(RuntimeError, match="negative dimension"):
        y.resize_(-1)


def test_set_variants():
    src = torch.arange(12.0, device="kiln")
    t = torch.empty(0, device="kiln")
    t.set_(src)
    assert_same(t, torch.arange(12.0))
    t.set_(src.untyped_storage(), 2, (2, 3), (3, 1))
    assert_same(t, torch.arange(12.0).as_strided((2, 3), (3, 1), 2))
    t.set_(src.untyped_storage())
    assert t.shape == (12,)
    t.set_()
    assert t.numel() == 0
    other = torch.zeros(3, device="kiln:1")
    with pytest.raises(RuntimeError, match="devices must match"):
        t.set_(other.untyped_storage())


def test_untyped_storage_resize():
    x = torch.arange(4.0, device="kiln")
    storage = x.untyped_storage()
    storage.resize_(64)
    assert storage.nbytes() == 64
    assert_same(torch.empty(0, device="kiln").set_(storage, 0, (4,), (1,)), torch.arange(4.0))
