"""torch.amp.GradScaler("kiln"): scaling, unscaling, inf/NaN detection,
skipped steps and scale updates behave as on CUDA (checked against the CPU
GradScaler, which runs the same algorithm)."""

import pytest
import torch
import torch.nn as nn

from conftest import assert_same


def run(device, poison_steps=(), steps=6):
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=2)
    g = torch.Generator().manual_seed(0)
    scales, skipped = [], []
    for step in range(steps):
        x = torch.randn(5, 4, generator=g).to(device)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        if step in poison_steps:
            model.weight.grad[0, 0] = float("inf") if step % 2 else float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters())))
    return scales, skipped, [p.detach().cpu() for p in model.parameters()]


def test_grad_scaler_matches_cpu_including_skipped_steps():
    kiln = run("kiln", poison_steps=(1, 4))
    cpu = run("cpu", poison_steps=(1, 4))
    assert kiln[0] == cpu[0]  # identical scale history
    assert kiln[1] == cpu[1] == [False, True, False, False, True, False]
    assert kiln[0][1] == 2.0**9  # halved after the skipped step
    for k, c in zip(kiln[2], cpu[2]):
        assert_same(k, c)


def test_unscale_and_clip():
    model = nn.Linear(2, 1).to("kiln")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("kiln", init_scale=8.0)
    scaler.scale(model(torch.ones(3, 2, device="kiln")).sum()).backward()
    scaler.unscale_(opt)
    assert_same(model.weight.grad, torch.full((1, 2), 3.0))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 8.0


# Note [found_inf summed over devices] (torch_kiln/kiln/_grad_scaler_fix.py): with the
# parameters on kiln:0 and kiln:1 and a non-finite gradient on both, the
# found_inf GradScaler passes a fused optimizer is 2.0; the step must still be
# skipped, as on one device.
FUSED_OPTIMIZERS = [
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.Adagrad, {"lr": 0.1}),
]


def run_split(devices, optimizer, kwargs, unscale_first, steps=6):
    """Two layers, the first on devices[0] and the second on devices[1];
    steps 1 and 4 get a non-finite gradient on both layers, step 3 on the
    second only. Returns the scale history, which steps were skipped, and the
    final parameters."""
    torch.manual_seed(0)
    first = nn.Linear(4, 6).to(devices[0])
    second = nn.Linear(6, 3).to(devices[1])
    params = list(first.parameters()) + list(second.parameters())
    opt = optimizer(params, fused=True, **kwargs)
    scaler = torch.amp.GradScaler(devices[0].split(":")[0], init_scale=2.0**10, growth_interval=2)
    g = torch.Generator().manual_seed(0)
    scales, skipped = [], []
    for step in range(steps):
        x = torch.randn(5, 4, generator=g).to(devices[0])
        loss = second(first(x).relu().to(devices[1])).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        if step in (1, 4):
            first.weight.grad[0, 0] = float("inf")
            second.weight.grad[1, 1] = float("nan")
        if step == 3:
            second.bias.grad[0] = float("inf")
        if unscale_first:
            scaler.unscale_(opt)
        before = [p.detach().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(all(torch.equal(b, p.detach()) for b, p in zip(before, params)))
    return scales, skipped, [p.detach().cpu() for p in params]


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale-then-step"])
@pytest.mark.parametrize("optimizer,kwargs", FUSED_OPTIMIZERS,
                         ids=["Adam", "AdamW", "Adam-amsgrad", "SGD", "Adagrad"])
def test_fused_optimizer_skips_steps_with_parameters_on_two_devices(optimizer, kwargs, unscale_first):
    cpu = run_split(("cpu", "cpu"), optimizer, kwargs, unscale_first)
    assert cpu[1] == [False, True, False, True, True, False]
    for devices in (("kiln:0", "kiln:1"), ("kiln:1", "kiln:0"), ("kiln:0", "kiln:0")):
        kiln = run_split(devices, optimizer, kwargs, unscale_first)
        assert kiln[0] == cpu[0], devices
        assert kiln[1] == cpu[1], devices
        for k, c in zip(kiln[2], cpu[2]):
            assert not k.isnan().any(), devices
            assert_same(k, c)


def test_kiln_amp_grad_scaler_is_torch_amp_grad_scaler_with_cudas_warning():
    with pytest.warns(FutureWarning, match=r"`torch.kiln.amp.GradScaler\(args...\)` is deprecated. "
                                           r"Please use `torch.amp.GradScaler\('kiln', args...\)`"):
        scaler = torch.kiln.amp.GradScaler(init_scale=2.0**10, growth_interval=2)
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    assert scaler.get_scale() == 2.0**10
    # It scales on kiln exactly as torch.amp.GradScaler("kiln") does.
    reference = torch.amp.GradScaler("kiln", init_scale=2.0**10, growth_interval=2)
    weights = []
    for s in (scaler, reference):
        torch.manual_seed(0)
        model = nn.Linear(4, 3).to("kiln")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s.scale(model(torch.ones(2, 4, device="kiln")).sum()).backward()
        s.step(opt)
        s.update()
        weights.append(model.weight.detach().cpu())
    assert_same(weights[0], weights[1])
    assert scaler.get_scale() == reference.get_scale()
    with pytest.warns(FutureWarning):
        assert not torch.kiln.amp.GradScaler(enabled=False).is_enabled()
