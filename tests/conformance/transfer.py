"""Copies of OpInfo samples onto a device, keeping every tensor's layout.

`Tensor.to(device)` makes non-dense tensors (slices, expanded views)
contiguous, which would hide exactly the stride and aliasing bugs the
conformance run looks for. Here each tensor's whole storage is copied and the
tensor rebuilt over it with the same sizes, strides and storage offset (and
conj/neg bits), so a sliced, transposed, zero-stride or offset tensor stays
one on the device. Tensors sharing a storage in one sample still share one
after the copy.

Which values follow the device. A sample function receives the device and
creates most tensors there, but some on the CPU on purpose (tensor_split's
index tensor, 0-dim CPU scalars mixed with device tensors), and passes the
device itself as an argument (`x.to("cpu")`, `torch.zeros(device=...)`).
`placement()` tells them apart by building the same samples on the meta
device: a tensor still on the CPU there stays on the CPU, and a "cpu" that
reads "meta" there is the device argument and becomes kiln. Without that
information every tensor moves and CPU device arguments become kiln.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.testing._internal.opinfo.core import SampleInput

HOST, FOLLOW, KEEP = "host", "follow", "keep"  # per-leaf placement decisions


def _is_sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def leaves(value: Any) -> list[Any]:
    """The leaves of nested lists, tuples (named too) and dicts, in order."""
    if _is_sequence(value):
        return [leaf for v in value for leaf in leaves(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in leaves(v)]
    return [value]


def _sample_leaves(sample: SampleInput) -> list[Any]:
    return leaves((sample.input, sample.args, sample.kwargs))


def _names_device(value: Any, device_type: str) -> bool:
    if isinstance(value, torch.device):
        return value.type == device_type
    return isinstance(value, str) and value.split(":")[0] == device_type


def placement(cpu_sample: SampleInput, meta_sample: SampleInput) -> list[str] | None:
    """Per leaf of the sample: HOST (a tensor that stays on the CPU), FOLLOW
    (a device argument), KEEP (anything else, as is). None if the two
    samples differ in structure."""
    cpu_leaves, meta_leaves = _sample_leaves(cpu_sample), _sample_leaves(meta_sample)
    if len(cpu_leaves) != len(meta_leaves):
        return None
    decisions = []
    for c, m in zip(cpu_leaves, meta_leaves):
        if isinstance(c, torch.Tensor) != isinstance(m, torch.Tensor):
            return None
        if isinstance(c, torch.Tensor):
            decisions.append(HOST if m.device.type == "cpu" else FOLLOW)
        elif _names_device(c, "cpu") and _names_device(m, "meta"):
            decisions.append(FOLLOW)
        else:
            decisions.append(KEEP)
    return decisions


class SampleCopier:
    """Copies tensors (and nested containers of them) to `device`.

    One copier per sample: it remembers which storages it has copied, so
    tensors that alias on the CPU alias on the device too. `decisions`
    (from placement()) says, leaf by leaf, what stays on the CPU.
    """

    def __init__(self, device: str | torch.device, decisions: list[str] | None = None):
        self.device = torch.device(device)
        self.decisions = decisions
        self._leaf = 0
        self._storages: dict[tuple[str, int, torch.dtype], torch.Tensor] = {}
        self.storages: list[torch.Tensor] = []
        # True once a device argument was redirected to `device`; True once
        # one naming the CPU was kept (the op then returns CPU tensors).
        self.mapped_device_arg = False
        self.kept_cpu_device_arg = False

    def tensor(self, t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        """A copy of `t` on the device with t's sizes, strides, offset,
        conj/neg bits and requires_grad; a leaf tensor."""
        device = device or self.device
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            copy = t.detach().to(device)
        else:
            with torch.no_grad():
                base = self._storage_copy(t, device)
                copy = base.as_strided(t.size(), t.stride(), t.storage_offset())
                if t.is_neg():
                    copy = copy._neg_view()
                if t.is_conj():
                    copy = copy.conj()
            copy = copy.detach()
        if t.requires_grad:
            copy.requires_grad_(True)
        return copy

    def _storage_copy(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        storage = t.untyped_storage()
        key = (str(device), storage.data_ptr(), t.dtype)
        if key not in self._storages or storage.data_ptr() == 0:
            length = storage.nbytes() // t.element_size()
            flat = torch.empty(0, dtype=t.dtype, device=t.device)
            flat.set_(storage, 0, (length,), (1,))
            self._storages[key] = flat.to(device, copy=True)
            self.storages.append(self._storages[key])
        return self._storages[key]

    def _decision(self) -> str | None:
        if self.decisions is None:
            return None
        decision = self.decisions[self._leaf]
        self._leaf += 1
        return decision

    def value(self, value: Any, key: str | None = None) -> Any:
        """Copies tensors inside `value`; maps device arguments."""
        if _is_sequence(value):
            items = [self.value(v) for v in value]
            if isinstance(value, (list, torch.Size)):
                return type(value)(items)
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        if isinstance(value, dict):
            return {k: self.value(v, k) for k, v in value.items()}
        decision = self._decision()
        if isinstance(value, torch.Tensor):
            return self.tensor(value, torch.device("cpu") if decision == HOST else None)
        follows = decision == FOLLOW or (decision is None and (
            isinstance(value, torch.device) and value.type == "cpu"
            or key == "device" and _names_device(value, "cpu")))
        if follows:
            self.mapped_device_arg = True
            return self.device if isinstance(value, torch.device) else str(self.device)
        if decision == KEEP and _names_device(value, "cpu"):
            self.kept_cpu_device_arg = True
        return value


class DeviceSample:
    """A copy of an OpInfo sample on one device.

    `sample` is the copied SampleInput (on "cpu" it is a fresh CPU copy with
    the same layouts, so in-place ops never touch the original); `storages`
    are flat tensors over every storage its tensors live in, in a fixed
    order, so the CPU and kiln copies of one sample can be compared storage
    by storage; `tensors` are its tensors (input, args, kwargs).
    """

    def __init__(self, sample: SampleInput, device: str | torch.device,
                 decisions: list[str] | None = None):
        copier = SampleCopier(device, decisions)
        self.sample = SampleInput(
            copier.value(sample.input),
            args=copier.value(sample.args),
            kwargs=copier.value(sample.kwargs),
            output_process_fn_grad=sample.output_process_fn_grad,
            broadcasts_input=sample.broadcasts_input,
            name=sample.name,
        )
        self.storages = copier.storages
        self.tensors = sample_tensors(self.sample)
        # Where results should be: CPU tensors for a sample that names the
        # CPU explicitly (ones_like(x, device="cpu")) or has no device tensor
        # or argument at all (Python scalars, CPU tensors), else the device.
        on_device = any(t.device.type == copier.device.type for t in self.tensors)
        if copier.kept_cpu_device_arg or not (on_device or copier.mapped_device_arg):
            self.result_device_type = "cpu"
        else:
            self.result_device_type = copier.device.type

    def storage_index(self, t: torch.Tensor) -> int | None:
        """Which of `storages` tensor t lives in (None: none of them)."""
        if t.layout != torch.strided or t.untyped_storage().nbytes() == 0:
            return None
        ptr = t.untyped_storage().data_ptr()
        for i, flat in enumerate(self.storages):
            if flat.untyped_storage().nbytes() and flat.untyped_storage().data_ptr() == ptr:
                return i
        return None


def copy_value(value: Any, device: str | torch.device) -> Any:
    """Layout-preserving copy of a tensor or a container of tensors."""
    return SampleCopier(device).value(value)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor inside `value` (tensor, list, tuple, dict), in order."""
    return [leaf for leaf in leaves(value) if isinstance(leaf, torch.Tensor)]


def sample_tensors(sample: SampleInput) -> list[torch.Tensor]:
    """Every tensor of a sample: input, then args, then kwargs."""
    return tensors_in((sample.input, sample.args, sample.kwargs))
