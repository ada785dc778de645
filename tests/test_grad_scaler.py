"""torch.amp.GradScaler("kiln"): scaling, unscaling, inf/NaN detection,
skipped steps and scale updates behave as on CUDA (checked against the CPU
GradScaler, which runs the same algorithm)."""

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


def test_kiln_amp_grad_scaler_is_torch_amp_grad_scaler_with_cudas_warning():
    import pytest
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
