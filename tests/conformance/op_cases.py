"""The op passes: each sample of an OpInfo run on CPU and on kiln, compared.

For one op and dtype, samples are built on the CPU (seeded), copied to each
device with their layouts (see transfer.py), and run:

- forward: op(sample) on both; outputs compared after the sample's
  output_process_fn_grad, then every input storage (no stray writes).
  The kiln call's synchronizations are recorded (torch.kiln.get_sync_ops()).
- noncontiguous: forward on SampleInput.noncontiguous() copies.
  (Samples: samples.py; calling both sides alike: calls.py.)
- out: op(sample, out=...) with out tensors laid out like CPU's result
  (pre-filled with a sentinel) and with empty out tensors (resized by the
  op); the returned objects must be the out tensors where CPU's are.
- inplace: the in-place variant on both; the input (and its whole storage)
  must hold CPU's values, and the result must be the input where CPU's is.
- backward: autograd.grad of the processed outputs with seeded random
  grad_outputs; gradients of every input compared.

A sample CPU rejects (raises) must also be rejected by kiln; it is counted
as skipped. Every kiln call is followed by torch.kiln.synchronize() so that
asynchronous device errors surface in the case that caused them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.testing._internal.opinfo.core import OpInfo

import settings
from calls import KilnCall, call_op, run_both, seeded_call
from compiled_cases import compiled_case, default_tolerance
from compare import EXACT, Mismatch, Tolerance, assert_same
from declared import declared_skip, declared_tolerance
from outcomes import (FAILED, PASSED, SKIPPED, CaseFailed, CaseResult, CaseSkipped, Emit,
                      describe_error, first_line)
from samples import PlacedSample, SampleSource, op_key
from transfer import DeviceSample, copy_value, tensors_in

DEVICE = settings.DEVICE


def sentinel_for(dtype: torch.dtype) -> Any:
    """The value out= tensors are filled with, so unwritten elements show."""
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return 77


def assert_storages_same(kiln: DeviceSample, cpu: DeviceSample, tolerance: Tolerance,
                         what: str) -> None:
    """Every storage the sample's tensors live in holds CPU's bytes."""
    for i, (k, c) in enumerate(zip(kiln.storages, cpu.storages)):
        assert_same(k, c, device_type=k.device.type, tolerance=tolerance,
                    path=f"{what} storage {i}")


# ---------------------------------------------------------------- the passes

def forward_case(op: OpInfo, placed: PlacedSample, tolerance: Tolerance) -> dict[str, int]:
    """Compares op(sample) on kiln with CPU; returns the kiln sync ops."""
    sample = placed.sample
    cpu, kiln = placed.on("cpu"), placed.on(DEVICE)
    kiln_call = KilnCall(track_sync=True)
    cpu_out, kiln_out = run_both(lambda: seeded_call(call_op, op, cpu.sample),
                                 lambda: kiln_call(call_op, op, kiln.sample))
    assert_same(sample.output_process_fn_grad(kiln_out), sample.output_process_fn_grad(cpu_out),
                device_type=kiln.result_device_type, tolerance=tolerance)
    assert_storages_same(kiln, cpu, tolerance, "input")
    assert_same_aliasing(kiln_out, kiln, cpu_out, cpu)
    return kiln_call.sync_ops


def assert_same_aliasing(kiln_out: Any, kiln: DeviceSample, cpu_out: Any,
                         cpu: DeviceSample) -> None:
    """An output that is a view of an input on CPU is a view of the same
    input, at the same storage offset, on kiln (and only then)."""
    for i, (k, c) in enumerate(zip(tensors_in(kiln_out), tensors_in(cpu_out))):
        k_base, c_base = kiln.storage_index(k), cpu.storage_index(c)
        if k_base != c_base:
            raise CaseFailed(f"output {i} aliases input storage {k_base} on kiln, "
                             f"{c_base} on CPU")
        if c_base is not None and k.storage_offset() != c.storage_offset():
            raise CaseFailed(f"output {i} view at storage offset {k.storage_offset()} on "
                             f"kiln, {c.storage_offset()} on CPU")


def make_out(expected: Any, device: str, empty: bool) -> Any:
    """out= arguments shaped like `expected` (CPU's result): the same layout
    filled with a sentinel, or empty tensors the op has to resize."""
    if isinstance(expected, torch.Tensor):
        if expected.layout != torch.strided:
            # A sparse out= tensor with CPU's sparsity pattern, values set to
            # the sentinel (sparse tensors have no empty form to resize).
            if empty:
                raise CaseSkipped("a sparse out= tensor has no empty form")
            out = expected.detach().clone().to(device)
            out.values().fill_(sentinel_for(expected.dtype))
            return out
        if empty:
            return torch.empty(0, dtype=expected.dtype, device=device)
        out = torch.empty_strided(expected.shape, expected.stride(), dtype=expected.dtype,
                                  device=device)
        return out.fill_(sentinel_for(expected.dtype))
    if isinstance(expected, (tuple, list)) and expected and all(
            isinstance(t, torch.Tensor) for t in expected):
        return tuple(make_out(t, device, empty) for t in expected)
    raise CaseSkipped(f"op returns {type(expected).__name__}, not tensors, so no out=")


def same_objects(returned: Any, out: Any) -> bool:
    """True if the op returned the out= tensors themselves."""
    if isinstance(out, torch.Tensor):
        return returned is out
    return isinstance(returned, (tuple, list)) and len(returned) == len(out) and all(
        r is o for r, o in zip(returned, out))


def out_case(op: OpInfo, placed: PlacedSample, tolerance: Tolerance) -> None:
    """op(sample, out=...) on kiln writes CPU's values into the out tensors."""
    expected = seeded_call(call_op, op, placed.on("cpu").sample)
    checked = 0
    for empty in (False, True):
        what = "empty out" if empty else "out"
        cpu, kiln = placed.on("cpu"), placed.on(DEVICE)
        try:
            cpu_out, kiln_out = make_out(expected, "cpu", empty), make_out(expected, DEVICE, empty)
        except CaseSkipped:
            if not empty:
                raise
            continue
        try:
            cpu_ret, kiln_ret = run_both(
                lambda: seeded_call(call_op, op, cpu.sample, out=cpu_out),
                lambda: KilnCall()(call_op, op, kiln.sample, out=kiln_out))
        except CaseSkipped:
            continue
        except CaseFailed as failure:
            raise CaseFailed(f"{what}: {failure}") from None
        if same_objects(cpu_ret, cpu_out) and not same_objects(kiln_ret, kiln_out):
            raise CaseFailed(f"{what}: kiln did not return the out= tensors")
        assert_same(kiln_out, cpu_out, tolerance=tolerance, path=what)
        assert_storages_same(kiln, cpu, tolerance, "input")
        checked += 1
    if not checked:
        raise CaseSkipped("CPU rejects out= for this sample; kiln too")


def inplace_case(op: OpInfo, placed: PlacedSample, tolerance: Tolerance) -> None:
    """The in-place variant mutates the kiln input (and its storage) as CPU's."""
    sample = placed.sample
    if not isinstance(sample.input, torch.Tensor):
        raise CaseSkipped("sample input is not a tensor")
    if sample.broadcasts_input:
        raise CaseSkipped("sample broadcasts its input, invalid in place")
    inplace = op.get_inplace()
    cpu, kiln = placed.on("cpu"), placed.on(DEVICE)
    cpu_ret, kiln_ret = run_both(lambda: seeded_call(call_op, inplace, cpu.sample),
                                 lambda: KilnCall()(call_op, inplace, kiln.sample))
    if cpu_ret is cpu.sample.input and kiln_ret is not kiln.sample.input:
        raise CaseFailed("in-place variant did not return its input")
    assert_same(kiln.sample.input, cpu.sample.input, tolerance=tolerance, path="input")
    assert_storages_same(kiln, cpu, tolerance, "input")
    assert_same(kiln_ret, cpu_ret, tolerance=tolerance, path="returned")


def backward_case(op: OpInfo, placed: PlacedSample, tolerance: Tolerance) -> None:
    """Gradients of every input match CPU's, for the same grad_outputs."""
    sample = placed.sample
    cpu, kiln = placed.on("cpu"), placed.on(DEVICE)
    cpu_out, kiln_out = run_both(lambda: seeded_call(call_op, op, cpu.sample),
                                 lambda: KilnCall()(call_op, op, kiln.sample))
    cpu_outs = tensors_in(sample.output_process_fn_grad(cpu_out))
    kiln_outs = tensors_in(sample.output_process_fn_grad(kiln_out))
    if len(cpu_outs) != len(kiln_outs):
        raise CaseFailed(f"{len(kiln_outs)} output tensors on kiln, {len(cpu_outs)} on CPU")
    picked = [i for i, t in enumerate(cpu_outs) if t.requires_grad]
    for i in picked:
        if not kiln_outs[i].requires_grad:
            raise CaseFailed(f"output {i} does not require grad on kiln")
    cpu_inputs = [t for t in cpu.tensors if t.requires_grad]
    kiln_inputs = [t for t in kiln.tensors if t.requires_grad]
    if not picked or not cpu_inputs:
        raise CaseSkipped("no differentiable output or input")
    torch.manual_seed(settings.SEED)
    grads_out = [torch.randn_like(cpu_outs[i]) for i in picked]
    kiln_grads_out = [copy_value(g, kiln_outs[i].device) for g, i in zip(grads_out, picked)]
    cpu_grads, kiln_grads = run_both(
        lambda: torch.autograd.grad([cpu_outs[i] for i in picked], cpu_inputs, grads_out,
                                    allow_unused=True),
        lambda: KilnCall()(torch.autograd.grad, [kiln_outs[i] for i in picked], kiln_inputs,
                           kiln_grads_out, allow_unused=True))
    assert_same(list(kiln_grads), list(cpu_grads), tolerance=tolerance, path="grad")


# ---------------------------------------------------------------- one op, one dtype

def applicable_passes(op: OpInfo, dtype: torch.dtype, passes: Iterable[str]) -> dict[str, str]:
    """pass -> '' if it applies to this op and dtype, else why not."""
    result = {}
    for name in passes:
        reason = ""
        if name == "out" and not op.supports_out:
            reason = "op has no out= variant"
        elif name == "inplace" and op.get_inplace() is None:
            reason = "op has no in-place variant"
        elif name == "backward":
            if dtype not in settings.BACKWARD_DTYPES:
                reason = "gradients are compared for float32 and float64 only"
            elif not op.supports_autograd or dtype not in op.supported_backward_dtypes("cpu"):
                reason = "op has no backward for this dtype"
        result[name] = reason
    return result


CASES: dict[str, Callable[[OpInfo, PlacedSample, Tolerance], Any]] = {
    "forward": forward_case,
    "noncontiguous": forward_case,
    "out": out_case,
    "inplace": inplace_case,
    "backward": backward_case,
    settings.COMPILED_PASS: compiled_case,
}


def run_case(case: Callable, op: OpInfo, sample: PlacedSample, tolerance: Tolerance,
             result: CaseResult) -> None:
    """Runs one case and fills in `result`'s status and message."""
    try:
        sync_ops = case(op, sample, tolerance)
        result.status = PASSED
        if isinstance(sync_ops, dict):
            result.sync_ops = sync_ops
    except CaseSkipped as skip:
        result.status, result.message = SKIPPED, first_line(str(skip))
    except (CaseFailed, Mismatch) as failure:
        result.status, result.message = FAILED, first_line(str(failure))
    except Exception as error:  # noqa: BLE001 - any other error fails the case
        result.status, result.message = FAILED, describe_error(error)
    if result.status == FAILED:
        result.sample = first_line(sample.summary(), limit=500)


def run_op(op: OpInfo, dtype: torch.dtype, *, passes: Iterable[str], quick: bool,
           emit: Emit, begin: Callable[[str, str, str, int], None]) -> None:
    """Runs every applicable pass over the samples of `op` in `dtype`."""
    key, dname = op_key(op), settings.dtype_name(dtype)
    source = SampleSource(op, dtype, quick)
    for pass_name, not_applicable in applicable_passes(op, dtype, passes).items():
        if not_applicable:
            continue
        skip_reason = declared_skip(key, dname, pass_name)
        try:
            samples = source.for_pass(pass_name)
        except Exception as error:  # noqa: BLE001 - a database problem, not kiln's
            emit(CaseResult(key, dname, pass_name, 0, SKIPPED,
                            f"sample generation failed on CPU: {describe_error(error)}"))
            continue
        if skip_reason:
            emit(CaseResult(key, dname, pass_name, 0, SKIPPED, f"declared: {skip_reason}",
                            count=len(samples)))
            continue
        tolerance = declared_tolerance(key, dname, pass_name) or (
            default_tolerance(dname) if pass_name == settings.COMPILED_PASS else EXACT)
        for index, sample in enumerate(samples):
            begin(key, dname, pass_name, index)
            result = CaseResult(key, dname, pass_name, index, FAILED)
            run_case(CASES[pass_name], op, sample, tolerance, result)
            emit(result)


def count_cases(op: OpInfo, dtype: torch.dtype, passes: Iterable[str],
                quick: bool) -> dict[str, int]:
    """pass -> number of cases run_op would run (for tests skipped whole)."""
    counts = {}
    source = SampleSource(op, dtype, quick)
    for pass_name, not_applicable in applicable_passes(op, dtype, passes).items():
        if not_applicable:
            continue
        try:
            counts[pass_name] = len(source.for_pass(pass_name))
        except Exception:  # noqa: BLE001
            counts[pass_name] = 1
    return counts
