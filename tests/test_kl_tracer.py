"""The kl tracer: the device's tile model and the language's rules, checked
while a kernel is traced (torch_kiln/kl/tracer.py, language.py,
tile_model.py). Every bad kernel raises KernelError naming the kernel, this
file and the line; bad calls raise TypeError / RuntimeError naming the
kernel and the argument. These checks run before any C++ is built, so a
kernel that fails here fails the same way compiled (kiln) and simulated
(cpu, KILN_KL_SIMULATE) — both forms are exercised.
"""

import re

import numpy as np
import pytest
import torch

import torch_kiln.kl as kl
from torch_kiln.kl import tile_model
from kl_helpers import private_kernel_cache, where  # noqa: F401

HERE = __file__


@pytest.fixture(autouse=True)
def _cache(private_kernel_cache):  # noqa: F811
    yield


def test_device_properties_report_the_tile_model():
    for device in ("kiln:0", "kiln:1"):
        p = torch.kiln.get_device_properties(device)
        assert p.tile_max_partition_dim == 128 == tile_model.MAX_PARTITION_DIM
        assert p.tile_partitions == 128
        assert p.tile_scratch_bytes_per_partition == 192 * 1024
        assert p.tile_dtypes == (torch.float32, torch.bfloat16, torch.float16, torch.int32,
                                 torch.int64, torch.bool)


# ------------------------------------------------------------------ kernels

@kl.jit
def over_partition(out, ROWS: kl.constexpr):
    t = kl.zeros((ROWS, 4), kl.float32)  # LINE:partition
    kl.store(out, (kl.arange(0, 4),), kl.sum(t, axis=0))


@kl.jit
def over_scratch(out, COLS: kl.constexpr):
    cols = kl.arange(0, COLS)
    a = kl.full((2, COLS), 1.0)
    b = a + 1.0
    c = b * 2.0  # LINE:scratch
    kl.store(out, (cols,), kl.sum(a + b + c, axis=0), mask=cols < out.shape[0])


@kl.jit
def one_tile_over_scratch(out, COLS: kl.constexpr):
    t = kl.zeros((1, COLS), kl.float32)  # LINE:one-tile
    kl.store(out, (kl.arange(0, 4),), kl.sum(t, axis=0))


@kl.jit
def float64_tile(out, x):
    i = kl.arange(0, 4)
    v = kl.load(x, i).to(torch.float64)  # LINE:float64
    kl.store(out, i, v)


@kl.jit
def runtime_bound(out, n):
    i = kl.arange(0, n)  # LINE:runtime-bound
    kl.store(out, i, 1.0)


@kl.jit
def python_range_of_runtime_value(out, n):
    for k in range(n):  # LINE:python-range
        kl.store(out, k, 1.0)


@kl.jit
def static_range_of_runtime_value(out, n):
    for k in kl.static_range(n):  # LINE:static-range
        kl.store(out, k, 1.0)


@kl.jit
def branch_on_tile(out, x):
    v = kl.load(x, 0)
    if v > 0:  # LINE:branch
        kl.store(out, 0, v)


@kl.jit
def used_after_loop(out, n):
    for k in kl.range(0, n):
        inside = kl.zeros((4,))
    kl.store(out, kl.arange(0, 4), inside)  # LINE:after-loop


@kl.jit
def float_scalar_carried(out, n):
    acc = 0.0
    for k in kl.range(0, n):  # LINE:float-carried
        acc = acc + kl.zeros((4,))
    kl.store(out, kl.arange(0, 4), acc)


@kl.jit
def float_scalar_carried_stored_in_the_loop(out, n):
    # (a prefix sum: nothing reads acc after the loop, and compiled code gave
    # each element alone where the simulator summed)
    acc = 0.0
    for k in kl.range(0, n):  # LINE:prefix-sum
        acc = acc + kl.load(out, (k,))
        kl.store(out, (k,), acc)


@kl.jit
def carried_changes_dtype(out, n):
    acc = kl.zeros((4,), kl.float32)
    for k in kl.range(0, n):  # LINE:changes-dtype
        acc = acc.to(kl.int32)
    kl.store(out, kl.arange(0, 4), acc)


@kl.jit
def break_in_dynamic_loop(out, n):
    for k in kl.range(0, n):  # LINE:break
        kl.store(out, k, 1.0)
        break


@kl.jit
def return_in_inner_loop(out, n):
    for j in kl.range(0, n):
        kl.store(out, j, 0.0)
    for i in kl.range(0, n):
        for k in kl.range(0, n):  # LINE:return
            kl.store(out, k, 1.0)
            return


@kl.jit
def wrong_index_count(out, x):
    kl.store(out, (0, 0), kl.load(x, 0))  # LINE:index-count


@kl.jit
def float_index(out):
    kl.store(out, kl.arange(0, 4).to(kl.float32), 1.0)  # LINE:float-index


@kl.jit
def shapes_do_not_broadcast(out):
    t = kl.zeros((4,)) + kl.zeros((3,))  # LINE:broadcast
    kl.store(out, kl.arange(0, 4), t)


@kl.jit
def matmul_inner_mismatch(out):
    t = kl.matmul(kl.zeros((4, 8)), kl.zeros((4, 8)))  # LINE:matmul
    kl.store(out, kl.arange(0, 4), kl.sum(t, axis=1))


@kl.jit
def fill(out, value, BLOCK: kl.constexpr):
    i = kl.arange(0, BLOCK)
    kl.store(out, i, kl.full((BLOCK,), value), mask=i < out.shape[0])


DEVICES = ["kiln:0", "cpu"]


def launch(kernel, *args, device="kiln:0", **kwargs):
    out = torch.zeros(4, device=device)
    kernel[(1,)](out, *args, **kwargs)
    return out


def expect(kernel_name, marker, *patterns):
    """pytest.raises for a KernelError naming the kernel, this file:line and patterns."""
    text = rf"kl kernel '{kernel_name}' at .*{re.escape(where(HERE, marker))}: .*"
    return pytest.raises(kl.KernelError, match=text + ".*".join(patterns))


@pytest.mark.parametrize("device", DEVICES)
def test_tile_over_the_partition_limit(device):
    with expect("over_partition", "LINE:partition", r"shape \(256, 4\) float32",
                r"partition \(leading\) dimension 256", "at most 128"):
        launch(over_partition, ROWS=256, device=device)
    launch(over_partition, ROWS=128, device=device)  # at the limit: fine


@pytest.mark.parametrize("device", DEVICES)
def test_scratch_over_capacity(device):
    # three live (2, 16384) float32 tiles need 3 * 64 KiB = 192 KiB; the
    # fourth (a + b) goes over
    with pytest.raises(kl.KernelError, match=r"kl kernel 'over_scratch' at .*test_kl_tracer.py:"
                       r"\d+: the program's tiles need \d+ bytes of scratch per partition.*"
                       r"196608"):
        launch(over_scratch, COLS=16384, device=device)
    launch(over_scratch, COLS=1024, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_one_tile_over_scratch(device):
    with expect("one_tile_over_scratch", "LINE:one-tile", r"shape \(1, 65536\) float32",
                "262144 bytes of scratch per partition", "196608"):
        launch(one_tile_over_scratch, COLS=65536, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_unsupported_dtype_in_the_kernel(device):
    with expect("float64_tile", "LINE:float64", "dtype float64", "does not support",
                "supported: float32, bfloat16, float16, int32, int64, bool"):
        launch(float64_tile, torch.ones(4, device=device), device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_unsupported_dtype_at_the_call(device, dtype):
    with pytest.raises(TypeError, match=rf"kl kernel float64_tile: argument 'x' is a "
                       rf"{str(dtype)[6:]} tensor; the kiln tile model supports float32"):
        launch(float64_tile, torch.ones(4, dtype=dtype, device=device), device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel,marker,pattern", [
    (runtime_bound, "LINE:runtime-bound", "kl.arange end must be a constant int.*runtime"),
    (python_range_of_runtime_value, "LINE:python-range", "where a constant is required"),
    (static_range_of_runtime_value, "LINE:static-range",
     "kl.static_range end must be a constant int"),
    (branch_on_tile, "LINE:branch", "cannot be a Python bool.*kl.where"),
])
def test_runtime_value_where_a_constant_is_required(device, kernel, marker, pattern):
    args = (torch.ones(4, device=device),) if kernel is branch_on_tile else (4,)
    with expect(kernel.__name__, marker, pattern):
        launch(kernel, *args, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel,marker,pattern", [
    (used_after_loop, "LINE:after-loop", "made inside a kl.range loop is used after"),
    (float_scalar_carried, "LINE:float-carried", "'acc' is the Python number 0.0 before the "
                                                 "kl.range loop and a tile at the end of its body"),
    (float_scalar_carried_stored_in_the_loop, "LINE:prefix-sum",
     "'acc' is the Python number 0.0 before .* make it a tile before the loop"),
    (carried_changes_dtype, "LINE:changes-dtype", "loop-carried 'acc'.*float32.*int32"),
    # raised when tracing ends, named at the loop left (it named torch/_ops.py)
    (break_in_dynamic_loop, "LINE:break", "left early"),
    (return_in_inner_loop, "LINE:return", "left early"),
])
def test_dynamic_loop_rules(device, kernel, marker, pattern):
    with expect(kernel.__name__, marker, pattern):
        launch(kernel, 3, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel,marker,pattern", [
    (wrong_index_count, "LINE:index-count", "kl.store of 'out' \\(1-D\\) needs 1 index"),
    (float_index, "LINE:float-index", "index 0 of 'out' must be an integer tile"),
    (shapes_do_not_broadcast, "LINE:broadcast", r"shapes \(4,\), \(3,\) do not broadcast"),
    (matmul_inner_mismatch, "LINE:matmul", r"inner dims differ"),
])
def test_shape_and_index_errors(device, kernel, marker, pattern):
    args = (torch.ones(4, device=device),) if kernel is wrong_index_count else ()
    with expect(kernel.__name__, marker, pattern):
        launch(kernel, *args, device=device)


@kl.jit
def no_tensors(value, BLOCK: kl.constexpr):
    v = value + kl.zeros((BLOCK,), kl.float32)  # noqa: F841


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [np.float32(1.5), np.float64(1.5), np.int64(3), np.int32(-2)],
                         ids=["float32", "float64", "int64", "int32"])
def test_numpy_scalar_arguments_act_as_python_numbers(device, value):
    out, expected = torch.zeros(4, device=device), torch.zeros(4, device=device)
    fill[(1,)](out, value, BLOCK=4)
    fill[(1,)](expected, value.item(), BLOCK=4)
    assert torch.equal(out.cpu(), expected.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_bad_calls(device):
    out = torch.zeros(4, device=device)
    with pytest.raises(TypeError, match=r"launched with a grid: fill\[grid\]"):
        fill(out, 1.0, BLOCK=4)
    with pytest.raises(TypeError, match=r"kl kernel fill takes 3 arguments \(out, value, "
                                        r"BLOCK\), got 4"):
        fill[(1,)](out, 1.0, 4, 5)
    with pytest.raises(TypeError, match="kl kernel fill: missing argument 'BLOCK'"):
        fill[(1,)](out, 1.0)
    with pytest.raises(TypeError, match="kl kernel fill: unexpected argument 'BLOK'"):
        fill[(1,)](out, 1.0, BLOK=4)
    with pytest.raises(TypeError, match="kl kernel fill: argument 'out' must be a tensor"):
        fill[(1,)](3, 1.0, BLOCK=4)
    with pytest.raises(TypeError, match="argument 'value' is a tensor, but the kernel never "
                                        "kl.loads or kl.stores it"):
        fill[(1,)](out, torch.ones(()), BLOCK=4)
    with pytest.raises(TypeError, match="argument 'value' must be an int or float scalar"):
        fill[(1,)](out, "1.0", BLOCK=4)
    # ints past int64 name the argument (they raised a bare OverflowError)
    for value in (2**63, 2**64, -2**63 - 1, -2**64):
        with pytest.raises(ValueError, match=f"kl kernel fill: int argument 'value' is {value}; "
                                             f"kl int scalars and constexprs are int64"):
            fill[(1,)](out, value, BLOCK=4)
    with pytest.raises(ValueError, match="int argument 'BLOCK' is 1180591620717411303424"):
        fill[(1,)](out, 1.0, BLOCK=2**70)
    with pytest.raises(TypeError, match="kl.constexpr argument 'BLOCK' must be a Python int"):
        fill[(1,)](out, 1.0, BLOCK=torch.tensor(4))
    with pytest.raises(TypeError, match="kl kernel no_tensors has no tensor parameters"):
        no_tensors[(1,)](1.0, BLOCK=4)
    with pytest.raises(ValueError, match="grid .* must be non-negative ints"):
        fill[(-1,)](out, 1.0, BLOCK=4)
    with pytest.raises(ValueError, match="the grid has 4 dims"):
        fill[(1, 1, 1, 1)](out, 1.0, BLOCK=4)
    # CUDA's grid limits: refused at the launch, not run for hours.
    with pytest.raises(ValueError, match=r"has 1099511627776 programs on axis 0; at most "
                                         r"2147483647 are allowed"):
        fill[(2**40,)](out, 1.0, BLOCK=4)
    with pytest.raises(ValueError, match="65536 programs on axis 1; at most 65535"):
        fill[(1, 65536)](out, 1.0, BLOCK=4)
    with pytest.raises(ValueError, match="65536 programs on axis 2; at most 65535"):
        fill[(1, 1, 65536)](out, 1.0, BLOCK=4)
    # A float grid is refused by kl, like the others (not by the operator's
    # schema, whose message names kl_grid0).
    for grid in [(1.5,), (2.0,), (1, 2.0), lambda meta: (1.0,)]:
        with pytest.raises(ValueError, match=r"kl kernel fill: grid .* must be non-negative "
                                             r"ints, got float"):
            fill[grid](out, 1.0, BLOCK=4)
    with pytest.raises(ValueError, match="must be non-negative ints, got bool"):
        fill[(True,)](out, 1.0, BLOCK=4)
    # (these leaked the operator's schema, naming kl_grid0)
    for grid in [("abc",), lambda meta: "abc", (None,), lambda meta: (1, [2])]:
        with pytest.raises(ValueError, match=r"kl kernel fill: grid .* must be non-negative "
                                             r"ints, got (str|NoneType|list)"):
            fill[grid](out, 1.0, BLOCK=4)
    fill[(1,)](out, 2.5, BLOCK=4)
    assert torch.equal(out.cpu(), torch.full((4,), 2.5))


def test_tensors_on_different_devices():
    with pytest.raises(RuntimeError, match="kl kernel float64_tile: expected all tensors on one "
                                           "device, got cpu, kiln:0"):
        float64_tile[(1,)](torch.zeros(4, device="kiln"), torch.ones(4))
    with pytest.raises(RuntimeError, match="one device, got kiln:0, kiln:1"):
        float64_tile[(1,)](torch.zeros(4, device="kiln:0"), torch.ones(4, device="kiln:1"))


def test_language_functions_outside_a_kernel():
    with pytest.raises(RuntimeError, match=r"can only be called inside a @kl.jit kernel"):
        kl.arange(0, 4)


def test_source_shows_the_generated_cpp():
    out = torch.zeros(4, device="kiln")
    text = fill.source(out, 1.0, BLOCK=4)
    assert "KILN_KERNEL(fill)" in text and "#include <kiln/kernel.h>" in text
    assert "ctx.parallel_for(0, kl_programs" in text
