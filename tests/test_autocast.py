"""torch.autocast(device_type="kiln"): CUDA's cast policies, the autocast
dtype API, custom_fwd/custom_bwd."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_same


@pytest.fixture
def operands():
    torch.manual_seed(0)
    return torch.randn(8, 8), torch.randn(8, 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_policies(operands, dtype):
    a, b = operands
    ka, kb = a.to("kiln"), b.to("kiln")
    with torch.autocast(device_type="kiln", dtype=dtype):
        # lower precision: matmul family, linear, conv, SDPA
        mm = ka @ kb
        lin = F.linear(ka, kb)
        bmm = torch.bmm(ka[None], kb[None])
        conv = F.conv2d(ka[None, None], kb[None, None, :3, :3])
        q = ka.reshape(1, 1, 8, 8)
        sdpa = F.scaled_dot_product_attention(q, q, q)
        # float32: softmax, log_softmax, layer_norm, losses, exp/log/pow
        soft = torch.softmax(mm, -1)
        logsoft = F.log_softmax(mm, -1)
        ln = F.layer_norm(mm, (8,))
        loss = F.mse_loss(mm, lin)
        ex = torch.exp(mm)
        # promote: widest input type
        prom = torch.addcmul(ka, mm, kb)
        cat = torch.cat([mm, ka])
    for t in (mm, lin, bmm, conv, sdpa):
        assert t.dtype == dtype
    for t in (soft, logsoft, ln, loss, ex, prom, cat):
        assert t.dtype == torch.float32
    # Same math as casting by hand on CPU.
    assert_same(mm, a.to(dtype) @ b.to(dtype))
    assert_same(soft, torch.softmax((a.to(dtype) @ b.to(dtype)).float(), -1))


def test_autocast_dtype_api():
    assert torch.amp.is_autocast_available("kiln")
    assert torch.get_autocast_dtype("kiln") == torch.float16  # PyTorch's default for accelerators
    torch.set_autocast_dtype("kiln", torch.bfloat16)
    try:
        assert torch.get_autocast_dtype("kiln") == torch.bfloat16
        with torch.autocast("kiln"):
            assert torch.is_autocast_enabled("kiln")
            x = torch.ones(2, 2, device="kiln")
            assert (x @ x).dtype == torch.bfloat16
    finally:
        torch.set_autocast_dtype("kiln", torch.float16)
    assert torch.kiln.get_amp_supported_dtype() == [torch.float16, torch.bfloat16, torch.float32]
    assert torch.kiln.is_bf16_supported()


def test_unsupported_dtype_warns_and_disables():
    x = torch.ones(2, 2, device="kiln")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("kiln", dtype=torch.float64):
            assert not torch.is_autocast_enabled("kiln")
            assert (x @ x).dtype == torch.float32
    assert any("not supported" in str(w.message) for w in caught)


def test_binary_cross_entropy_is_banned_as_on_cuda():
    p = torch.rand(4, device="kiln")
    with torch.autocast("kiln"):
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(p, p)


def test_custom_fwd_and_bwd():
    class Square(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="kiln", cast_inputs=torch.float32)
        def forward(ctx, x):
            ctx.save_for_backward(x)
            assert not torch.is_autocast_enabled("kiln")  # cast_inputs disables autocast inside
            return x * x

        @staticmethod
        @torch.amp.custom_bwd(device_type="kiln")
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 2 * x * grad

    x = torch.randn(5, device="kiln", dtype=torch.float16, requires_grad=True)
    with torch.autocast("kiln"):
        y = Square.apply(x)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.dtype == torch.float16


def test_autocast_training_step_runs_in_both_precisions():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to("kiln")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 16, device="kiln")
    y = torch.randint(0, 4, (8,), device="kiln")
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("kiln", dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        assert loss.dtype == torch.float32
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())


# --- torch.kiln.amp: torch.cuda.amp's deprecated spellings ---------------------

@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_kiln_amp_autocast_is_torch_autocast_with_cudas_defaults_and_warning(device, operands):
    a, b = (t.to(device) for t in operands)
    with pytest.warns(FutureWarning, match=r"`torch.kiln.amp.autocast\(args...\)` is deprecated. "
                                           r"Please use `torch.amp.autocast\('kiln', args...\)`"):
        ctx = torch.kiln.amp.autocast()
    with ctx:
        assert torch.is_autocast_enabled("kiln")
        assert torch.get_autocast_dtype("kiln") == torch.float16  # CUDA's default
        out = a @ b
    with torch.autocast("kiln", dtype=torch.float16):
        expected = a @ b
    assert out.dtype == torch.float16
    assert_same(out, expected.cpu())
    with pytest.warns(FutureWarning):
        with torch.kiln.amp.autocast(dtype=torch.bfloat16, cache_enabled=False):
            assert (a @ b).dtype == torch.bfloat16
    with pytest.warns(FutureWarning):
        with torch.kiln.amp.autocast(enabled=False):
            assert (a @ b).dtype == torch.float32


def test_kiln_amp_autocast_decorates_and_keeps_cudas_signature():
    import inspect
    with pytest.warns(FutureWarning):
        @torch.kiln.amp.autocast()
        def matmul(x, y):
            return x @ y
    x = torch.randn(4, 4, device="kiln")
    assert matmul(x, x).dtype == torch.float16
    assert list(inspect.signature(torch.kiln.amp.autocast).parameters) == [
        "enabled", "dtype", "cache_enabled"]
    import torch.kiln.amp as imported
    assert imported is torch.kiln.amp and issubclass(torch.kiln.amp.autocast, torch.autocast)


def test_kiln_amp_custom_fwd_and_bwd_warn_and_work():
    with pytest.warns(FutureWarning, match="torch.kiln.amp.custom_fwd"):
        fwd = torch.kiln.amp.custom_fwd(cast_inputs=torch.float32)
    with pytest.warns(FutureWarning, match="torch.kiln.amp.custom_bwd"):
        bwd = torch.kiln.amp.custom_bwd

        class Square(torch.autograd.Function):
            @staticmethod
            @fwd
            def forward(ctx, x):
                ctx.save_for_backward(x)
                assert not torch.is_autocast_enabled("kiln")
                return x * x

            @staticmethod
            @bwd
            def backward(ctx, grad):
                (x,) = ctx.saved_tensors
                return 2 * x * grad

    x = torch.randn(5, device="kiln", dtype=torch.float16, requires_grad=True)
    with torch.autocast("kiln"):
        y = Square.apply(x)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert_same(x.grad, (2 * x.detach().float()).half().cpu())
