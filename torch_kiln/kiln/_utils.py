"""Argument normalisation shared by ``torch.kiln`` functions."""

from __future__ import annotations

from typing import Any

import torch

from torch_kiln import _C


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
        return _C._get_device()
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
            return _C._get_device()
        index = device.index
    if index >= 0:
        count = _C._get_device_count()
        if index >= count:
            # The same words as the C++ check (check_device_index in
            # KilnFunctions.cc), whichever API is given the bad index.
            devices = "device (kiln:0)" if count == 1 else f"devices (kiln:0 to kiln:{count - 1})"
            raise RuntimeError(
                f"Invalid device kiln:{index}: Kiln has {count} {devices}. Use an index in "
                "that range, or set KILN_DEVICE_COUNT to change the number of devices."
            )
    return index
