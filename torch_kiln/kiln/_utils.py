"""Argument normalisation shared by ``torch.kiln`` functions."""

from __future__ import annotations

import os
from typing import Any

import torch

from torch_kiln import _C

# The number of kiln devices, fixed for the life of the process (the runtime
# reads KILN_DEVICE_COUNT once). Filled on first use outside torch.compile;
# traced code reads it as a constant (Note [torch.kiln under torch.compile]).
_device_count_cache: int | None = None


def _device_count() -> int | None:
    """``torch.kiln.device_count()``; ``None`` only while tracing if the count
    was never read (it is, when kiln's DeviceInterface is registered, before
    Dynamo traces anything)."""
    global _device_count_cache
    if torch.compiler.is_compiling():
        # Dynamo cannot call into torch_kiln._C: read the recorded count.
        return _device_count_cache
    if _device_count_cache is None:
        _device_count_cache = _C._get_device_count()
    return _device_count_cache


def _current_device() -> int:
    """The calling thread's current kiln device index."""
    if torch.compiler.is_compiling():
        # Dynamo folds this to a constant, guarded on the current device.
        return torch.accelerator.current_device_index()
    return _C._get_device()


def _device_index(device: Any, optional: bool = False) -> int:
    """The kiln device index that ``device`` names.

    ``device`` may be an ``int``, a string (``"kiln"``, ``"kiln:1"``), or a
    ``torch.device`` of type ``kiln``. ``None`` (and ``"kiln"`` without an
    index) mean the current device when ``optional`` is true. Raises
    ``ValueError`` for a device of another type and ``RuntimeError`` for an
    index outside ``[0, torch.kiln.device_count())``; negative ints pass
    through unchanged (they mean "no device" to the callers that accept them).
    """
    if device is None:
        if not optional:
            raise ValueError("Expected a kiln device, got None.")
        return _current_device()
    if isinstance(device, bool):
        raise TypeError(f"Expected a kiln device (int, str or torch.device), got {device!r}.")
    if isinstance(device, int):
        index = device
    else:
        if isinstance(device, str):
            device = torch.device(device)
        if not isinstance(device, torch.device):
            raise TypeError(
                f"Expected a kiln device (int, str or torch.device), got {type(device).__name__}."
            )
        if device.type != "kiln":
            raise ValueError(f"Expected a kiln device, got {device}.")
        if device.index is None:
            return _current_device()
        index = device.index
    if index >= 0:
        count = _device_count()
        if count is not None and index >= count:
            # The same words as the C++ check (check_device_index in
            # KilnFunctions.cc), whichever API is given the bad index.
            devices = "device (kiln:0)" if count == 1 else f"devices (kiln:0 to kiln:{count - 1})"
            visible = "" if os.environ.get("KILN_VISIBLE_DEVICES") is None else (
                " (and KILN_VISIBLE_DEVICES which are visible)"
            )
            raise RuntimeError(
                f"Invalid device kiln:{index}: Kiln has {count} {devices}. Use an index in "
                f"that range, or set KILN_DEVICE_COUNT to change the number of devices{visible}."
            )
    return index


def _checked_device(device: Any, what: str) -> int:
    """``device`` as a kiln device index (``None``: the current device), for
    functions of one device, where a negative index is a ``ValueError`` naming
    ``what`` (torch.cuda's raise there too) rather than "no device"."""
    index = _device_index(device, optional=True)
    if index < 0:
        raise ValueError(f"{what}: expected a kiln device (None, an index >= 0, \"kiln:N\" or a "
                         f"torch.device), got {device!r}.")
    return index
