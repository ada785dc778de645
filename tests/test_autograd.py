"""Autograd on kiln gives CPU's gradients: backward of model ops,
retain_graph, hooks, no_grad, inference_mode, gradient accumulation, and
weight tying across .to("kiln")."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import assert_same


def grads_of(fn, device, *inputs):
    leaves = [t.detach().clone().to(device).requires_grad_() for t in inputs]
    fn(*leaves).backward()
    return [leaf.grad for leaf in leaves]


def check(fn, *inputs):
    for k, c in zip(grads_of(fn, "kiln", *inputs), grads_of(fn, "cpu", *inputs)):
        assert_same(k, c)


def test_backward_of_common_model_ops():
    torch.manual_seed(0)
    x, w, b = torch.randn(8, 5), torch.randn(4, 5), torch.randn(4)
    check(lambda x, w, b: F.linear(x, w, b).relu().sum(), x, w, b)
    check(lambda x, w, b: F.gelu(F.linear(x, w, b)).pow(2).mean(), x, w, b)
    check(lambda x: F.log_softmax(x, -1).sum(), x)
    check(lambda x: F.layer_norm(x, (5,)).tanh().sum(), x)
    check(lambda x: F.cross_entropy(x, torch.tensor([0, 1, 2, 3, 4, 0, 1, 2], device=x.device)), x)
    img, k = torch.randn(2, 3, 9, 9), torch.randn(4, 3, 3, 3)
    check(lambda img, k: F.max_pool2d(F.conv2d(img, k, padding=1).relu(), 2).sum(), img, k)
    q = torch.randn(2, 4, 6, 8)
    check(lambda q: F.scaled_dot_product_attention(q, q * 0.5, q + 1, is_causal=True).sum(), q)
    emb = torch.randn(10, 3)
    check(lambda e: F.embedding(torch.tensor([[1, 2], [2, 9]], device=e.device), e).sum(), emb)


def test_retain_graph_and_accumulation():
    for device in ("cpu", "kiln"):
        x = torch.arange(4.0, device=device, requires_grad=True)
        y = (x * x).sum()
        y.backward(retain_graph=True)
        y.backward()
        assert x.grad.tolist() == [0.0, 4.0, 8.0, 12.0]


def test_hooks_run_on_kiln_gradients():
    x = torch.ones(3, device="kiln", requires_grad=True)
    seen = []
    x.register_hook(lambda g: seen.append(g.device) or g * 10)
    (x * 2).sum().backward()
    assert seen == [torch.device("kiln:0")]
    assert x.grad.tolist() == [20.0, 20.0, 20.0]


def test_no_grad_and_inference_mode():
    x = torch.ones(3, device="kiln", requires_grad=True)
    with torch.no_grad():
        y = x * 2
    assert not y.requires_grad
    with torch.inference_mode():
        z = x * 3
    assert z.is_inference() and z.sum().item() == 9.0


# Factories whose CPU kernel resizes and fills an out= tensor (arange, eye,
# range), and modules built on them, under torch.inference_mode(): the host
# tensors kiln makes there are inference tensors, which the kernel on the
# stream worker may fill only in inference mode (Note [Kiln tasks run in the
# issuer's inference and grad mode]). Each case runs first inside the mode (no layout
# cached yet), then again; on kiln:0 and kiln:1, default and side stream.
INFERENCE_CASES = {
    "arange float": lambda d: torch.arange(4.0, device=d),
    "arange long (position ids)": lambda d: torch.arange(0, 6, dtype=torch.long,
                                                         device=d).unsqueeze(0),
    "arange step": lambda d: torch.arange(1, 2.5, 0.25, device=d),
    "eye": lambda d: torch.eye(3, 5, device=d),
    "range": lambda d: torch.range(0, 3, device=d),
    "linspace": lambda d: torch.linspace(0, 1, 7, device=d),
    "EmbeddingBag": lambda d: nn.EmbeddingBag(10, 3, mode="sum").to(d)(
        torch.tensor([1, 2, 4, 5, 4, 3], device=d), torch.tensor([0, 3], device=d)),
}


@pytest.mark.filterwarnings("ignore:torch.range is deprecated")
@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
def test_factories_and_modules_under_inference_mode(device, side_stream):
    for name, make in INFERENCE_CASES.items():
        torch.manual_seed(0)
        want = make("cpu")
        for attempt in range(2):
            torch.manual_seed(0)
            stream = torch.kiln.Stream(device) if side_stream else torch.kiln.current_stream(device)
            with torch.inference_mode(), torch.kiln.stream(stream):
                got = make(device)
                assert got.is_inference(), name
                assert_same(got.cpu(), want), f"{name}, call {attempt}"
            torch.kiln.synchronize(device)


def test_tied_weights_stay_tied_after_to():
    head = nn.Linear(4, 10, bias=False)
    emb = nn.Embedding(10, 4)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    weight = emb.weight
    model.to("kiln")
    assert model["head"].weight is model["emb"].weight is weight
    idx = torch.tensor([[1, 2, 3]], device="kiln")
    model["head"](model["emb"](idx)).sum().backward()
    expected_model = nn.ModuleDict({"emb": nn.Embedding(10, 4), "head": nn.Linear(4, 10, bias=False)})
    expected_model["emb"].weight.data.copy_(weight.detach().cpu())
    expected_model["head"].weight = expected_model["emb"].weight
    expected_model["head"](expected_model["emb"](idx.cpu())).sum().backward()
    assert_same(weight.grad, expected_model["emb"].weight.grad)


def test_dropout_matches_cpu_forward_and_backward():
    x0 = torch.randn(1000)
    for p in (0.1, 0.3, 0.5):
        results = []
        for device in ("cpu", "kiln"):
            x = x0.clone().to(device).requires_grad_()
            torch.manual_seed(1)
            y = F.dropout(x, p)
            y.sum().backward()
            results.append((y.detach().cpu(), x.grad.cpu()))
        assert_same(results[1][0], results[0][0])
        assert_same(results[1][1], results[0][1])
    torch.manual_seed(1)
    a = F.dropout(torch.ones(1000, device="kiln"), 0.5)
    torch.manual_seed(1)
    b = F.dropout(torch.ones(1000, device="kiln"), 0.5)
    assert_same(a, b.cpu())
    dropped = (a == 0).sum().item()
    assert 350 <= dropped <= 650


def test_reduced_losses_and_their_backward_warn_no_more_than_on_cpu():
    import warnings
    losses = [F.mse_loss, F.smooth_l1_loss, F.huber_loss]

    def run(device):
        torch.manual_seed(0)
        x = torch.randn(4, 3, device=device, requires_grad=True)
        target = torch.randn(4, 3, device=device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            values = []
            for loss_fn in losses:
                loss = loss_fn(x, target)  # 0-dim: the structured out= kernel's own output
                loss.backward()
                values.append(loss.detach())
            torch.kiln.synchronize()  # device warnings surface here
        return values + [x.grad], [str(w.message) for w in caught]

    kiln_values, kiln_warnings = run("kiln")
    cpu_values, cpu_warnings = run("cpu")
    assert kiln_warnings == cpu_warnings == []  # not "An output ... was resized"
    for k, c in zip(kiln_values, cpu_values):
        assert_same(k, c)


def test_silu_and_mish_backward_run_cpus_kernel():
    # silu_backward, mish_backward and native_channel_shuffle have a CPU kernel
    # and a decomposition; kiln used to run the decomposition (other rounding,
    # so e.g. Llama's SiLU MLP trained off CPU's bits). Now it runs CPU's
    # kernel, with CPU's autograd behaviour for the backward ops themselves.
    torch.manual_seed(0)
    x = torch.randn(64, 33) * 4
    check(lambda x: F.silu(x).mul(x).sum(), x)
    check(lambda x: F.mish(x).mul(x).sum(), x)
    check(lambda x: F.channel_shuffle(x.reshape(2, 6, 11, 16)[:, :, :, :4], 3).square().sum(), x)
    g = torch.randn(64, 33)
    for op in (torch.ops.aten.silu_backward, torch.ops.aten.mish_backward):
        assert_same(op(g.to("kiln"), x.to("kiln")), op(g, x))
        for device in ("cpu", "kiln"):
            out = op(g.to(device).requires_grad_(), x.to(device).requires_grad_())
            assert type(out.grad_fn).__name__ == "NotImplemented", (device, out.grad_fn)
    # Double backward still works, through silu's and mish's differentiable
    # formulas (used when create_graph=True), as on CPU.
    for fn in (F.silu, F.mish):
        second = []
        for device in ("kiln", "cpu"):
            leaf = x.to(device).requires_grad_()
            (first,) = torch.autograd.grad(fn(leaf).sum(), leaf, create_graph=True)
            (grad2,) = torch.autograd.grad(first.sum(), leaf)
            second.append(grad2)
        assert_same(second[0], second[1])
