"""torch.optim and friends on kiln match CPU step for step."""

import pytest
import torch
import torch.nn as nn

from conftest import assert_same


def train(device, make_optimizer, steps=5, scheduler=None, clip=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model.to(device)
    opt = make_optimizer(model.parameters())
    sched = scheduler(opt) if scheduler else None
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 6, generator=g).to(device)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=0.01),
    "adamw_for_loop": lambda p: torch.optim.AdamW(p, lr=0.01, foreach=False),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_matches_cpu(name):
    kiln_losses, kiln_params = train("kiln", OPTIMIZERS[name])
    cpu_losses, cpu_params = train("cpu", OPTIMIZERS[name])
    assert kiln_losses == cpu_losses
    for k, c in zip(kiln_params, cpu_params):
        assert_same(k, c)


def test_scheduler_and_clip_grad_norm():
    sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    k = train("kiln", OPTIMIZERS["adamw_foreach"], scheduler=sched, clip=0.5, steps=6)
    c = train("cpu", OPTIMIZERS["adamw_foreach"], scheduler=sched, clip=0.5, steps=6)
    assert k[0] == c[0]
    for a, b in zip(k[1], c[1]):
        assert_same(a, b)


def test_clip_grad_norm_returns_kiln_total_norm():
    p = torch.nn.Parameter(torch.ones(4, device="kiln"))
    p.grad = torch.full((4,), 3.0, device="kiln")
    total = torch.nn.utils.clip_grad_norm_([p], 1.0)
    assert total.device.type == "kiln" and total.item() == 6.0
    assert_same(p.grad, torch.full((4,), 3.0) * (1.0 / (6.0 + 1e-6)))


# Every optimizer in torch.optim, each with PyTorch's two implementations.
ALL_OPTIMIZERS = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "Rprop",
                  "Adadelta", "Adafactor", "RAdam", "ASGD", "NAdam"]
# Whose two implementations round differently in PyTorch itself
# (docs/porting.md, "Numbers").
LOOP_DIFFERS_FROM_FOREACH = {"ASGD", "NAdam", "Adafactor"}
# Whose foreach=None means the loop on every device.
LOOP_BY_DEFAULT = {"Adafactor"}


def make(name, **kwargs):
    extra = {"lr": 0.1} if name == "SGD" else {}
    return lambda p: getattr(torch.optim, name)(p, **extra, **kwargs)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", ALL_OPTIMIZERS)
def test_each_implementation_matches_cpu(name, foreach):
    kiln_losses, kiln_params = train("kiln", make(name, foreach=foreach), steps=3)
    cpu_losses, cpu_params = train("cpu", make(name, foreach=foreach), steps=3)
    assert kiln_losses == cpu_losses
    for k, c in zip(kiln_params, cpu_params):
        assert_same(k, c)


@pytest.mark.parametrize("name", ALL_OPTIMIZERS)
def test_default_implementation_is_foreach_as_on_cuda(name):
    """foreach=None takes the foreach implementation on kiln (as on CUDA),
    the loop on CPU (Adafactor: the loop on both); the two give the same
    bits except for ASGD, NAdam and Adafactor."""
    _, kiln_params = train("kiln", make(name), steps=3)
    _, cpu_foreach = train("cpu", make(name, foreach=True), steps=3)
    _, cpu_loop = train("cpu", make(name, foreach=False), steps=3)
    for k, c in zip(kiln_params, cpu_loop if name in LOOP_BY_DEFAULT else cpu_foreach):
        assert_same(k, c)
    same_as_other = all(torch.equal(k, c) for k, c in zip(
        kiln_params, cpu_foreach if name in LOOP_BY_DEFAULT else cpu_loop))
    assert same_as_other == (name not in LOOP_DIFFERS_FROM_FOREACH)
