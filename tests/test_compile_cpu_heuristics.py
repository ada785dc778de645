"""Inductor makes the CPU's performance choices for kiln graphs
(Note [Kiln takes Inductor's CPU heuristics], torch_kiln/compiler/inductor/
fixes.py): the same code for the same graph on kiln as on CPU, where before
kiln got the choices meant for Triton on a GPU. Each test compiles one small
graph on both devices and compares what Inductor wrote, then the values.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch._dynamo
from torch._inductor.utils import run_and_get_code

from quick_shard import rotate


pytestmark = pytest.mark.usefixtures("fresh_compile")  # conftest.py


def compiled_code(fn, *args):
    """(result, wrapper and kernel source) of fn compiled for args' device."""
    torch._dynamo.reset()
    out, sources = run_and_get_code(torch.compile(fn), *args)
    return out, "\n".join(sources)


def pool_backward(x):
    x = x.detach().requires_grad_()
    out = F.max_pool2d(x.relu(), 2)
    (grad,) = torch.autograd.grad(out.sum(), x)
    return grad


@pytest.mark.parametrize("device", ["kiln:0", pytest.param("kiln:1", marks=pytest.mark.slow)])
def test_scatter_add_calls_atens_scatter_reduce_as_on_cpu(device):
    """index_add / max-pool backward: ATen's parallel scatter_reduce_ kernel,
    not a generated (serial, atomic-add) loop."""
    def fn(src, index):
        return torch.zeros(64, 8, device=src.device).scatter_reduce(
            0, index, src, reduce="sum", include_self=True)

    src = torch.randn(256, 8)
    index = torch.randint(0, 64, (256, 8))
    cpu_out, cpu_code = compiled_code(fn, src, index)
    out, code = compiled_code(fn, src.to(device), index.to(device))
    assert "scatter_reduce_" in cpu_code and "scatter_reduce_" in code
    assert "atomic_add" not in code
    assert out.device == torch.device(device)
    torch.testing.assert_close(out.cpu(), cpu_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", [pytest.param("kiln:0", marks=pytest.mark.slow), "kiln:1"])
def test_convolutions_get_channels_last_layout_as_on_cpu(device):
    """Layout optimization in training: the forward graph runs its
    convolutions channels-last on kiln as on CPU (oneDNN serves both; the
    GPU heuristic left this graph NCHW), and the values are unchanged."""

    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 4, 3, padding=1))
    kiln_conv = copy.deepcopy(conv).to(device)
    x = torch.randn(2, 3, 8, 8)
    cpu_out, cpu_code = compiled_code(conv, x)
    out, code = compiled_code(kiln_conv, x.to(device))
    # The input converted to channels-last before the first convolution: a
    # (2, 3, 8, 8) buffer with channels-last strides.
    channels_last_input = "(192, 1, 24, 3)"
    assert channels_last_input in cpu_code and channels_last_input in code
    torch.testing.assert_close(out.cpu(), cpu_out.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, kiln_conv(x.to(device)), rtol=1e-5, atol=1e-5)


def test_pool_backward_matches_cpu_and_eager():
    x = torch.randn(4, 8, 6, 6)
    expected = pool_backward(x)
    for device in ("kiln:0", "kiln:1"):
        out, code = compiled_code(pool_backward, x.to(device))
        assert out.device == torch.device(device)
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-6, atol=1e-6)


def test_realize_heuristics_read_kiln_as_cpu():
    """ir.is_cpu, read only by the C++ backend's realize thresholds
    (config.realize_cpu_opcount_threshold, realize_cpu_acc_reads_threshold),
    answers as for CPU. A unit check: no small graph was found whose kernels
    differ between the CPU and GPU thresholds."""
    import torch._inductor.ir as ir
    from torch_kiln.compiler.inductor import fixes

    fixes.install()
    assert ir.is_cpu(torch.device("kiln:0")) and ir.is_cpu(torch.device("kiln:1"))
    assert ir.is_cpu(torch.device("cpu"))
    assert not ir.is_cpu(torch.device("meta"))


def column_sums(t):
    # A reduction over the rows: Inductor splits 8192 of them across threads
    # (one partial sum per thread) when it is compiled for two, not 64.
    return (t * 2).sum(0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(64, 10), (8192, 64)])
def test_kernels_are_cpus_for_the_compile_time_thread_count(restore_threads, threads, shape):
    # Note [Generated kernels use at most their compile-time thread count]:
    # the same parallel regions and reduction splits as Inductor on CPU at
    # the same torch.get_num_threads(), so the same bits. (With Inductor's
    # dynamic_threads, kiln opened a region in every kernel and split the
    # (64, 10) column sum, a CNN's bias gradient, by thread: 1 ulp off CPU.)
    torch.set_num_threads(threads)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    cpu_out, cpu_code = compiled_code(column_sums, x)
    out, code = compiled_code(column_sums, x.to("kiln"))
    assert out.device.type == "kiln"
    assert torch.equal(out.cpu(), cpu_out)
    assert code.count("#pragma omp parallel") == cpu_code.count("#pragma omp parallel")
    assert code.count("_arr[tid]") == cpu_code.count("_arr[tid]")
    if threads == 1:
        assert "#pragma omp parallel" not in code


def divide_by_constants(x):
    return x / 3.0, torch.div(x, 7), x.mean(0)


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_division_by_a_constant_divides_as_on_cpu(device):
    """x / 3.0 compiles to a division on kiln as on CPU, not to x * (1/3),
    which Inductor writes for other devices and which rounds a third of
    these elements differently: compiled kiln = compiled CPU (= eager for
    the divisions; the mean's sum is Inductor's own)."""
    x = torch.randn(4096, 3, generator=torch.Generator().manual_seed(0))
    cpu_out, cpu_code = compiled_code(divide_by_constants, x)
    out, code = compiled_code(divide_by_constants, x.to(device))
    assert "0.3333333" not in code and "0.3333333" not in cpu_code
    for kiln_value, cpu_value in zip(out, cpu_out):
        assert kiln_value.device == torch.device(device)
        assert torch.equal(kiln_value.cpu(), cpu_value)
    eager = divide_by_constants(x)
    assert torch.equal(out[0].cpu(), eager[0]) and torch.equal(out[1].cpu(), eager[1])


def layer_norm_step(x, weight, bias):
    x = x.detach().requires_grad_()
    out = F.layer_norm(x, (x.shape[-1],), weight, bias)
    (grad,) = torch.autograd.grad((out * out).sum(), x)
    return out, grad


@pytest.mark.parametrize("features,device", rotate([128, 2048], ["kiln:0", "kiln:1"]))
def test_layer_norm_variance_is_computed_as_on_cpu(device, features):
    """var_mean in two passes up to 1024 reduced elements and Welford's
    algorithm above, as Inductor chooses on CPU (on other devices it chose
    Welford from 9 elements on): compiled kiln's LayerNorm, forward and
    backward, has compiled CPU's bits on both sides of the threshold."""
    g = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(64, features, generator=g), torch.randn(features, generator=g), \
        torch.randn(features, generator=g)
    cpu_out, cpu_code = compiled_code(layer_norm_step, x, weight, bias)
    out, code = compiled_code(layer_norm_step, *(t.to(device) for t in (x, weight, bias)))
    assert ("welford" in code) == ("welford" in cpu_code) == (features > 1024)
    for kiln_value, cpu_value in zip(out, cpu_out):
        assert kiln_value.device == torch.device(device)
        assert torch.equal(kiln_value.cpu(), cpu_value)


def arg_reductions(x):
    return (x.argmax(), x.argmin(), x.argmax(dim=None, keepdim=True),
            (x * 2).transpose(0, 1).argmin())


@pytest.mark.parametrize("layout,device", rotate(
    ["transposed", "channels_last", "sliced_transposed", "int64"], ["kiln:0", "kiln:1"]))
def test_argmax_without_dim_of_a_permuted_input_is_the_logical_index(device, layout):
    """argmax/argmin over all dimensions of a non-contiguous input return the
    row-major index, as eager and compiled CPU do. Kiln used to get memory
    order's position (29 for 33 on a transposed (7, 5) input): a wrong
    value without an error."""
    g = torch.Generator().manual_seed(0)
    base, view = {
        "transposed": (torch.randn(7, 5, generator=g), lambda t: t.t()),
        "channels_last": (torch.randn(2, 3, 4, 5, generator=g),
                          lambda t: t.contiguous(memory_format=torch.channels_last)),
        "sliced_transposed": (torch.randn(9, 12, generator=g), lambda t: t[1:, ::2].t()),
        "int64": (torch.randperm(63, generator=g).reshape(7, 9), lambda t: t.t()),
    }[layout]
    x, kiln_x = view(base), view(base.to(device))
    assert kiln_x.stride() == x.stride() and not x.is_contiguous()
    torch._dynamo.reset()
    cpu_out = torch.compile(arg_reductions, backend="kiln")(x)
    torch._dynamo.reset()
    out = torch.compile(arg_reductions, backend="kiln")(kiln_x)
    for kiln_value, cpu_value, eager_value in zip(out, cpu_out, arg_reductions(x)):
        assert kiln_value.device == torch.device(device)
        assert torch.equal(kiln_value.cpu(), eager_value)
        assert torch.equal(cpu_value, eager_value)


@pytest.mark.parametrize("device,dtype", [
    ("kiln:1", torch.float16), ("kiln:0", torch.bfloat16),
    pytest.param("kiln:0", torch.float32, marks=pytest.mark.slow)])
def test_convolution_bias_stays_in_atens_convolution_as_on_cpu(device, dtype):
    """The bias is passed to the extern convolution, as on CPU, not added in
    a generated kernel after it: in float16/bfloat16 that extra rounding
    changed 183 of 576 outputs by 1 ulp. (Compiled float16 differs from
    eager on both devices: Inductor runs this convolution channels-last.)"""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3, padding=1).to(dtype)
    x = torch.randn(2, 3, 6, 6, dtype=dtype)
    with torch.no_grad():
        cpu_out, cpu_code = compiled_code(conv, x)
        out, code = compiled_code(copy.deepcopy(conv).to(device), x.to(device))
        eager = conv.to(device)(x.to(device))
    assert "bias=None" not in cpu_code and "bias=None" not in code
    assert out.device == torch.device(device)
    assert torch.equal(out.cpu(), cpu_out)
    if dtype != torch.float16:
        assert torch.equal(out, eager)


def small_products(bias, row, weight, column, batch_rows, batch_weight):
    """Products Inductor turns into sums of products on CPU (Note [Kiln's
    small matmuls are CPU's]): (1, K) @ (K, N) with K, N <= 16 and a dot
    product in addmm/mm, batches of M == 1 and N == 1 in bmm, and an
    outer product (K == 1)."""
    return (torch.addmm(bias, row, weight),           # (1, 9) @ (9, 13) + (1, 13)
            row @ column,                             # (1, 9) @ (9, 1)
            torch.bmm(batch_rows, batch_weight),      # (3, 1, 1031) @ (3, 1031, 5)
            torch.bmm(batch_weight.transpose(1, 2), batch_rows.transpose(1, 2)),  # N == 1
            column @ row)                             # (9, 1) @ (1, 9)


@pytest.mark.parametrize("device,dtype", [
    ("kiln:0", torch.float32), ("kiln:1", torch.bfloat16),
    pytest.param("kiln:1", torch.float32, marks=pytest.mark.slow),
    pytest.param("kiln:0", torch.bfloat16, marks=pytest.mark.slow)])
def test_small_matmuls_decompose_as_on_cpu(device, dtype):
    """Forward and gradients equal compiled CPU's bits. Before, kiln kept
    these as BLAS calls: 4.8e-7 off in 6 of the addmm's 13 float32 outputs,
    2.4e-5 in the bmm's, 0.03 in its bfloat16 gradient."""
    torch.manual_seed(0)
    shapes = [(1, 13), (1, 9), (9, 13), (9, 1), (3, 1, 1031), (3, 1031, 5)]
    inputs = [torch.randn(*s, dtype=dtype) for s in shapes]

    def run(device):
        leaves = [x.detach().to(device).requires_grad_() for x in inputs]
        torch._dynamo.reset()
        outputs = torch.compile(small_products)(*leaves)
        weights = [torch.linspace(-1, 1, o.numel(), dtype=dtype).reshape(o.shape).to(device)
                   for o in outputs]
        torch.autograd.backward(outputs, weights)
        return [o.detach().cpu() for o in outputs] + [x.grad.cpu() for x in leaves]

    expected, actual = run("cpu"), run(device)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e), (a - e).abs().max()
