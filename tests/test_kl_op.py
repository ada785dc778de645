"""kl.op: Python functions launching kl kernels as one differentiable
operator (kiln's torch.library.triton_op): eager forward and backward on
kiln:0, kiln:1 and the CPU simulator, torch.library.opcheck, torch.compile
(fullgraph, static and dynamic shapes), and bad declarations.
"""

import pytest
import torch

import torch_kiln.kl as kl
from kl_helpers import private_kernel_cache  # noqa: F401
from quick_shard import rotate

DEVICES = ["kiln:0", "kiln:1", "cpu"]  # cpu: the simulator


@pytest.fixture(autouse=True)
def _cache(private_kernel_cache):  # noqa: F811
    yield


@kl.jit
def scaled_tanh_kernel(out, x, n, scale, BLOCK: kl.constexpr):
    offs = kl.program_id(0) * BLOCK + kl.arange(0, BLOCK)
    mask = offs < n
    v = kl.load(x, offs, mask=mask, other=0.0).to(kl.float32)
    kl.store(out, offs, kl.tanh(v * scale), mask=mask)


@kl.jit
def scaled_tanh_backward_kernel(grad_x, grad_out, out, n, scale, BLOCK: kl.constexpr):
    offs = kl.program_id(0) * BLOCK + kl.arange(0, BLOCK)
    mask = offs < n
    g = kl.load(grad_out, offs, mask=mask, other=0.0).to(kl.float32)
    y = kl.load(out, offs, mask=mask, other=0.0).to(kl.float32)
    kl.store(grad_x, offs, g * (1.0 - y * y) * scale, mask=mask)


@kl.op("kltest::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    n = x.numel()
    scaled_tanh_kernel[(kl.cdiv(n, 64),)](out, x.contiguous(), n, scale, BLOCK=64)
    return out


@kl.op("kltest::scaled_tanh_backward", mutates_args=())
def scaled_tanh_backward(grad_out: torch.Tensor, out: torch.Tensor,
                         scale: float) -> torch.Tensor:
    grad_x = torch.empty_like(out)
    n = out.numel()
    scaled_tanh_backward_kernel[(kl.cdiv(n, 64),)](grad_x, grad_out.contiguous(), out, n, scale,
                                                   BLOCK=64)
    return grad_x


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[1]


def _backward(ctx, grad_out):
    (out,) = ctx.saved_tensors
    return scaled_tanh_backward(grad_out, out, ctx.scale), None


scaled_tanh.register_autograd(_backward, setup_context=_setup_context)


def reference(x, scale):
    return torch.tanh(x * scale)


def check_forward_and_backward(fn, device, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    xd = x.clone().to(device).requires_grad_()  # (to("cpu") would return x itself)
    out = fn(xd)
    assert out.device == torch.device(device) and out.dtype == x.dtype
    out.backward(torch.ones_like(out))
    xr = x.clone().requires_grad_()
    expected = reference(xr, 1.5)
    expected.backward(torch.ones_like(expected))
    torch.testing.assert_close(out.detach().cpu(), expected.detach())
    torch.testing.assert_close(xd.grad.cpu(), xr.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_eager_forward_and_backward(device):
    # (a bare kl kernel has no autograd formula: backward raises,
    # test_kl_kernels.py; kl.op with register_autograd gives one)
    check_forward_and_backward(lambda x: scaled_tanh(x, 1.5), device, 100)
    with torch.no_grad():
        assert not scaled_tanh(torch.ones(3, device=device, requires_grad=True), 1.5).requires_grad


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = torch.randn(37, device=device, requires_grad=True)
    # opcheck's autograd-registration check knows CPU/CUDA/XPU only
    utils = {} if device == "cpu" else {
        "test_utils": ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")}
    torch.library.opcheck(scaled_tanh, (x, 2.0), **utils)


@pytest.mark.parametrize("dynamic,device", rotate([False, True], ["kiln:0", "kiln:1"]))
def test_compiled_fullgraph_forward_and_backward(fresh_compile, device, dynamic):
    compiled = torch.compile(lambda x: scaled_tanh(x * 1.0, 1.5), fullgraph=True,
                             dynamic=dynamic)
    for n in (10, 33, 200):  # new shapes: recompiled (static) or one graph (dynamic)
        check_forward_and_backward(compiled, device, n)


@kl.jit
def row_sum_kernel(out, x, COLS: kl.constexpr):
    row = kl.program_id(0)
    kl.store(out, row, kl.sum(kl.load(x, (row, kl.arange(0, COLS))), axis=0))


@kl.op("kltest::row_sum", mutates_args=())
def row_sum(x: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape
    out = torch.empty(rows, dtype=x.dtype, device=x.device)
    # a constexpr given a size: a SymInt in the fake run under dynamic shapes
    # (it raised "must be a Python int" there before the fake run skipped launches)
    row_sum_kernel[(rows,)](out, x.contiguous(), COLS=cols)
    return out


def test_a_constexpr_from_a_size_under_dynamic_shapes(fresh_compile):
    compiled = torch.compile(lambda x: row_sum(x + 1), fullgraph=True, dynamic=True)
    for cols in (5, 17, 100):
        x = torch.randn(3, cols)
        torch.testing.assert_close(compiled(x.to("kiln")).cpu(), (x + 1).sum(1))


def test_side_stream_orders_the_op_with_the_streams_work():
    s = torch.kiln.Stream()
    x = torch.randn(1 << 16, device="kiln")
    s.wait_stream(torch.kiln.current_stream())  # x is made on the default stream
    with torch.kiln.stream(s):
        y = x * 2
        out = scaled_tanh(y, 1.5)
    s.synchronize()
    torch.testing.assert_close(out.cpu(), reference(x.cpu() * 2, 1.5))


# "1x::y" and "ns::has space" reached torch's schema parser (an unclear
# error, and every later torch.compile in the process failed)
@pytest.mark.parametrize("qualname", ["noseparator", "a::b::c", "::name", "ns::", 3, "1x::y",
                                      "ns::has space", "ns::a.b", "ns::class", "ns::None",
                                      "\u00e9::\u00fc"])
def test_bad_qualname(qualname):
    with pytest.raises(ValueError, match=r"kl.op: qualname must be 'namespace::name', two "
                                         r"ASCII Python identifiers \(not keywords\), got"):
        kl.op(qualname, mutates_args=())


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_a_name_defined_by_another_function_is_refused():
    # torch.library.custom_op lets a second function take the name, and the
    # first one's handle then silently runs the second
    with pytest.raises(ValueError, match=r"kl.op: operator kltest::scaled_tanh is already "
                                         r"defined \(by another function\); registering _double"):
        kl.op("kltest::scaled_tanh", mutates_args=())(_double)
    with pytest.raises(ValueError, match=r"operator aten::add is already defined"):
        kl.op("aten::add", mutates_args=())(_double)
    x = torch.randn(5)
    torch.testing.assert_close(scaled_tanh(x, 1.5), reference(x, 1.5))  # still the first


def _define_again():
    @kl.op("kltest::defined_twice", mutates_args=())
    def defined_twice(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    return defined_twice


def test_the_same_definition_run_again_replaces_itself():
    # a module reloaded or imported under two names, a notebook cell run again
    _define_again()
    again = _define_again()
    torch.testing.assert_close(again(torch.zeros(2)), torch.ones(2))


def test_decorating_a_non_function():
    with pytest.raises(TypeError, match=r"kl.op\('kltest::x'\) decorates a function, got int"):
        kl.op("kltest::x", mutates_args=())(3)
