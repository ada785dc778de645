"""Ops whose meta kernels disagree with their CPU kernels about output
layouts still give CPU's values, dtypes and strides on kiln (Note [Meta
layouts and CPU layouts], Note [Verifying meta kernels]). Each case was a
wrong value or an error before."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import assert_same, run_python


def test_batch_norm_on_transposed_input_trains_like_cpu():
    torch.manual_seed(0)
    h = torch.randn(2, 5, 3)
    cpu_bn, kiln_bn = nn.BatchNorm1d(3), nn.BatchNorm1d(3).to("kiln")
    x_cpu = h.transpose(1, 2).requires_grad_()
    x_kiln = h.to("kiln").transpose(1, 2).detach().requires_grad_()
    out_cpu, out_kiln = cpu_bn(x_cpu), kiln_bn(x_kiln)
    assert_same(out_kiln, out_cpu.detach())
    assert_same(kiln_bn.running_mean, cpu_bn.running_mean)
    assert_same(kiln_bn.running_var, cpu_bn.running_var)
    out_cpu.pow(2).sum().backward()
    out_kiln.pow(2).sum().backward()
    assert_same(x_kiln.grad, x_cpu.grad)


def test_native_batch_norm_statistics_in_train_and_eval():
    x = torch.randn(2, 3, 4, 4).transpose(2, 3)
    for training in (True, False):
        args = (None, None, torch.zeros(3), torch.ones(3), training, 0.1, 1e-5)
        cpu = torch.native_batch_norm(x, *args)
        kiln = torch.native_batch_norm(x.to("kiln"), *[a.to("kiln") if isinstance(a, torch.Tensor) else a for a in args])
        for k, c in zip(kiln, cpu):
            assert_same(k, c)


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
def test_padding_channels_last(mode):
    x = torch.arange(16.0).view(1, 2, 2, 4).contiguous(memory_format=torch.channels_last)
    cpu = F.pad(x, (1, 1, 1, 1), mode=mode)
    kiln = F.pad(x.to("kiln"), (1, 1, 1, 1), mode=mode)
    assert_same(kiln, cpu)
    assert kiln.stride() == cpu.stride()


def test_max_unpool_and_conv_channels_last():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    out, idx = F.max_pool2d(x, 2, return_indices=True)
    assert_same(F.max_unpool2d(out.to("kiln"), idx.to("kiln"), 2), F.max_unpool2d(out, idx, 2))
    w = torch.randn(5, 3, 3, 3)
    cpu, kiln = F.conv2d(x, w), F.conv2d(x.to("kiln"), w.to("kiln"))
    assert_same(kiln, cpu)
    assert kiln.stride() == cpu.stride()


def test_complex_solve_from_the_right():
    torch.manual_seed(0)
    a = torch.randn(3, 3, dtype=torch.complex64)
    b = torch.randn(4, 3, dtype=torch.complex64)
    assert_same(torch.linalg.solve(a.to("kiln"), b.to("kiln"), left=False),
                torch.linalg.solve(a, b, left=False).resolve_conj())


def test_logsigmoid_gradient_on_non_contiguous_input():
    x = torch.randn(4, 5).mT.contiguous().mT
    grads = []
    for device in ("cpu", "kiln"):
        leaf = x.to(device).detach().requires_grad_()
        F.logsigmoid(leaf).sum().backward()
        grads.append(leaf.grad)
    assert_same(grads[1], grads[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_norms(dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 8).to(dtype)
    assert_same(nn.LayerNorm(8).to(dtype).to("kiln")(x.to("kiln")), nn.LayerNorm(8).to(dtype)(x))
    assert_same(nn.BatchNorm1d(8).to(dtype).to("kiln")(x.to("kiln")), nn.BatchNorm1d(8).to(dtype)(x))


def test_reducing_losses_and_embedding_bag():
    torch.manual_seed(0)
    p, t = torch.rand(6), torch.rand(6)
    for reduction in ("mean", "sum", "none"):
        assert_same(F.binary_cross_entropy(p.to("kiln"), t.to("kiln"), reduction=reduction),
                    F.binary_cross_entropy(p, t, reduction=reduction))
        assert_same(F.huber_loss(p.to("kiln"), t.to("kiln"), reduction=reduction),
                    F.huber_loss(p, t, reduction=reduction))
    w = torch.randn(10, 3)
    idx, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4])
    for mode in ("sum", "mean", "max"):
        assert_same(F.embedding_bag(idx.to("kiln"), w.to("kiln"), offsets.to("kiln"), mode=mode),
                    F.embedding_bag(idx, w, offsets, mode=mode))


def test_layout_checks_happen_once_per_kind_of_input():
    torch.kiln.clear_op_tracking()
    for n in (8, 16, 32):  # new sizes, same kind of input: one check at most
        torch.relu(torch.randn(n, 8, device="kiln"))
    sync = torch.kiln.get_sync_ops()
    assert set(sync) <= {"aten::relu (layout check)"} and sum(sync.values()) <= 1
    torch.kiln.clear_op_tracking()
    torch.relu(torch.randn(64, 8, device="kiln"))
    assert torch.kiln.get_sync_ops() == {}
    assert torch.kiln.get_executed_ops().get("aten::relu") == 1


def test_empty_out_tensors_take_cpus_layout():
    x = torch.randn(4, 6).t()
    assert torch.abs(x.to("kiln")).stride() == torch.abs(x).stride() == (1, 6)
    kiln_out, cpu_out = torch.empty(0, device="kiln"), torch.empty(0)
    torch.neg(x.to("kiln"), out=kiln_out)
    torch.neg(x, out=cpu_out)
    assert kiln_out.stride() == cpu_out.stride()
    assert_same(kiln_out, cpu_out)
    a = torch.randn(5, 5)
    q, r = torch.empty(0, device="kiln"), torch.empty(0, device="kiln")
    torch.linalg.qr(a.to("kiln"), out=(q, r))
    cq, cr = torch.linalg.qr(a)
    assert q.stride() == cq.stride()
    assert_same(q, cq)
    assert_same(r, cr)


def test_ops_whose_generic_kernel_picks_a_device_kernel():
    z = torch.randn(3, dtype=torch.complex64)
    k = z.to("kiln")
    k.conj_physical_()
    assert_same(k, z.conj_physical())
    a = torch.randn(4, 5)
    values, indices = torch.empty(0, device="kiln"), torch.empty(0, dtype=torch.long, device="kiln")
    torch.mode(a.to("kiln"), out=(values, indices))
    assert_same(values, torch.mode(a).values)
    assert_same(indices, torch.mode(a).indices)


def test_sdpa_with_a_mask_that_needs_a_gradient():
    torch.manual_seed(0)
    tensors = [torch.randn(2, 4, 3, s) for s in (8, 8, 8, 3)]
    grads = []
    for device in ("cpu", "kiln"):
        q, k, v, m = (t.detach().to(device).requires_grad_() for t in tensors)
        F.scaled_dot_product_attention(q, k, v, attn_mask=m).sum().backward()
        grads.append(m.grad)
    assert_same(grads[1], grads[0])


def test_group_norm_on_channels_last_input_takes_cudas_backward():
    """PyTorch's derivative of native_group_norm keeps a channels-last
    layout only on the CPU; on kiln, as on CUDA, it makes the gradient and
    input contiguous, so kiln runs CPU's contiguous backward kernel where CPU
    runs its channels-last one (docs/porting.md, "Numbers"). The forward is
    CPU's, layout included, and the backward is exactly that kernel's."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 7, 9).contiguous(memory_format=torch.channels_last)
    grad = torch.randn(2, 4, 7, 9)
    w = torch.randn(4)
    x_kiln = x.to("kiln").requires_grad_()
    w_kiln = w.to("kiln").requires_grad_()
    out = F.group_norm(x_kiln, 2, w_kiln)
    out.backward(grad.to("kiln"))
    cpu_out, mean, rstd = torch.ops.aten.native_group_norm(x, w, None, 2, 4, 63, 2, 1e-5)
    assert_same(out.detach(), cpu_out)
    assert out.is_contiguous(memory_format=torch.channels_last)
    grad_input, grad_weight, _ = torch.ops.aten.native_group_norm_backward(
        grad.contiguous(), x.contiguous(), mean, rstd, w, 2, 4, 63, 2, [True, True, False])
    assert_same(x_kiln.grad, grad_input)
    assert_same(w_kiln.grad, grad_weight)
    # A contiguous input gives CPU's bits.
    x_kiln = x.contiguous().to("kiln").requires_grad_()
    x_cpu = x.contiguous().requires_grad_()
    F.group_norm(x_kiln, 2, w.to("kiln")).backward(grad.to("kiln"))
    F.group_norm(x_cpu, 2, w).backward(grad)
    assert_same(x_kiln.grad, x_cpu.grad)


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_pixel_shuffle_keeps_channels_last_as_on_cpu(device):
    """pixel_shuffle and pixel_unshuffle have a CPU kernel, which keeps a
    channels-last input's format, and a generic one, which kiln ran before:
    contiguous outputs (strides (96, 48, 8, 1) for CPU's (96, 1, 16, 2))."""
    x = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last).requires_grad_()
    x_kiln = x.detach().to(device).requires_grad_()
    for op, factor in ((F.pixel_shuffle, 2), (F.pixel_unshuffle, 2)):
        out, out_kiln = op(x, factor), op(x_kiln, factor)
        assert out_kiln.stride() == out.stride()
        assert_same(out_kiln, out.detach())
        grad = torch.randn_like(out)
        (x_grad,) = torch.autograd.grad(out, x, grad)
        (x_grad_kiln,) = torch.autograd.grad(out_kiln, x_kiln, grad.to(device))
        assert x_grad_kiln.stride() == x_grad.stride()
        assert_same(x_grad_kiln, x_grad)


def test_a_first_call_on_degenerate_shapes_does_not_vouch_for_the_meta_kernel():
    """A (1, 1) result agrees with any dimension order: after linalg.eig of a
    1x1 matrix first, a 2x2 matrix's eigenvectors came out row-major where
    CPU's are column-major (Note [Verifying meta kernels]). A fresh process,
    so that the 1x1 call is the first of its kind."""
    result = run_python(
        "import torch, torch_kiln\n"
        "for shape in [(1, 1), (2, 2), (1, 3, 3), (4, 4)]:\n"
        "    m = torch.randn(*shape)\n"
        "    cpu, kiln = torch.linalg.eig(m)[1], torch.linalg.eig(m.to('kiln'))[1]\n"
        "    assert kiln.stride() == cpu.stride(), (shape, kiln.stride(), cpu.stride())\n"
        "    assert torch.equal(kiln.cpu(), cpu), shape\n"
        "print('ok')\n")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
