"""Kiln convolutions under FakeTensorMode get the strides kiln's kernel gives
(torch_kiln/compiler/fake_convolution.py): CPU's, since kiln runs CPU's
convolution kernel. Before, a channels-last weight or input gave a
channels-last result on the device and a contiguous one in the trace, and a
compiled conv2d failed Inductor's assert_size_stride.
"""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

aten = torch.ops.aten
CL = torch.channels_last
CONTIGUOUS = torch.contiguous_format

# (input format, weight format, dtype): the dtypes pick different CPU
# backends (oneDNN for float32, slow_conv2d for int64 and float64).
FORMATS = [(CONTIGUOUS, CL, torch.float32), (CL, CONTIGUOUS, torch.float32),
           (CONTIGUOUS, CONTIGUOUS, torch.float32), (CONTIGUOUS, CL, torch.int64),
           (CL, CL, torch.float64)]


def _tensor(shape, dtype, device, memory_format):
    t = torch.randn(shape, dtype=torch.float64).mul(4).to(dtype)
    return t.to(device).contiguous(memory_format=memory_format)


def _fake(fn, *tensors):
    with FakeTensorMode() as mode:
        return fn(*(mode.from_tensor(t) for t in tensors))


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("input_format,weight_format,dtype", FORMATS)
def test_fake_strides_are_the_kernels(device, transposed, input_format, weight_format, dtype):
    x = _tensor((2, 3, 6, 6), dtype, device, input_format)
    w = _tensor((3, 4, 3, 3) if transposed else (4, 3, 3, 3), dtype, device, weight_format)

    def forward(x, w):
        return aten.convolution(x, w, None, [1, 1], [1, 1], [1, 1], transposed, [0, 0], 1)

    out = forward(x, w)
    fake = _fake(forward, x, w)
    assert (fake.device, fake.shape, fake.stride()) == (out.device, out.shape, out.stride())
    cpu = forward(x.cpu(), w.cpu())
    assert out.stride() == cpu.stride()

    if dtype.is_floating_point:
        go = torch.randn_like(out)

        def backward(go, x, w):
            return aten.convolution_backward(go, x, w, [w.shape[1] if transposed else w.shape[0]],
                                             [1, 1], [1, 1], [1, 1], transposed, [0, 0], 1,
                                             [True, True, True])

        grads = backward(go, x, w)
        fakes = _fake(backward, go, x, w)
        for real, fake in zip(grads, fakes):
            assert (fake.device, fake.shape, fake.stride()) == (real.device, real.shape,
                                                                real.stride())


def test_cpu_convolutions_keep_fake_tensor_mode_rule():
    x = torch.randn(2, 3, 6, 6)
    w = torch.randn(4, 3, 3, 3).contiguous(memory_format=CL)
    fake = _fake(lambda x, w: F.conv2d(x, w), x, w)
    assert fake.device.type == "cpu"
    assert fake.stride() == F.conv2d(x, w).stride()


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_compiled_conv2d_with_channels_last_weight(device, tmp_path, monkeypatch):
    """The OpInfo case that failed: conv2d with a channels-last weight,
    forward and backward, compiled with Inductor."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    x = torch.randn(2, 3, 8, 8, device=device, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, device=device).contiguous(memory_format=CL).requires_grad_()

    def fn(x, w):
        return F.conv2d(x, w, padding=1).relu() * 2

    out = torch.compile(fn)(x, w)
    ref = fn(x, w)
    assert out.device == torch.device(device)
    assert out.stride() == ref.stride()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.sum(), (x, w))
    ref_grads = torch.autograd.grad(ref.sum(), (x, w))
    for g, r in zip(grads, ref_grads):
        assert g.stride() == r.stride()
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
