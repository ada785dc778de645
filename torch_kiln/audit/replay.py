"""Replaying an operator that failed on kiln on the CPU, to tell a kiln gap
("unsupported on kiln": the CPU runs it) from the program's own error ("fails
on CPU too": a shape mismatch fails on CUDA as well).

:func:`replay_on_cpu` is called by the audit's tracer
(:mod:`torch_kiln.audit.tracer`) the first time a call site fails, from
inside its ``TorchFunctionMode`` handler (where the mode is off, so the
replay is not traced). Each kiln tensor argument is copied to the CPU
(``detach().to("cpu")``, keeping ``requires_grad`` and leaf-ness, so autograd's
own errors replay too), each ``kiln``/``kiln:N`` device (string or
``torch.device``) becomes ``cpu``, and the same function is called. Inputs are
copies: an in-place op changes nothing of the program's; warnings the replay
raises are dropped (the program's stderr is its own), and the CPU
generator's state is restored. Calls whose kiln inputs total more than
:data:`MAX_BYTES`, factories whose integer arguments multiply past it, and
out-of-memory errors are not replayed (the copies or the allocation would
cost the program's memory and time).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["replay_on_cpu", "MAX_BYTES", "UNSUPPORTED", "FAILS_ON_CPU", "NOT_REPLAYED"]

MAX_BYTES = 64 << 20

# The outcomes (detail["cpu_replay"] of an op-failure finding).
UNSUPPORTED = "unsupported on kiln"
FAILS_ON_CPU = "fails on CPU too"
NOT_REPLAYED = "not replayed"


def _is_kiln(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == "kiln"
    if isinstance(value, torch.device):
        return value.type == "kiln"
    if isinstance(value, str):
        return value == "kiln" or value.startswith("kiln:")
    return False


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type == "kiln":
        copy = value.detach().to("cpu")
        if value.requires_grad:
            copy.requires_grad_(True)
            if not value.is_leaf:
                copy = copy.clone()  # a non-leaf, as the original was
        return copy
    if isinstance(value, torch.device) and value.type == "kiln":
        return torch.device("cpu")
    if isinstance(value, str) and (value == "kiln" or value.startswith("kiln:")):
        return "cpu"
    return value


def replay_on_cpu(func: Callable, args: tuple, kwargs: dict,
                  error: BaseException | None = None) -> tuple[str, str]:
    """Calls ``func`` again with CPU copies of ``args``/``kwargs``; returns
    ``(outcome, text)``: :data:`UNSUPPORTED` and ``""`` if the CPU ran it,
    :data:`FAILS_ON_CPU` and the CPU's error, or :data:`NOT_REPLAYED` and
    why. ``error`` is kiln's: an out-of-memory error is not replayed (the
    CPU would try the same allocation). The CPU generator's state is
    restored afterwards, so a random op's replay draws nothing from the
    program's stream. Never raises (a replay that cannot be made is an
    outcome)."""
    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower():
        return NOT_REPLAYED, "kiln ran out of memory (the CPU would try the same allocation)"
    leaves, _ = tree_flatten((args, kwargs))
    if not any(_is_kiln(leaf) for leaf in leaves):
        return NOT_REPLAYED, "no kiln tensor or device in the call (it ran on the CPU)"
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.device.type == "kiln"]
    size = sum(t.numel() * t.element_size() for t in tensors)
    if size > MAX_BYTES:
        return NOT_REPLAYED, f"kiln inputs of {size >> 20} MiB (over {MAX_BYTES >> 20} MiB)"
    if not tensors:  # a factory (torch.zeros(n, device="kiln")): bound what it could allocate
        elements = 1
        for leaf in leaves:
            if isinstance(leaf, int) and not isinstance(leaf, bool) and leaf > 0:
                elements *= leaf
        if elements * 8 > MAX_BYTES:
            return NOT_REPLAYED, f"a call that may allocate {elements} elements"
    try:
        cpu_args, cpu_kwargs = tree_map(_to_cpu, (args, kwargs))
    except Exception as error:  # e.g. an input whose producing work failed on kiln
        return NOT_REPLAYED, f"its inputs could not be copied to the CPU ({type(error).__name__})"
    try:
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")  # the program's stderr is its own
            func(*cpu_args, **cpu_kwargs)
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return FAILS_ON_CPU, f"{type(error).__name__}: {first}"[:300]
    return UNSUPPORTED, ""
