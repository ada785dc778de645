"""OpInfo samples for one op and dtype, built once per run of the op.

Samples are built on the CPU from a fixed seed: reference_inputs (a superset
of sample_inputs with extremal values) for the forward pass, sample_inputs
otherwise (with requires_grad for backward); the noncontiguous pass uses
SampleInput.noncontiguous() copies. Quick mode takes the first few of the
same sequences, so a case's index names the same sample in every mode (and
in known_failures.txt).
Each is built again on the meta device to learn which of its values follow
the device and which stay on the CPU (see transfer.placement).
"""

from __future__ import annotations

import itertools

import torch
from torch.testing._internal.opinfo.core import OpInfo, SampleInput

import settings
from transfer import DeviceSample, placement


def op_key(op: OpInfo) -> str:
    """The op's name in reports and known_failures.txt: 'max.binary'."""
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


class PlacedSample:
    """An OpInfo sample built on the CPU, with what of it stays on the CPU
    when it is copied to kiln (see transfer.placement)."""

    def __init__(self, sample: SampleInput, decisions: list[str] | None):
        self.sample, self.decisions = sample, decisions

    def on(self, device: str) -> DeviceSample:
        """A fresh copy on `device` ("cpu" or kiln)."""
        return DeviceSample(self.sample, device, self.decisions)

    def summary(self) -> str:
        return self.sample.summary()


def _generate(op: OpInfo, device: str, dtype: torch.dtype, reference: bool,
              requires_grad: bool, quick: bool) -> list[SampleInput]:
    torch.manual_seed(settings.SEED)
    make = op.reference_inputs if reference else op.sample_inputs
    samples = make(device, dtype, requires_grad=requires_grad)
    if quick:
        samples = itertools.islice(samples, settings.QUICK_SAMPLES)
    return list(samples)


def _placed(op: OpInfo, dtype: torch.dtype, reference: bool, requires_grad: bool,
            quick: bool) -> list[PlacedSample]:
    samples = _generate(op, "cpu", dtype, reference, requires_grad, quick)
    try:
        meta_samples = _generate(op, "meta", dtype, reference, requires_grad, quick)
    except Exception:  # noqa: BLE001 - a sample function that needs values
        meta_samples = []
    if len(meta_samples) == len(samples):
        decisions = [placement(s, m) for s, m in zip(samples, meta_samples)]
    else:
        decisions = [None] * len(samples)
    return [PlacedSample(s, d) for s, d in zip(samples, decisions)]


class SampleSource:
    """The samples of each pass for one op and dtype, each kind built once."""

    def __init__(self, op: OpInfo, dtype: torch.dtype, quick: bool):
        self.op, self.dtype, self.quick = op, dtype, quick
        self._built: dict[tuple[bool, bool], list[PlacedSample]] = {}

    def _kind(self, reference: bool, requires_grad: bool) -> list[PlacedSample]:
        key = (reference, requires_grad)
        if key not in self._built:
            self._built[key] = _placed(self.op, self.dtype, reference, requires_grad, self.quick)
        return self._built[key]

    def for_pass(self, pass_name: str) -> list[PlacedSample]:
        """The samples `pass_name` runs, in order (their index is the case's)."""
        if pass_name == "forward":
            return self._kind(reference=True, requires_grad=False)
        if pass_name == "backward":
            return self._kind(reference=False, requires_grad=True)
        samples = self._kind(reference=False, requires_grad=False)
        if pass_name == settings.COMPILED_PASS:
            return samples[:settings.COMPILED_SAMPLES]
        if pass_name == "noncontiguous":
            return [PlacedSample(p.sample.noncontiguous(), p.decisions) for p in samples]
        return samples
