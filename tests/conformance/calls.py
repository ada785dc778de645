"""Calling an op on the CPU and on kiln, the same way on both sides.

Random ops are seeded identically before each call (kiln's generator is
CPU's Mersenne Twister, so seeded random ops compare exactly); a kiln call
waits for the device so that asynchronous device errors surface in the case
that caused them, and can record which ATen ops forced a synchronization.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.testing._internal.opinfo.core import SampleInput

import settings
from outcomes import CaseFailed, CaseSkipped, describe_error


def seeded_call(fn: Callable, *args, **kwargs) -> Any:
    """fn(*args, **kwargs) after seeding CPU and kiln generators alike."""
    torch.manual_seed(settings.SEED)
    return fn(*args, **kwargs)


def call_op(fn: Callable, sample: SampleInput, **extra) -> Any:
    """fn(sample.input, *sample.args, **sample.kwargs, **extra)."""
    return fn(sample.input, *sample.args, **sample.kwargs, **extra)


class KilnCall:
    """Runs a callable on kiln tensors (seeded), waits for the device, and
    records which ops forced a synchronization while the callable ran."""

    def __init__(self, track_sync: bool = False):
        self.track_sync = track_sync
        self.sync_ops: dict[str, int] = {}

    def __call__(self, fn: Callable, *args, **kwargs) -> Any:
        torch.kiln.synchronize()
        if self.track_sync:
            torch.kiln.clear_op_tracking()
        try:
            return seeded_call(fn, *args, **kwargs)
        finally:
            if self.track_sync:
                self.sync_ops = dict(torch.kiln.get_sync_ops())
            torch.kiln.synchronize()


def run_both(cpu_fn: Callable[[], Any], kiln_fn: Callable[[], Any]) -> tuple[Any, Any]:
    """Runs the CPU side, then the kiln side; returns both results.

    Raises CaseSkipped if both raise (CPU rejects the sample, and so does
    kiln), CaseFailed if only one does."""
    cpu_error = kiln_error = None
    cpu_result = kiln_result = None
    try:
        cpu_result = cpu_fn()
    except Exception as error:  # noqa: BLE001 - any CPU error marks the sample invalid
        cpu_error = error
    try:
        kiln_result = kiln_fn()
    except Exception as error:  # noqa: BLE001
        kiln_error = error
    if cpu_error is not None and kiln_error is not None:
        raise CaseSkipped(f"CPU rejects the sample ({describe_error(cpu_error)}); kiln too")
    if cpu_error is not None:
        raise CaseFailed(f"kiln accepted a sample CPU rejects: {describe_error(cpu_error)}")
    if kiln_error is not None:
        raise CaseFailed(f"kiln raised {describe_error(kiln_error)}")
    return cpu_result, kiln_result
