"""The kernels written in the kl tile language (examples/kernels/kl_*.py)
against PyTorch, for float32 and bfloat16 inputs with ragged shapes:
RMSNorm, row softmax, a tiled matmul with bias and activation, and causal
flash attention (online softmax over key tiles); compiled on kiln:0 and
kiln:1, simulated on the CPU, and the softmax under torch.compile.
"""

import os
import sys

import pytest
import torch

from conftest import run_python
from kl_helpers import private_kernel_cache  # noqa: F401
from quick_shard import rotate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from examples.kernels import kl_attention, kl_matmul, kl_rms_norm, kl_softmax  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
DEVICES = ["kiln:0", "kiln:1", "cpu"]  # cpu: the simulator


@pytest.fixture(autouse=True)
def _cache(private_kernel_cache):  # noqa: F811
    yield


def tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# rows_per_program 4 on 37 rows: the last program's rows past the end are masked
@pytest.mark.parametrize("rows_per_program,device,dtype",  # half of them in `make test`
                         rotate([1, 4], DEVICES, DTYPES, per_case=3))
def test_rms_norm(device, dtype, rows_per_program):
    x, w = randn(37, 100, dtype=dtype), randn(100, dtype=dtype, seed=1)
    out = kl_rms_norm.rms_norm(x.to(device), w.to(device), 1e-6, rows_per_program)
    assert out.dtype == dtype and out.device == torch.device(device)
    torch.testing.assert_close(out.cpu(), kl_rms_norm.reference(x, w, 1e-6), **tol(dtype))


@pytest.mark.parametrize("rows_per_program,device,dtype",  # half of them in `make test`
                         rotate([1, 4], DEVICES, DTYPES, per_case=3))
def test_softmax(device, dtype, rows_per_program):
    x = randn(37, 100, dtype=dtype) * 5
    out = kl_softmax.softmax(x.to(device), rows_per_program)
    torch.testing.assert_close(out.cpu(), torch.softmax(x, -1), **tol(dtype))
    torch.testing.assert_close(kl_softmax.composite(x), torch.softmax(x, -1), **tol(dtype))


def test_softmax_is_stable_for_large_inputs():
    x = torch.tensor([[1000.0, 1000.0, -1000.0], [-1e30, 0.0, 1e30]], device="kiln")
    out = kl_softmax.softmax(x).cpu()
    torch.testing.assert_close(out, torch.softmax(x.cpu(), -1))


@pytest.mark.parametrize("activation,device,dtype", rotate(  # each device and dtype once in `make test`
    [kl_matmul.NONE, kl_matmul.RELU, kl_matmul.GELU_TANH], DEVICES, DTYPES, per_case=2))
def test_matmul_bias_activation(device, dtype, activation):
    a, b = randn(70, 50, dtype=dtype), randn(50, 90, dtype=dtype, seed=1)
    bias = randn(90, dtype=dtype, seed=2)
    out = kl_matmul.matmul_bias_act(a.to(device), b.to(device), bias.to(device), activation)
    expected = kl_matmul.reference(a, b, bias, activation)
    torch.testing.assert_close(out.cpu(), expected, **(tol(dtype) if dtype == torch.bfloat16
                                                       else dict(rtol=1e-4, atol=1e-4)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_attention(device, dtype):
    q, k, v = (randn(2, 3, 100, 16, dtype=dtype, seed=s) for s in range(3))
    out = kl_attention.causal_attention(q.to(device), k.to(device), v.to(device), block=(32, 32))
    torch.testing.assert_close(out.cpu(), kl_attention.reference(q, k, v),
                               **(tol(dtype) if dtype == torch.bfloat16
                                  else dict(rtol=1e-4, atol=1e-4)))


def test_kernels_under_torch_compile(fresh_compile):
    def f(x, w):
        return kl_softmax.softmax(kl_rms_norm.rms_norm(x, w, 1e-6) * 2)

    x, w = randn(37, 100, dtype=torch.float32), randn(100, dtype=torch.float32, seed=1)
    xk, wk = x.to("kiln"), w.to("kiln")
    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(xk, wk).cpu(), f(xk, wk).cpu())
    expected = torch.softmax(kl_rms_norm.reference(x, w, 1e-6) * 2, -1)
    torch.testing.assert_close(compiled(xk, wk).cpu(), expected, rtol=1e-5, atol=1e-5)


FIRST_USE_UNDER_COMPILE = """
import sys, torch, torch_kiln, torch_kiln.compiler
sys.path.insert(0, {repo!r})
from examples.kernels import kl_rms_norm, kl_softmax
x, w = torch.randn(37, 100), torch.randn(100)
f = torch.compile(lambda x, w: kl_softmax.softmax(kl_rms_norm.rms_norm(x, w, 1e-6) * 2),
                  fullgraph={fullgraph})
out = f(x.to("kiln"), w.to("kiln")).cpu()
expected = torch.softmax(kl_rms_norm.reference(x, w, 1e-6) * 2, -1)
torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
print("graph breaks:", sum(torch_kiln.compiler.get_metrics()["graph_breaks"].values()))
"""


@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_kernels_first_use_may_be_under_torch_compile(fullgraph, tmp_path):
    """In a fresh process the kernels are first launched inside the compiled
    function: they are prepared while Dynamo traces (Note [A kl kernel's
    first use may be under torch.compile]). Before, fullgraph=True raised
    "Unsupported context manager" and without it the graph broke."""
    r = run_python(FIRST_USE_UNDER_COMPILE.format(repo=REPO, fullgraph=fullgraph),
                   {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
                    "KILN_KERNELS_CACHE_DIR": str(tmp_path / "kernels")}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "graph breaks: 0" in r.stdout, r.stdout


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("simulate", [False, True])
def test_backward_through_a_kl_kernel_raises_instead_of_dropping_the_gradient(device, simulate,
                                                                              monkeypatch):
    # kl kernels have no autograd formula: with an input that requires grad,
    # backward through the written tensor raises (it used to give no grad_fn,
    # or, mixed with other ops, silently drop the kernel's part of the grad).
    monkeypatch.setenv("KILN_KL_SIMULATE", "1" if simulate else "0")
    x = (randn(37, 100, dtype=torch.float32) * 5).to(device).requires_grad_()
    out = kl_softmax.softmax(x)
    torch.testing.assert_close(out.detach().cpu(), torch.softmax(x.detach().cpu(), -1),
                               **tol(torch.float32))
    assert out.requires_grad
    with pytest.raises(RuntimeError, match=r"Trying to backward through kl::softmax_kernel(_\d+)? "
                                           r".*no autograd formula was registered"):
        (out + x).sum().backward()
    with torch.no_grad():
        out = kl_softmax.softmax(x)
    assert not out.requires_grad
    torch.testing.assert_close(out.cpu(), torch.softmax(x.detach().cpu(), -1),
                               **tol(torch.float32))


def test_backward_through_a_compiled_kl_kernel_raises(fresh_compile):
    x = (randn(37, 100, dtype=torch.float32) * 5).to("kiln").requires_grad_()
    with pytest.raises(Exception, match=r"Trying to backward through kl::softmax_kernel(_\d+)? "
                                        r".*no autograd formula was registered"):
        (torch.compile(kl_softmax.softmax)(x) + x).sum().backward()


def _bad_inputs(device):
    f32 = dict(device=device)
    a, b5, bias = torch.ones(4, 5, **f32), torch.ones(5, 3, **f32), torch.ones(3, **f32)
    x, w = torch.ones(4, 8, **f32), torch.ones(8, **f32)
    mm, rms, sm = kl_matmul.matmul_bias_act, kl_rms_norm.rms_norm, kl_softmax.softmax
    return [
        (lambda: mm(a, torch.ones(6, 3, **f32), bias), ValueError,
         r"agree in K.*\(4, 5\).*\(6, 3\)"),
        (lambda: mm(a, b5, torch.ones(7, **f32)), ValueError,
         r"bias must be \(N,\) = \(3,\), got \(7,\)"),
        (lambda: mm(a[None], b5, bias), ValueError, r"a and b must be 2-D"),
        (lambda: mm(a, b5, bias, 5), ValueError, r"activation must be one of .*got 5"),
        (lambda: mm(a, b5, bias, True), ValueError, r"activation must be one of .*got True"),
        (lambda: mm(a, b5.double(), bias), TypeError, r"one dtype of float32 or bfloat16.*float64"),
        (lambda: mm(a.long(), b5.long(), bias.long()), TypeError, r"got torch.int64"),
        (lambda: mm(a, b5, bias, block=(32, 0, 32)), ValueError, r"block must be three positive"),
        (lambda: mm(a, [[1.0]], bias), TypeError, r"b must be a tensor, got list"),
        (lambda: rms(x, torch.ones(9, **f32)), ValueError,
         r"weight must be \(features,\) = \(8,\), got \(9,\)"),
        (lambda: rms(x, torch.ones(7, **f32)), ValueError, r"got \(7,\)"),
        (lambda: rms(x[None], w), ValueError, r"x must be 2-D"),
        (lambda: rms(x.long(), w.long()), TypeError, r"float32 or bfloat16, got torch.int64"),
        (lambda: rms(x, w.bfloat16()), TypeError, r"got torch.float32 and torch.bfloat16"),
        (lambda: rms(x, w, rows_per_program=0), ValueError,
         r"rows_per_program must be a positive int, got 0"),
        (lambda: sm(x[None]), ValueError, r"x must be a 2-D tensor .*\(1, 4, 8\)"),
        (lambda: sm(x[0]), ValueError, r"got \(8,\)"),
        (lambda: sm(x.long()), TypeError, r"float32 or bfloat16, got torch.int64"),
        (lambda: sm(x, 0), ValueError, r"rows_per_program must be a positive int, got 0"),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_examples_reject_bad_input_before_launching(device):
    # Each of these used to launch: a (4,5) @ (6,3) returned a (4,3) result,
    # an unknown activation was ignored, a weight of 9 was cut to 8, one of 7
    # failed only at synchronization, an int64 softmax truncated its result.
    for call, error, message in _bad_inputs(device):
        with pytest.raises(error, match=message):
            call()
    torch.kiln.synchronize()  # no launch left a device error behind
