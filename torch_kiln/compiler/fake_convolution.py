"""Output strides of kiln convolutions under FakeTensorMode: CPU's.

Kiln runs a convolution with CPU's kernel (``torch_kiln/csrc/aten/
Convolution.cc``), so its outputs have the memory format CPU's backend
chooses: channels-last when the input or the weight is channels-last
(oneDNN, slow_conv2d), contiguous otherwise. FakeTensorMode computes a
convolution's output strides in its own rule (``fake_impls.conv``) from
``torch._C._select_conv_backend``, which answers ``Overrideable`` for a
PrivateUse1 tensor, and that backend's format is always contiguous. Traced
graphs then disagreed with the device: Inductor's ``assert_size_stride`` on
a compiled ``conv2d`` output failed for a channels-last weight, and code
generated after a convolution could index its output with the wrong
strides. A Meta kernel cannot fix this (the fake rule runs instead of it).

The fix keeps FakeTensorMode's rule and gives it the question kiln's kernel
answers: for the four convolution operators the rule handles, when an
argument is a kiln fake tensor, the rule runs on CPU fake tensors with the
same sizes, strides and dtypes, and its outputs come back as kiln fake
tensors with the strides it computed. Everything else (non-kiln calls,
symbolic shapes without hints, which the rule leaves contiguous) is the
rule's own behaviour.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map_only

_KILN = "kiln"


def _kiln_device(values: Any) -> torch.device | None:
    """The device of the first kiln fake tensor among ``values``, if any."""
    from torch._subclasses.fake_tensor import FakeTensor

    found: list[torch.device] = []

    def visit(t: FakeTensor) -> FakeTensor:
        if not found and t.fake_device.type == _KILN:
            found.append(t.fake_device)
        return t

    tree_map_only(FakeTensor, visit, values)
    return found[0] if found else None


def _like(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A fresh (fake, under the active mode) tensor like ``t`` on ``device``."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)


def _with_cpu_strides(rule: Callable[..., Any]) -> Callable[..., Any]:
    def kiln_convolution_rule(fake_mode, func, *args, **kwargs):
        from torch._subclasses.fake_tensor import FakeTensor

        device = _kiln_device((args, kwargs))
        if device is None:
            return rule(fake_mode, func, *args, **kwargs)
        with fake_mode:
            cpu_args, cpu_kwargs = tree_map_only(
                FakeTensor, lambda t: _like(t, "cpu") if t.fake_device == device else t,
                (args, kwargs))
        out = rule(fake_mode, func, *cpu_args, **cpu_kwargs)
        with fake_mode:
            return tree_map_only(FakeTensor, lambda t: _like(t, device), out)

    kiln_convolution_rule.kiln_wraps = rule  # type: ignore[attr-defined]
    return kiln_convolution_rule


def register() -> None:
    """Wrap FakeTensorMode's convolution rule (idempotent)."""
    from torch._subclasses import fake_impls

    aten = torch.ops.aten
    for op in (aten.convolution.default, aten._convolution.default,
               aten._convolution.deprecated, aten.convolution_backward.default):
        rule = fake_impls.op_implementations_dict.get(op)
        if rule is None or hasattr(rule, "kiln_wraps"):
            continue
        fake_impls.op_implementations_dict[op] = _with_cpu_strides(rule)
