"""Copies in every direction (cpu<->kiln, kiln<->kiln, kiln:0<->kiln:1), with
non-contiguous sources and destinations, stride-0 views, storage offsets and
dtype conversions: all bit-identical to CPU."""

import pytest
import torch

from conftest import assert_same

DEVICES = ["kiln:0", "kiln:1"]


def sources():
    base = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5) * 0.37 - 7
    return {
        "contiguous": base,
        "transposed": base.transpose(1, 3),
        "sliced_with_offset": base[1, 1:, ::2, 1:4],
        "step_slice": base.reshape(6, 20)[:, ::3],
        "expanded": base[0, 0, 0, :1].expand(3, 4),
        "scalar": base[1, 2, 3, 4],
        "permuted": base.permute(3, 1, 0, 2),
    }


@pytest.mark.parametrize("name", list(sources()))
def test_host_to_kiln_to_host_round_trip(name):
    src = sources()[name]
    on_kiln = src.to("kiln")
    assert on_kiln.device == torch.device("kiln:0")
    assert on_kiln.shape == src.shape
    assert_same(on_kiln, src)


@pytest.mark.parametrize("name", list(sources()))
def test_kiln_view_to_host(name):
    # Take the same view on a kiln base, then copy it back.
    base_cpu = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5) * 0.37 - 7
    base_kiln = base_cpu.to("kiln")
    view = {
        "contiguous": lambda b: b,
        "transposed": lambda b: b.transpose(1, 3),
        "sliced_with_offset": lambda b: b[1, 1:, ::2, 1:4],
        "step_slice": lambda b: b.reshape(6, 20)[:, ::3],
        "expanded": lambda b: b[0, 0, 0, :1].expand(3, 4),
        "scalar": lambda b: b[1, 2, 3, 4],
        "permuted": lambda b: b.permute(3, 1, 0, 2),
    }[name]
    assert_same(view(base_kiln).cpu(), view(base_cpu))
    assert_same(view(base_kiln).contiguous(), view(base_cpu).contiguous())
    assert_same(view(base_kiln).clone(), view(base_cpu).clone())


def test_copy_into_non_contiguous_kiln_destination():
    cpu_dst = torch.zeros(4, 6)
    kiln_dst = cpu_dst.to("kiln")
    src = torch.arange(8.0).reshape(2, 4)
    cpu_dst.t()[1:5, ::2].copy_(src.t())
    kiln_dst.t()[1:5, ::2].copy_(src.t())
    assert_same(kiln_dst, cpu_dst)
    # kiln -> kiln into a strided destination
    kiln_dst2 = torch.zeros(4, 6, device="kiln")
    kiln_dst2.t()[1:5, ::2].copy_(src.t().to("kiln"))
    assert_same(kiln_dst2, cpu_dst)


def test_copy_into_non_contiguous_host_destination():
    src = torch.arange(24.0).reshape(4, 6).to("kiln")
    cpu = torch.full((6, 4), -1.0)
    expected = torch.full((6, 4), -1.0)
    cpu.t()[:, 1:].copy_(src[:, 1:])
    expected.t()[:, 1:].copy_(src.cpu()[:, 1:])
    assert_same(cpu, expected)


def test_broadcasting_copy():
    dst = torch.zeros(3, 4, device="kiln")
    dst.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert_same(dst, torch.tensor([1.0, 2.0, 3.0, 4.0]).expand(3, 4).contiguous())
    dst.copy_(torch.tensor([5.0, 6.0, 7.0, 8.0], device="kiln"))
    assert_same(dst, torch.tensor([5.0, 6.0, 7.0, 8.0]).expand(3, 4).contiguous())


def test_expanded_view_reads_only_its_storage():
    src = torch.tensor([[1.5], [2.5], [3.5], [4.5]])  # shape (4, 1): 4 elements of storage
    expanded = src.kiln().expand(1, 4, 3)
    assert expanded.stride() == (4, 1, 0)
    assert expanded.untyped_storage().nbytes() == 16
    # Every copied byte range is checked against the storage (an internal
    # assertion), so a read past the 4 elements would raise here.
    assert_same(expanded.cpu(), src.expand(1, 4, 3))
    assert_same(expanded.contiguous(), src.expand(1, 4, 3).contiguous())


@pytest.mark.parametrize("shape", [(1, 1, 32, 128), (1, 64, 14), (2, 3, 8)])
def test_fp16_transpose_contiguous_is_bit_identical(shape):
    x = torch.randn(*shape).to(torch.float16)
    dims = (2, 3) if len(shape) == 4 else (1, 2)
    assert_same(x.kiln().transpose(*dims).contiguous(), x.transpose(*dims).contiguous())


def test_step_slice_is_bit_identical():
    x = torch.randn(5, 17, dtype=torch.float16)
    assert_same(x.kiln()[:, ::3], x[:, ::3])
    assert_same(x.kiln()[:, ::3].contiguous(), x[:, ::3].contiguous())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int32,
                                   torch.int8, torch.int64, torch.bool, torch.float64,
                                   torch.uint8, torch.int16, torch.complex64])
def test_casts_match_cpu(dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 64) * 10
    assert_same(x.kiln().to(dtype), x.to(dtype))          # cast on the device
    assert_same(x.to("kiln", dtype), x.to(dtype))         # cast during the copy
    assert_same(x.kiln().to(dtype).to(torch.float32), x.to(dtype).to(torch.float32))
    assert_same(x.kiln().to(dtype).cpu(), x.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ieee_specials_cast_like_cpu(dtype):
    specials = torch.tensor([65504.0, 65520.0, 70000.0, 1e30, float("inf"), float("-inf"),
                             float("nan"), 1e-8, -1e-8, 0.0, -0.0, 5.96e-8, 3.0e-5, 1 / 3])
    assert_same(specials.kiln().to(dtype), specials.to(dtype))
    assert_same(specials.to("kiln", dtype), specials.to(dtype))
    assert_same(specials.to(dtype).kiln().to(torch.float32), specials.to(dtype).to(torch.float32))


def test_casts_truncate_and_round_like_cpu():
    x = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 2.7, -2.7, 300.0, -300.0, 0.0])
    for dtype in (torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool,
                  torch.float16, torch.bfloat16):
        assert_same(x.kiln().to(dtype), x.to(dtype))


@pytest.mark.parametrize("src_device,dst_device", [("kiln:0", "kiln:1"), ("kiln:1", "kiln:0"),
                                                   ("kiln:0", "kiln:0")])
def test_kiln_to_kiln_copies(src_device, dst_device):
    x = torch.randn(6, 10)
    src = x.to(src_device)
    moved = src.to(dst_device)
    assert moved.device == torch.device(dst_device)
    assert_same(moved, x)
    assert_same(src.t().to(dst_device), x.t())
    assert_same(src[:, ::2].to(dst_device, torch.float16), x[:, ::2].to(torch.float16))
    dst = torch.zeros(10, 6, device=dst_device)
    dst.t().copy_(src)  # non-contiguous destination
    assert_same(dst, x.t().contiguous())
    dst2 = torch.zeros(6, 10, dtype=torch.float64, device=dst_device)
    dst2.copy_(src[:1].expand(6, 10))  # stride-0 source, dtype conversion
    assert_same(dst2, x[:1].expand(6, 10).to(torch.float64))


def test_storage_offsets_survive_copies():
    x = torch.arange(100, dtype=torch.int64)
    k = x.kiln()
    assert_same(k[37:41], x[37:41])
    assert k[37:41].storage_offset() == 37
    k[10:13] = torch.tensor([-1, -2, -3])
    x[10:13] = torch.tensor([-1, -2, -3])
    assert_same(k, x)


@pytest.mark.parametrize("shape", [(0,), (4, 0), (0, 3, 2)])
def test_zero_element_tensors(shape):
    cpu = torch.empty(shape)
    k = torch.empty(shape, device="kiln")
    assert k.shape == cpu.shape and k.numel() == 0
    assert_same(k.cpu(), cpu)
    assert_same(cpu.kiln(), cpu)
    assert_same(k.to("kiln:1"), cpu)
    assert_same(torch.zeros(shape, device="kiln"), torch.zeros(shape))
    assert "tensor([]" in repr(k) and "kiln:0" in repr(k)
    assert str(k).startswith("tensor([]")


def test_copy_of_conjugate_and_negative_views():
    z = torch.tensor([1 + 2j, -3 - 4j], dtype=torch.complex64)
    assert_same(z.kiln().conj().cpu(), z.conj().resolve_conj())
    assert_same(z.conj().kiln(), z.conj().resolve_conj())
    assert_same(z.kiln().conj().to("kiln:1"), z.conj().resolve_conj())
    assert_same(z.kiln().conj().resolve_conj(), z.conj().resolve_conj())
    assert_same(torch._neg_view(z.kiln()).cpu(), -z)
    assert_same(torch._neg_view(z.kiln()).clone(), -z)


def test_non_blocking_copies_are_correct_after_synchronize():
    c = torch.randn(1 << 12)
    d = c.to("kiln", non_blocking=True)
    back = torch.empty_like(c)
    back.copy_(d, non_blocking=True)
    torch.kiln.synchronize()
    assert_same(back, c)


def test_source_may_change_right_after_host_to_device_copy():
    c = torch.arange(1 << 16, dtype=torch.float32)
    expected = c.clone()
    d = c.to("kiln", non_blocking=True)
    c.fill_(-1)  # the copy must already have taken the values
    assert_same(d, expected)
