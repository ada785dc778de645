"""Gradients through the kl causal attention (examples/kernels/kl_attention.py
and kl_attention_backward.py: FlashAttention-2's backward in three kl
kernels) against F.scaled_dot_product_attention(is_causal=True)'s backward
on the CPU: float32, bfloat16 and float16 inputs, ragged sequence lengths,
blocks that do not divide seq, unequal query and key blocks, kiln:0,
kiln:1, CPU tensors (the simulator), a side stream, torch.compile
(fullgraph), a finite-difference spot check of the kernels against their
own forward, opcheck, and the errors of bad input.

kl has no float64, so torch.autograd.gradcheck is not possible: float32
gradients are compared with SDPA's within 1e-4 (the kernels sum in another
order: measured differences below 1e-6 on these inputs), 16-bit ones with
float32 SDPA on the same (rounded) inputs within 2e-2 (the forward's output
is rounded to the input dtype before the backward reads it, as it is for
SDPA in that dtype).
"""

import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F

from kl_helpers import private_kernel_cache  # noqa: F401
from quick_shard import rotate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from examples.kernels import kl_attention  # noqa: E402

DEVICES = ["kiln:0", "kiln:1", "cpu"]  # cpu: the simulator


@pytest.fixture(autouse=True)
def _cache(private_kernel_cache):  # noqa: F811
    yield


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def tol(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def inputs(shape, dtype, seeds=(0, 1, 2, 3)):
    """q, k, v and the output's gradient, CPU tensors of ``dtype``."""
    return [randn(*shape, dtype=dtype, seed=s) for s in seeds]


def sdpa_grads(q, k, v, grad_out):
    """SDPA's output and (dq, dk, dv) in float32 on the CPU."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(grad_out.float())
    return out.detach(), (q.grad, k.grad, v.grad)


def kl_grads(q, k, v, grad_out, device, block):
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    out = kl_attention.causal_attention(q, k, v, block=block)
    out.backward(grad_out.to(device))
    return out.detach().cpu(), [t.grad.cpu() for t in (q, k, v)]


def assert_grads_match(q, k, v, grad_out, got_out, got_grads):
    want_out, want_grads = sdpa_grads(q, k, v, grad_out)
    torch.testing.assert_close(got_out.float(), want_out, **tol(q.dtype))
    for name, got, want, x in zip("qkv", got_grads, want_grads, (q, k, v)):
        assert got.dtype == x.dtype and got.shape == x.shape, name
        torch.testing.assert_close(got.float(), want, **tol(q.dtype), msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("shape,block,device,dtype", rotate([  # each device and dtype once in `make test`
    ((2, 3, 100, 16), (32, 32)),  # ragged: 100 is not a multiple of 32
    ((1, 2, 37, 24), (16, 8)),    # head_dim 24, query and key blocks differ
    ((1, 1, 70, 8), (64, 64)),    # the default block size, one full and one ragged block
], DEVICES, [torch.float32, torch.bfloat16], per_case=2))
def test_gradients_match_sdpa(device, dtype, shape, block):
    q, k, v, grad_out = inputs(shape, dtype)
    out, grads = kl_grads(q, k, v, grad_out, device, block)
    assert_grads_match(q, k, v, grad_out, out, grads)


def test_float16_and_the_default_block():
    q, k, v, grad_out = inputs((1, 2, 150, 8), torch.float16)
    qk, kk, vk = (t.to("kiln").requires_grad_() for t in (q, k, v))
    out = kl_attention.causal_attention(qk, kk, vk)
    out.backward(grad_out.to("kiln"))
    assert_grads_match(q, k, v, grad_out, out.detach().cpu(), [t.grad.cpu() for t in (qk, kk, vk)])


@pytest.mark.parametrize("device", ["kiln:1", pytest.param("kiln:0", marks=pytest.mark.slow)])
def test_head_dim_128_the_tile_models_limit(device):
    q, k, v, grad_out = inputs((1, 1, 40, 128), torch.float32)
    out, grads = kl_grads(q, k, v, grad_out, device, (32, 32))
    assert_grads_match(q, k, v, grad_out, out, grads)


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_strided_inputs_as_a_model_makes_them(device):
    # (batch, seq, heads, head_dim) projections viewed as (batch, heads, seq,
    # head_dim), as examples/train_char_gpt.py does, and a (batch * heads,
    # seq, head_dim) 3-D call.
    q, k, v, grad_out = (t.transpose(1, 2) for t in inputs((2, 50, 4, 16), torch.float32))
    out, grads = kl_grads(q, k, v, grad_out, device, (32, 32))
    assert_grads_match(q, k, v, grad_out, out, grads)
    q3, k3, v3, g3 = (t.reshape(8, 50, 16) for t in (q, k, v, grad_out))
    out, grads = kl_grads(q3, k3, v3, g3, device, (32, 32))
    assert_grads_match(q3, k3, v3, g3, out, grads)


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("non_blocking", [False, True])
def test_side_stream(device, non_blocking):
    q, k, v, grad_out = inputs((2, 2, 100, 16), torch.float32)
    stream = torch.kiln.Stream(device)
    with torch.kiln.stream(stream):
        args = [t.pin_memory().to(device, non_blocking=non_blocking) for t in (q, k, v)]
        qk, kk, vk = (t.requires_grad_() for t in args)
        g = grad_out.pin_memory().to(device, non_blocking=non_blocking)
        out = kl_attention.causal_attention(qk, kk, vk, block=(32, 32))
        out.backward(g)
        got = [t.to("cpu", non_blocking=non_blocking) for t in (out.detach(), qk.grad,
                                                                 kk.grad, vk.grad)]
    stream.synchronize()
    assert_grads_match(q, k, v, grad_out, got[0], got[1:])


@pytest.mark.parametrize("device", ["kiln:0", "cpu"])
@pytest.mark.parametrize("requires", ["q", "k", "v"])
def test_gradient_of_one_input(device, requires):
    q, k, v, grad_out = inputs((1, 2, 45, 16), torch.float32)
    args = {"q": q.to(device), "k": k.to(device), "v": v.to(device)}
    args[requires].requires_grad_()
    out = kl_attention.causal_attention(args["q"], args["k"], args["v"], block=(32, 32))
    out.backward(grad_out.to(device))
    _, want = sdpa_grads(q, k, v, grad_out)
    torch.testing.assert_close(args[requires].grad.cpu(), want["qkv".index(requires)],
                               **tol(torch.float32))
    for name in "qkv":
        if name != requires:
            assert args[name].grad is None


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_under_torch_compile_fullgraph(device, fresh_compile):
    def loss(q, k, v, w):
        return (kl_attention.causal_attention(q.sin(), k, v * 2, block=(32, 32)) * w).sum()

    compiled = torch.compile(loss, fullgraph=True)
    # A second sequence length recompiles with seq dynamic (symbolic shapes
    # in the operators' fake implementations).
    for seq in (100, 70):
        q, k, v, grad_out = inputs((2, 2, seq, 16), torch.float32)
        qk, kk, vk = (t.to(device).requires_grad_() for t in (q, k, v))
        compiled(qk, kk, vk, grad_out.to(device)).backward()
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        (F.scaled_dot_product_attention(qr.sin(), kr, vr * 2, is_causal=True) * grad_out).sum() \
            .backward()
        for got, want in zip((qk, kk, vk), (qr, kr, vr)):
            torch.testing.assert_close(got.grad.cpu(), want.grad, **tol(torch.float32))


def test_finite_differences_of_the_kl_forward():
    # The backward kernels against the forward kernel itself, not SDPA:
    # central differences of sum(out * w) in float32 at a few elements
    # (step 1e-2: truncation and rounding errors both about 1e-4 here).
    q, k, v, w = (t.to("kiln") for t in inputs((1, 2, 37, 16), torch.float32))
    args = [t.clone().requires_grad_() for t in (q, k, v)]
    (kl_attention.causal_attention(*args, block=(32, 32)) * w).sum().backward()
    picks = torch.randint(0, q.numel(), (4,), generator=torch.Generator().manual_seed(7))
    eps = 1e-2
    for i, x in enumerate((q, k, v)):
        for flat in picks.tolist():
            index = torch.unravel_index(torch.tensor(flat), x.shape)
            values = []
            for sign in (1, -1):
                moved = [t.clone() for t in (q, k, v)]
                moved[i][index] += sign * eps
                values.append((kl_attention.causal_attention(*moved, block=(32, 32)) * w)
                              .sum().item())
            numeric = (values[0] - values[1]) / (2 * eps)
            analytic = args[i].grad[index].item()
            assert abs(numeric - analytic) <= 2e-3 + 1e-2 * abs(analytic), \
                ("qkv"[i], index, numeric, analytic)


def test_empty_inputs():
    for shape in [(2, 0, 8), (0, 5, 8), (1, 3, 0, 8)]:
        q = torch.randn(*shape, device="kiln", requires_grad=True)
        out = kl_attention.causal_attention(q, q, q)  # the default block, (64, 64)
        out.sum().backward()
        assert out.shape == q.shape and q.grad.shape == q.shape


def test_opcheck():
    q, k, v = (t.to("kiln") for t in inputs((3, 40, 16), torch.float32)[:3])
    torch.library.opcheck(kl_attention.causal_attention_forward, (q, k, v, 32, 16),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    out, lse = kl_attention.causal_attention_forward(q, k, v, 32, 16)
    torch.library.opcheck(kl_attention.causal_attention_backward,
                          (v.cos(), q, k, v, out, lse, 32, 16),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    # PyTorch's test_autograd_registration supports only CPU/CUDA/XPU tensors:
    # the CPU implementation (the simulator) has the same registration.
    q, k, v = (t.cpu().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(kl_attention.causal_attention_forward, (q, k, v, 32, 16),
                          test_utils=("test_autograd_registration",))


@pytest.mark.parametrize("make,error,message", [
    (lambda: [torch.randn(1, 40, 129, device="kiln")] * 3, ValueError,
     r"head_dim is 129; the kl kernels allow 1 to 128"),
    (lambda: [torch.randn(1, 40, 8, device="kiln"), torch.randn(1, 41, 8, device="kiln"),
              torch.randn(1, 40, 8, device="kiln")], ValueError,
     r"q, k and v must have the same shape, got q \(1, 40, 8\), k \(1, 41, 8\)"),
    (lambda: [torch.randn(40, 8, device="kiln")] * 3, ValueError,
     r"q must be \(batch, heads, seq, head_dim\) or \(batch \* heads, seq, head_dim\), got "
     r"shape \(40, 8\)"),
    (lambda: [torch.randn(1, 40, 8, device="kiln", dtype=torch.float64)] * 3, TypeError,
     r"one dtype of float32, bfloat16 or float16, got torch.float64"),
])
def test_bad_input_is_a_clear_error(make, error, message):
    with pytest.raises(error, match=message):
        kl_attention.causal_attention(*make())


@pytest.mark.parametrize("block", [(256, 64), (64,), (0, 64), (32.0, 32)])
def test_bad_block_is_a_clear_error(block):
    q = torch.randn(1, 40, 8, device="kiln")
    with pytest.raises(ValueError, match=r"block must be two ints \(queries, keys\) in 1 to 128, "
                                         r"got " + re.escape(repr(block))):
        kl_attention.causal_attention(q, q, q, block=block)
