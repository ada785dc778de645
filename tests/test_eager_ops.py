"""Eager execution: ATen ops on kiln tensors give CPU's results, including
writes through views, out= variants, type promotion, zero-element tensors,
data-dependent ops and host (CPU) index tensors."""

import pytest
import torch

from conftest import assert_same


def both(fn):
    """fn(device) on cpu and kiln; returns (kiln_result, cpu_result)."""
    return fn("kiln"), fn("cpu")


def test_slice_assignment_reaches_base():
    def fn(device):
        x = torch.zeros(1, 6, dtype=torch.long, device=device)
        x[:, 1:4] = torch.tensor([[7, 8, 9]], device=device)
        return x
    k, c = both(fn)
    assert_same(k, c)
    assert k.tolist() == [[0, 7, 8, 9, 0, 0]]


def test_inplace_on_transposed_row_changes_base_column():
    def fn(device):
        base = torch.zeros(4, 4, device=device)
        base.t()[0].add_(1)
        return base
    k, c = both(fn)
    assert_same(k, c)
    assert k[:, 0].tolist() == [1.0, 1.0, 1.0, 1.0]


def test_zero_dim_results_written_into_out_slices():
    def fn(device):
        src = torch.arange(24.0, device=device).reshape(2, 3, 4)
        out = torch.zeros(2, 3, 4, device=device)
        for i in range(2):
            for j in range(3):
                for l in range(4):
                    out[i, j, l] = src[i, j, l] * 2 + src[i, j].sum()
        return out
    k, c = both(fn)
    assert_same(k, c)


def test_bool_mask_multiplication_promotes_to_float():
    def fn(device):
        x = torch.full((4,), -3.4e38, device=device)
        mask = torch.tensor([True, False, True, False], device=device)
        y = x * mask
        z = x.clone()
        z.mul_(mask)
        return y, z
    (ky, kz), (cy, cz) = both(fn)
    assert ky.dtype == torch.float32 and kz.dtype == torch.float32
    assert_same(ky, cy)
    assert_same(kz, cz)


@pytest.mark.parametrize("out_kind", ["contiguous", "transposed", "empty"])
def test_addmm_out(out_kind):
    torch.manual_seed(0)
    a, m1, m2 = torch.randn(3, 3), torch.randn(3, 4), torch.randn(4, 3)

    def fn(device):
        o = {"contiguous": lambda: torch.empty(3, 3, device=device),
             "transposed": lambda: torch.empty(3, 3, device=device).t(),
             "empty": lambda: torch.empty(0, device=device)}[out_kind]()
        result = torch.addmm(a.to(device), m1.to(device), m2.to(device), beta=0.5, alpha=2.0, out=o)
        assert result is o
        return o
    k, c = both(fn)
    assert_same(k, c)
    assert k.stride() == c.stride()
    assert k.shape == (3, 3)


def test_masked_select_on_permuted_tensor_is_row_major():
    def fn(device):
        cand = torch.arange(36, device=device).reshape(3, 6, 2)
        permuted = cand.permute(2, 0, 1)
        mask = (permuted % 3) == 0
        return torch.masked_select(permuted, mask)
    k, c = both(fn)
    assert_same(k, c)


def test_boolean_indexing_and_nonzero_on_column_major():
    def fn(device):
        x = torch.arange(12.0, device=device).reshape(3, 4).t()  # column-major
        mask = x > 4
        read = x[mask]
        x2 = x.clone()
        x2[mask] = -1.0
        nz = torch.nonzero(x > 2)
        x3 = torch.arange(12.0, device=device).reshape(3, 4).t()
        x3[x3 > 5] = 0.5
        return read, x2, nz, x3
    for k, c in zip(*both(fn)):
        assert_same(k, c)


def test_data_dependent_ops_are_counted_as_sync():
    x = torch.arange(10, device="kiln")
    torch.kiln.synchronize()
    torch.kiln.clear_op_tracking()
    torch.nonzero(x > 4)
    x.sum().item()
    sync = torch.kiln.get_sync_ops()
    assert sync.get("aten::nonzero") == 1
    assert sync.get("aten::_local_scalar_dense") == 1
    executed = torch.kiln.get_executed_ops()
    assert executed.get("aten::nonzero") == 1
    assert "aten::gt.Scalar_out" in executed or "aten::gt.Scalar" in executed
    torch.kiln.clear_op_tracking()
    assert torch.kiln.get_executed_ops() == {} and torch.kiln.get_sync_ops() == {}


def test_elementwise_ops_do_not_synchronize():
    x = torch.randn(100, device="kiln")
    torch.kiln.synchronize()
    torch.kiln.clear_op_tracking()
    y = (x * 2 + 1).relu().sum(0) / 3
    z = torch.mm(x.reshape(10, 10), x.reshape(10, 10).t())
    # At most one-time meta-kernel checks (Note [Verifying meta kernels]).
    assert all(name.endswith("(layout check)") for name in torch.kiln.get_sync_ops())
    torch.kiln.clear_op_tracking()
    y = (x * 2 + 1).relu().sum(0) / 3
    z = torch.mm(x.reshape(10, 10), x.reshape(10, 10).t())
    assert torch.kiln.get_sync_ops() == {}
    assert_same(y, ((x.cpu() * 2 + 1).relu().sum(0) / 3))
    assert_same(z, torch.mm(x.cpu().reshape(10, 10), x.cpu().reshape(10, 10).t()))


@pytest.mark.parametrize("shape", [(0,), (4, 0), (0, 3, 2)])
def test_zero_element_math(shape):
    def fn(device):
        a = torch.ones(shape, device=device)
        return a + a, a * 3, a.sum(), a.prod(), torch.cat([a, a]), a.sum(0) if a.dim() > 1 else a
    for k, c in zip(*both(fn)):
        assert_same(k, c)
    assert torch.ones(shape, device="kiln").sum().item() == 0.0
    assert torch.ones(shape, device="kiln").prod().item() == 1.0


def test_max_of_empty_raises_like_cpu():
    with pytest.raises(RuntimeError) as cpu_error:
        torch.empty(0).max()
    with pytest.raises(RuntimeError) as kiln_error:
        torch.empty(0, device="kiln").max()
    assert str(kiln_error.value) == str(cpu_error.value)


def test_empty_narrow_backward_gives_zero_grads():
    def fn(device):
        x = torch.randn(3, 4, device=device, requires_grad=True)
        torch.narrow(x, 1, 2, 0).square().sum().backward()
        return x.grad
    k, c = both(fn)
    assert_same(k, torch.zeros(3, 4))
    assert_same(c, torch.zeros(3, 4))


def test_scalar_accumulation_is_exact():
    acc = torch.zeros((), device="kiln")
    for _ in range(1000):
        acc += 1
    assert acc.item() == 1000.0


def test_large_mul_then_read_back_is_exact():
    n = 4 * 1024 * 1024
    zc = torch.arange(n, dtype=torch.float32) % 1000
    z = zc.kiln()
    z.mul_(0.5)
    zc.mul_(0.5)
    assert z[-1].item() == zc[-1].item()
    assert z.sum().item() == zc.sum().item()
    assert z[:5].tolist() == zc[:5].tolist()
    assert bool(z[2] == 1.0) is True and float(z[3]) == 1.5


@pytest.mark.parametrize("value", [
    torch.tensor(7), torch.tensor(2.5), torch.tensor([1.5, float("nan"), float("inf"), -0.0]),
    torch.arange(2000.0), torch.tensor([1.0, 2.0], dtype=torch.float16),
    torch.tensor([1.0, 2.5], dtype=torch.bfloat16), torch.tensor([True, False]),
    torch.empty(0), torch.empty(2, 0), torch.arange(6.0).reshape(2, 3).t(),
])
def test_repr_and_str_never_raise_and_match_cpu_on_host(value):
    k = value.to("kiln")
    text = repr(k)
    assert "device='kiln:0'" in text
    str(k)
    assert repr(k.cpu()) == repr(value)
    assert str(k.cpu()) == str(value)


def test_indexing_with_cpu_index_tensor_and_cpu_scalar():
    a_cpu = torch.arange(10.0) * 3
    a = a_cpu.kiln()
    idx = torch.tensor([1, 3, 5])
    assert_same(a[idx], a_cpu[idx])
    assert_same(a[torch.tensor([True, False] * 5)], a_cpu[torch.tensor([True, False] * 5)])
    b = a.clone()
    b[idx] = torch.tensor(-1.0)
    b_cpu = a_cpu.clone()
    b_cpu[idx] = torch.tensor(-1.0)
    assert_same(b, b_cpu)
    assert_same(a * torch.tensor(2.0), a_cpu * 2)
    print(a[idx])


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_cpu_index_tensors_after_slices_none_and_ellipsis(device):
    """Python's indexing passes a slice, None or ... before a CPU index tensor
    as an undefined tensor in the index list; that raised "tensor does not
    have a device" (found by a fresh-user sweep)."""
    x_cpu = torch.arange(24.0).reshape(2, 3, 4)
    x = x_cpu.to(device)
    i, mask = torch.tensor([1, 0]), torch.tensor([True, False, True, False])
    for index in [(slice(None), i), (Ellipsis, i), (None, i), (slice(1, None), slice(None), mask),
                  (i, slice(None), i), (slice(None), torch.tensor([[0, 1], [2, 2]]))]:
        assert_same(x[index], x_cpu[index])
        written, written_cpu = x.clone(), x_cpu.clone()
        written[index] = -1.0
        written_cpu[index] = -1.0
        assert_same(written, written_cpu)


def test_type_promotion_follows_result_type():
    cases = [
        (torch.tensor([1, 2], dtype=torch.int32), 2.5),
        (torch.tensor([1, 2], dtype=torch.int64), torch.tensor(1.5, dtype=torch.float64)),
        (torch.tensor([1.0, 2.0], dtype=torch.float16), torch.tensor([1.0, 2.0])),
        (torch.tensor([True, False]), 3),
        (torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([-1, 2], dtype=torch.int8)),
    ]
    for a, b in cases:
        kb = b.kiln() if isinstance(b, torch.Tensor) and b.dim() > 0 else b
        k = a.kiln() + kb
        c = a + b
        assert k.dtype == c.dtype == torch.result_type(a, b)
        assert_same(k, c)


def test_python_scalars_do_not_create_float64_work():
    x = torch.ones(3, device="kiln")
    torch.kiln.synchronize()
    torch.kiln.clear_op_tracking()
    y = x * 2.5 + 1.0
    assert y.dtype == torch.float32
    assert_same(y, torch.ones(3) * 2.5 + 1.0)


def test_inplace_keeps_self_dtype_and_rejects_bad_casts():
    x = torch.ones(3, dtype=torch.float16, device="kiln")
    x.add_(torch.ones(3, device="kiln", dtype=torch.float32))
    assert x.dtype == torch.float16
    i = torch.ones(3, dtype=torch.int64, device="kiln")
    with pytest.raises(RuntimeError, match="can't be cast"):
        i.add_(torch.ones(3, device="kiln") * 0.5)


def test_out_with_wrong_size_is_resized_and_returned():
    def fn(device):
        o = torch.empty(7, device=device)
        r = torch.add(torch.ones(2, 3, device=device), 1, out=o)
        assert r is o
        return o
    k, c = both(fn)
    assert_same(k, c)


def test_non_contiguous_out_is_kept():
    def fn(device):
        o = torch.zeros(4, 3, device=device).t()
        torch.mul(torch.arange(12.0, device=device).reshape(3, 4), 2, out=o)
        return o
    k, c = both(fn)
    assert k.stride() == c.stride() == (1, 3)
    assert_same(k, c)


def test_multi_output_and_list_ops():
    torch.manual_seed(0)
    x = torch.randn(5, 7)
    def fn(device):
        t = x.to(device)
        values, indices = t.max(dim=1)
        s = torch.sort(t, dim=0)
        parts = torch.split(t, 2, dim=1)
        chunks = torch.chunk(t, 3)
        u = torch.unbind(t, 1)
        return [values, indices, s.values, s.indices, *parts, *chunks, *u,
                torch.stack([t, t]), torch.topk(t, 3).values, torch.cumsum(t, 1)]
    for k, c in zip(*both(fn)):
        assert_same(k, c)


def test_unique_and_friends():
    x = torch.tensor([3, 1, 2, 3, 1, 5])
    def fn(device):
        t = x.to(device)
        u, inv, counts = torch.unique(t, return_inverse=True, return_counts=True)
        return u, inv, counts, torch.unique_consecutive(t), torch.bincount(t), t.argwhere()
    for k, c in zip(*both(fn)):
        assert_same(k, c)


def test_async_kernel_error_is_raised_at_synchronization():
    x = torch.arange(4.0, device="kiln")
    bad = torch.tensor([0, 9], device="kiln")
    with pytest.raises((RuntimeError, IndexError), match="index"):
        y = torch.index_select(x, 0, bad)
        torch.kiln.synchronize()
    # the device works afterwards
    assert torch.ones(2, device="kiln").sum().item() == 2.0
