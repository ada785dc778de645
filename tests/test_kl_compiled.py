"""Compiled kl kernels (torch_kiln/kl/lowering.py + jit.py on part 1): a
launch is a task on the current kiln stream (stream order with eager work,
side streams, kiln:1, inputs from non_blocking copies), counted like any
kernel; the kernel is a torch.library operator that works under
torch.compile(fullgraph=True) as one node; builds are cached on disk per
specialisation; errors found inside a compiled kernel surface at the next
synchronization with the kernel's line.
"""

import os
import subprocess
import sys

import pytest
import torch

import torch_kiln.kl as kl
from kl_helpers import private_kernel_cache, where  # noqa: F401

HERE = __file__


@pytest.fixture(autouse=True)
def _cache(private_kernel_cache):  # noqa: F811
    yield


@kl.jit
def axpy(out, x, y, n, alpha, BLOCK: kl.constexpr):
    i = kl.program_id(0) * BLOCK + kl.arange(0, BLOCK)
    mask = i < n
    v = alpha * kl.load(x, i, mask=mask, other=0.0) + kl.load(y, i, mask=mask, other=0.0)
    kl.store(out, i, v, mask=mask)


def run_axpy(x, y, alpha=2.0, block=256):
    out = torch.empty_like(x)
    axpy[(kl.cdiv(x.numel(), block),)](out, x, y, x.numel(), alpha, BLOCK=block)
    return out


def test_call_returns_at_once_and_runs_in_stream_order():
    torch.kiln.clear_op_tracking()
    x = torch.randn(100_000, device="kiln")
    y = x.exp()  # queued eager work the kernel reads
    run_axpy(x[:10], y[:10])  # build the kernel first
    torch.kiln.synchronize()
    torch.kiln.clear_op_tracking()
    before = dict(torch.kiln.get_sync_ops())
    torch.kiln._sleep(50)
    out = run_axpy(x, y)
    assert not torch.kiln.current_stream().query()  # still queued behind the sleep
    later = out + 1  # eager work reading the kernel's output
    assert dict(torch.kiln.get_sync_ops()) == before
    torch.testing.assert_close(later.cpu(), 2 * x.cpu() + x.cpu().exp() + 1)
    assert torch.kiln.get_executed_ops()["kl::axpy"] == 1


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_runs_on_the_current_side_stream(device):
    x = torch.randn(1000, device=device)
    y = torch.randn(1000, device=device)
    side = torch.kiln.Stream(device=device)
    side.wait_stream(torch.kiln.current_stream(device))
    with torch.kiln.stream(side):
        out = run_axpy(x, y, 0.5)
    torch.kiln.current_stream(device).wait_stream(side)
    torch.testing.assert_close(out.cpu(), 0.5 * x.cpu() + y.cpu())


@pytest.mark.parametrize("non_blocking", [False, True])
def test_reads_inputs_of_non_blocking_copies(non_blocking):
    host = torch.randn(5000).pin_memory()
    x = host.to("kiln", non_blocking=non_blocking)
    out = run_axpy(x, x, -1.0)
    back = out.to("cpu", non_blocking=non_blocking)
    torch.kiln.synchronize()
    assert torch.equal(back, torch.zeros(5000))


def test_under_torch_compile_fullgraph(fresh_compile):
    from torch._dynamo.testing import CompileCounter

    def f(x, y):
        return run_axpy(x * 2, y).relu() + 1

    x = torch.randn(3000, device="kiln")
    y = torch.randn(3000, device="kiln")
    expected = f(x, y).cpu()
    counter = CompileCounter()
    compiled = torch.compile(f, fullgraph=True, backend=counter)
    torch.testing.assert_close(compiled(x, y).cpu(), expected)
    assert counter.frame_count == 1
    inductor = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(inductor(x, y).cpu(), expected)


def test_opcheck_schema_and_fake():
    x = torch.randn(300, device="kiln")
    y = torch.randn(300, device="kiln")
    out = torch.empty_like(x)
    torch.library.opcheck(axpy.op, (out, x, y, 300, 2.0, 2, 1, 1, 256),
                          test_utils=("test_schema", "test_faketensor"))


@kl.jit
def overrun(out, x, BLOCK: kl.constexpr):
    i = kl.arange(0, BLOCK)
    kl.store(out, i, kl.load(x, i))  # LINE:compiled-overrun


def test_out_of_bounds_in_a_compiled_kernel_is_raised_at_synchronization():
    x = torch.ones(10, device="kiln")
    out = torch.zeros(16, device="kiln")
    overrun[(1,)](out, x, BLOCK=16)  # returns: the error is the stream's
    with pytest.raises(RuntimeError, match=rf"kl::overrun: .*kl kernel 'overrun' at .*"
                       rf"{where(HERE, 'LINE:compiled-overrun')}: kl.load from 'x': index 10 is "
                       rf"out of bounds for dimension 0 of size 10"):
        torch.kiln.synchronize()
    out = torch.zeros(8, device="kiln")
    overrun[(1,)](out, x, BLOCK=8)  # in bounds: the device keeps working
    assert torch.equal(out.cpu(), torch.ones(8))


def test_each_specialisation_is_built_once_and_cached_on_disk(private_kernel_cache):  # noqa: F811
    x = torch.randn(100, device="kiln")
    run_axpy(x, x, block=64)
    libraries = sorted(private_kernel_cache.glob("kl-*.so"))
    run_axpy(x[:50], x[:50], alpha=3.0, block=64)  # other sizes and scalars: same kernel
    assert sorted(private_kernel_cache.glob("kl-*.so")) == libraries
    run_axpy(x, x, block=128)  # another constexpr: another library
    run_axpy(x.bfloat16(), x.bfloat16(), block=64)  # another dtype: another library
    assert len(list(private_kernel_cache.glob("kl-*.so"))) == len(libraries) + 2
    # A second process with the same kernel loads it from the disk cache.
    code = ("import sys, torch; sys.path.insert(0, %r); import test_kl_compiled as t; "
            "jit = sys.modules['torch_kiln.kl.jit']; x = torch.randn(100, device='kiln'); "
            "print(torch.equal(t.run_axpy(x, x, block=64).cpu(), 3 * x.cpu()), "
            "jit._COMPILE_STATS['libraries_loaded'])" % os.path.dirname(HERE))
    stamps = {p: p.stat().st_mtime_ns for p in private_kernel_cache.glob("kl-*.so")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "1"]
    assert {p: p.stat().st_mtime_ns for p in private_kernel_cache.glob("kl-*.so")} == stamps


def test_compiled_source_follows_the_tile_model():
    x = torch.randn(10, device="kiln")
    text = axpy.source(torch.empty_like(x), x, x, 10, 1.0, BLOCK=256)
    assert "kl_load_row<float>" in text and "kl_in_bounds(" in text


@kl.jit
def floordiv_and_mod(q, r, x, y, B: kl.constexpr):
    i = kl.arange(0, B)
    a, b = kl.load(x, i), kl.load(y, i)
    kl.store(q, i, a // b)
    kl.store(r, i, a % b)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_minimum_divided_by_minus_one_wraps_as_torch_does(dtype):
    """min // -1 overflows, which x86 traps (SIGFPE killed the process); the
    compiled kernel gives torch's and the simulator's wrapped results."""
    low = torch.iinfo(dtype).min
    x = torch.tensor([low, 7, -7, low, 0, 5], dtype=dtype)
    y = torch.tensor([-1, -1, 2, 1, -1, -3], dtype=dtype)
    expected_q = torch.div(x, y, rounding_mode="floor")
    expected_r = torch.remainder(x, y)
    for device in ("cpu", "kiln"):  # the simulator, then compiled code
        q = torch.empty(6, dtype=dtype, device=device)
        r = torch.empty(6, dtype=dtype, device=device)
        floordiv_and_mod[(1,)](q, r, x.to(device), y.to(device), B=6)
        assert q.cpu().tolist() == expected_q.tolist(), device
        assert r.cpu().tolist() == expected_r.tolist(), device
