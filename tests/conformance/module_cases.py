"""The modules pass: each ModuleInfo input run on CPU and on kiln, compared.

For one module class, dtype and training flag, each ModuleInput builds the
module twice from the same seed: on the CPU, and with constructor tensors
on kiln followed by `.to("kiln")`. Then, as one case:

- forward: outputs compared, then the state dicts (running statistics and
  any buffer the forward updates);
- backward: autograd.grad of the outputs with seeded random grad_outputs,
  gradients of every input and parameter compared.
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch
from torch.testing._internal.common_modules import ModuleInfo, ModuleInput

import settings
from compare import EXACT, Mismatch, Tolerance, assert_same
from declared import declared_tolerance
from calls import KilnCall, run_both, seeded_call
from outcomes import (FAILED, PASSED, SKIPPED, CaseFailed, CaseResult, CaseSkipped, Emit,
                      describe_error, first_line)
from transfer import copy_value, tensors_in

DEVICE = settings.DEVICE


def module_key(module_info: ModuleInfo, training: bool) -> str:
    """'nn.Dropout.train_mode' (the mode only where train and eval differ)."""
    if not module_info.train_and_eval_differ:
        return module_info.name
    return f"{module_info.name}.{'train_mode' if training else 'eval_mode'}"


def build_module(module_info: ModuleInfo, module_input: ModuleInput, device: str,
                 dtype: torch.dtype, training: bool) -> torch.nn.Module:
    """The module constructed from a seeded generator, on `device`."""
    args = copy_value(module_input.constructor_input.args, device)
    kwargs = copy_value(module_input.constructor_input.kwargs, device)
    module = seeded_call(module_info.module_cls, *args, **kwargs)
    module.to(device=device, dtype=dtype)
    module.train(training)
    return module


def differentiable(values: list[torch.Tensor]) -> list[int]:
    return [i for i, t in enumerate(values) if t.requires_grad]


def module_case(module_info: ModuleInfo, module_input: ModuleInput, dtype: torch.dtype,
                training: bool, tolerance: Tolerance = EXACT) -> None:
    """Forward then backward of one module input; raises on a difference."""
    forward = module_input.forward_input
    if forward is None:
        raise CaseSkipped("module input has no forward input")
    cpu_module, kiln_module = run_both(
        lambda: build_module(module_info, module_input, "cpu", dtype, training),
        lambda: KilnCall()(build_module, module_info, module_input, DEVICE, dtype, training))
    cpu_args, cpu_kwargs = copy_value((forward.args, forward.kwargs), "cpu")
    kiln_args, kiln_kwargs = copy_value((forward.args, forward.kwargs), DEVICE)
    try:
        cpu_out, kiln_out = run_both(lambda: seeded_call(cpu_module, *cpu_args, **cpu_kwargs),
                                     lambda: KilnCall()(kiln_module, *kiln_args, **kiln_kwargs))
        assert_same(kiln_out, cpu_out, tolerance=tolerance, path="output")
        assert_same(dict(kiln_module.state_dict()), dict(cpu_module.state_dict()),
                    check_strides=False, path="state_dict")
    except (CaseFailed, Mismatch) as failure:
        raise CaseFailed(f"forward: {failure}") from None
    cpu_outs, kiln_outs = tensors_in(cpu_out), tensors_in(kiln_out)
    picked = differentiable(cpu_outs)
    cpu_wrt = [t for t in tensors_in((cpu_args, cpu_kwargs)) + list(cpu_module.parameters())
               if t.requires_grad]
    kiln_wrt = [t for t in tensors_in((kiln_args, kiln_kwargs)) + list(kiln_module.parameters())
                if t.requires_grad]
    if not picked or not cpu_wrt:
        return
    if picked != differentiable(kiln_outs) or len(cpu_wrt) != len(kiln_wrt):
        raise CaseFailed("backward: outputs or inputs requiring grad differ from CPU's")
    torch.manual_seed(settings.SEED)
    grads_out = [torch.randn_like(cpu_outs[i]) for i in picked]
    kiln_grads_out = copy_value(grads_out, DEVICE)
    try:
        cpu_grads, kiln_grads = run_both(
            lambda: torch.autograd.grad([cpu_outs[i] for i in picked], cpu_wrt, grads_out,
                                        allow_unused=True),
            lambda: KilnCall()(torch.autograd.grad, [kiln_outs[i] for i in picked], kiln_wrt,
                               kiln_grads_out, allow_unused=True))
        assert_same(list(kiln_grads), list(cpu_grads), tolerance=tolerance, path="grad")
    except (CaseFailed, Mismatch) as failure:
        raise CaseFailed(f"backward: {failure}") from None


def module_inputs(module_info: ModuleInfo, dtype: torch.dtype, training: bool,
                  quick: bool) -> list[ModuleInput]:
    """The module's inputs, built on the CPU from a fixed seed."""
    torch.manual_seed(settings.SEED)
    inputs = module_info.module_inputs_func(module_info, device="cpu", dtype=dtype,
                                            requires_grad=True, training=training)
    if quick:
        inputs = itertools.islice(inputs, settings.QUICK_SAMPLES)
    return list(inputs)


def run_module(module_info: ModuleInfo, dtype: torch.dtype, training: bool, *, quick: bool,
               emit: Emit, begin: Callable[[str, str, str, int], None]) -> None:
    """Runs the modules pass over every input of one module, dtype and mode."""
    key, dname = module_key(module_info, training), settings.dtype_name(dtype)
    tolerance = declared_tolerance(key, dname, "modules") or EXACT
    try:
        inputs = module_inputs(module_info, dtype, training, quick)
    except Exception as error:  # noqa: BLE001 - a database problem, not kiln's
        emit(CaseResult(key, dname, "modules", 0, SKIPPED,
                        f"module input generation failed on CPU: {describe_error(error)}"))
        return
    for index, module_input in enumerate(inputs):
        begin(key, dname, "modules", index)
        result = CaseResult(key, dname, "modules", index, PASSED)
        try:
            module_case(module_info, module_input, dtype, training, tolerance)
        except CaseSkipped as skip:
            result.status, result.message = SKIPPED, first_line(str(skip))
        except (CaseFailed, Mismatch) as failure:
            result.status, result.message = FAILED, first_line(str(failure))
        except Exception as error:  # noqa: BLE001
            result.status, result.message = FAILED, describe_error(error)
        if result.status == FAILED:
            result.sample = first_line(f"ModuleInput(desc={module_input.desc!r})")
        emit(result)


def count_module_cases(module_info: ModuleInfo, dtype: torch.dtype, training: bool,
                       quick: bool) -> int:
    """How many cases run_module would run (for tests skipped whole)."""
    try:
        return len(module_inputs(module_info, dtype, training, quick))
    except Exception:  # noqa: BLE001
        return 1
