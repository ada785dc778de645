"""Normalization layers traced and decomposed for kiln take CPU's branch.

Note [Kiln's normalization statistics are CPU's]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Kiln runs ATen's CPU kernels for LayerNorm, GroupNorm and BatchNorm, so
eager kiln returns what eager CPU returns. PyTorch's Python rules for these
operators (the decompositions Inductor compiles, and the FakeTensorMode rule
that gives the traced shapes and dtypes) branch on ``device.type == "cpu"``
to match the CPU kernels, and kiln took the other (CUDA) branch. In 2.13:

* ``native_layer_norm`` (``torch._refs``): CPU returns ``mean`` and ``rstd``
  in the input's dtype, other devices in the computation dtype (float32 for
  float16/bfloat16 input). On kiln the fake rule then disagreed with the
  real kernel (float32 vs float16 statistics), and compiled LayerNorm
  backward in float16/bfloat16 differed from compiled CPU (by 4e-3 and 2e-2
  in the input's gradient of a (8, 64) LayerNorm).
* ``native_batch_norm_helper`` (``torch._decomp.decompositions``, behind
  every BatchNorm decomposition): CPU returns ``save_mean`` and
  ``save_invstd`` in the input's dtype, and empty ``(0,)`` tensors in
  evaluation mode; other devices return float32 ``(C,)`` tensors.
* ``native_group_norm`` (``torch._refs``): with a weight, CPU computes
  ``x * (rstd * w) + (b - mean * rstd * w)`` per channel, as ATen's CPU
  kernel does (``aten/src/ATen/native/cpu/group_norm_kernel.cpp``); other
  devices compute ``((x - mean) * rstd) * w + b``: other float32 bits.

For kiln tensors each rule now gives the CPU branch's answer: the layer and
batch norm rules by converting their outputs as the CPU branch does (their
arithmetic is the same on both branches), the group norm decomposition by
computing the CPU branch's form. Everything on other devices is the original
rule, called unchanged. Compiled kiln then gives compiled CPU's bits for
these layers (tests/test_compile_normalization.py).

``register_fake_rules()`` runs when FakeTensorMode's rules load (with
``import torch``, so when torch_kiln loads), wrapping the BatchNorm helper
that the decompositions share; ``register_decompositions()`` right after Inductor's
decomposition table is built (its module's import, Note [Registering with
Dynamo lazily] in ``torch_kiln/compiler/__init__.py``), before AOTAutograd
decomposes any graph with it: registered later (when Inductor first looked
up kiln's scheduling), the first graph of a process was decomposed with the
original rules, and Inductor's cache kept that graph. This file is part of
kiln's Inductor cache key (``inductor/cache_key.py``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

_KILN = "kiln"


def _on_kiln(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == _KILN


def _statistics_in_input_dtype(layer_norm: Callable[..., Any]) -> Callable[..., Any]:
    """``layer_norm(input, normalized_shape, weight, bias, eps) -> (out,
    mean, rstd)`` with, for a kiln input, ``mean`` and ``rstd`` converted to
    the input's dtype (the CPU branch of ``torch._refs.native_layer_norm``)."""

    @functools.wraps(layer_norm)
    def kiln_native_layer_norm(input, *args, **kwargs):
        out, mean, rstd = layer_norm(input, *args, **kwargs)
        if _on_kiln(input):
            mean, rstd = mean.to(input.dtype), rstd.to(input.dtype)
        return out, mean, rstd

    kiln_native_layer_norm.kiln_wraps = layer_norm  # type: ignore[attr-defined]
    return kiln_native_layer_norm


def _batch_norm_helper_as_cpu(helper: Callable[..., Any]) -> Callable[..., Any]:
    """``torch._decomp.decompositions.native_batch_norm_helper`` whose saved
    statistics, for a kiln input, are CPU's: in the input's dtype, and empty
    in evaluation mode."""

    @functools.wraps(helper)
    def kiln_native_batch_norm_helper(input, weight, bias, running_mean, running_var,
                                      training, momentum, eps, functional):
        output, save_mean, save_rstd, new_mean, new_var = helper(
            input, weight, bias, running_mean, running_var, training, momentum, eps,
            functional)
        if _on_kiln(input):
            if not training:
                save_mean, save_rstd = input.new_zeros((0,)), input.new_zeros((0,))
            save_mean, save_rstd = save_mean.to(input.dtype), save_rstd.to(input.dtype)
        return output, save_mean, save_rstd, new_mean, new_var

    kiln_native_batch_norm_helper.kiln_wraps = helper  # type: ignore[attr-defined]
    return kiln_native_batch_norm_helper


def _group_norm_as_cpu(group_norm: Callable[..., Any]) -> Callable[..., Any]:
    """``native_group_norm`` that, for a kiln input with a weight, applies
    the normalization in the CPU kernel's form: per (sample, channel) a scale
    ``rstd * w`` and a shift ``b - mean * scale``, then ``x * scale +
    shift``, all in the computation dtype (the CPU branch of
    ``torch._refs.native_group_norm``). Shapes: input (N, C, *), weight and
    bias (C,); returns out (the input's shape and dtype), mean and rstd
    (N, group), in the input's dtype."""
    from torch._prims_common import get_computation_dtype

    @functools.wraps(group_norm)
    def kiln_native_group_norm(input, weight, bias, batch_size, num_channels,
                               flattened_inner_size, num_groups, eps):
        if not _on_kiln(input) or weight is None:
            return group_norm(input, weight, bias, batch_size, num_channels,
                              flattened_inner_size, num_groups, eps)
        # The rule's own checks, with its messages.
        torch._check(input.ndim >= 2, lambda: "Expected at least 2 dimensions for input "
                     f"tensor but received {input.ndim}")
        torch._check(num_channels % num_groups == 0, lambda: "Expected number of channels in "
                     "input to be divisible by num_groups, but got input of shape "
                     f"{input.shape} and num_groups = {num_groups}")
        per_group = num_channels // num_groups
        x = input.to(get_computation_dtype(input.dtype))
        grouped = x.reshape(batch_size, num_groups, per_group, flattened_inner_size)
        var, mean = torch.var_mean(grouped, dim=[2, 3], unbiased=False, keepdim=True)
        rstd = torch.rsqrt(var + eps)
        scale = rstd * weight.reshape(1, num_groups, per_group, 1)
        shift = -mean * scale
        if bias is not None:
            shift = shift + bias.reshape(1, num_groups, per_group, 1)
        # As the CPU branch, op for op, so that the traced graph is CPU's
        # node for node: (N, C) views of the per-channel factors, unsqueezed
        # over the input's remaining dimensions, and the statistics squeezed.
        scale = scale.contiguous().as_strided([batch_size, num_channels], [num_channels, 1])
        shift = shift.contiguous().as_strided([batch_size, num_channels], [num_channels, 1])
        for dim in range(2, input.ndim):
            scale = scale.unsqueeze(dim)
        for dim in range(2, input.ndim):
            shift = shift.unsqueeze(dim)
        out = (x * scale + shift).to(input.dtype)
        return (out, torch.squeeze(mean.to(input.dtype), [2, 3]),
                torch.squeeze(rstd.to(input.dtype), [2, 3]))

    kiln_native_group_norm.kiln_wraps = group_norm  # type: ignore[attr-defined]
    return kiln_native_group_norm


def _wrap_once(value: Callable[..., Any], wrap: Callable[..., Any]) -> Callable[..., Any]:
    return value if hasattr(value, "kiln_wraps") else wrap(value)


def register_fake_rules() -> None:
    """FakeTensorMode's rules give kiln tensors CPU's statistics and shapes
    (idempotent): the LayerNorm rule, every BatchNorm rule through the shared
    helper, and the GroupNorm decomposition that fake tensors with symbolic
    sizes run."""
    import torch._decomp
    import torch._decomp.decompositions as decompositions
    from torch._subclasses import fake_impls

    op = torch.ops.aten.native_layer_norm.default
    rule = fake_impls.op_implementations_dict.get(op)
    if rule is not None and not hasattr(rule, "kiln_wraps"):
        def kiln_layer_norm_rule(fake_mode, func, *args, **kwargs):
            out, mean, rstd = rule(fake_mode, func, *args, **kwargs)
            input = args[0] if args else kwargs["input"]
            if _on_kiln(input):
                with fake_mode:
                    mean, rstd = mean.to(input.dtype), rstd.to(input.dtype)
            return out, mean, rstd

        kiln_layer_norm_rule.kiln_wraps = rule  # type: ignore[attr-defined]
        fake_impls.op_implementations_dict[op] = kiln_layer_norm_rule
    decompositions.native_batch_norm_helper = _wrap_once(
        decompositions.native_batch_norm_helper, _batch_norm_helper_as_cpu)
    # With symbolic sizes FakeTensorMode runs the GroupNorm decomposition
    # itself (on the fake device, not on meta): the other branch's
    # ``out.view(input.shape)`` gave a kiln output the size
    # (N, C, H, (H*W)//H), a tangent of that size, and another backward.
    table = torch._decomp.decomposition_table
    op = torch.ops.aten.native_group_norm.default
    if op in table:
        table[op] = _wrap_once(table[op], _group_norm_as_cpu)


def register_decompositions() -> None:
    """Inductor's decompositions give kiln tensors CPU's branch (idempotent).
    Needs ``torch._inductor.decomposition`` imported."""
    import torch._inductor.decomposition as inductor_decomposition

    # (The BatchNorm helper is shared with the fake rules, which
    # register_fake_rules() wrapped when torch_kiln loaded.)
    inductor_decomposition.decomp_native_layer_norm = _wrap_once(
        inductor_decomposition.decomp_native_layer_norm, _statistics_in_input_dtype)
    table = inductor_decomposition.decompositions
    op = torch.ops.aten.native_group_norm.default
    if op in table and not hasattr(table[op], "kiln_wraps"):
        table[op] = _group_norm_as_cpu(table[op])
        # select_decomp_table() answers a cached copy of the table.
        inductor_decomposition.fast_random_decomps.cache_clear()
