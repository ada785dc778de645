"""Memory management of kiln devices (mirrors ``torch.cuda.memory``).

Statistics come from Kiln's caching allocator and use CUDA's
``memory_stats`` key names, so tools written for CUDA read them unchanged.
All sizes are in bytes.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import torch

from torch_kiln import _C
from torch_kiln.kiln._utils import _device_index


def empty_cache() -> None:
    """Release all unused cached device memory back to the device (it stays
    available to PyTorch's allocator on the next allocation)."""
    torch.accelerator.empty_cache()


def memory_stats(device: Any = None) -> collections.OrderedDict:
    """Allocator statistics of ``device`` (default: current) with CUDA's keys,
    e.g. ``"allocated_bytes.all.current"``, ``"reserved_bytes.all.peak"``,
    ``"num_alloc_retries"``, ``"num_ooms"``."""
    return torch.accelerator.memory_stats(_device_index(device, optional=True))


def memory_allocated(device: Any = None) -> int:
    """Bytes currently occupied by tensors on ``device``."""
    return memory_stats(device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device: Any = None) -> int:
    """Peak of ``memory_allocated`` since start or ``reset_peak_memory_stats``."""
    return memory_stats(device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device: Any = None) -> int:
    """Bytes held by the caching allocator on ``device`` (allocated + cached)."""
    return memory_stats(device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device: Any = None) -> int:
    """Peak of ``memory_reserved`` since start or ``reset_peak_memory_stats``."""
    return memory_stats(device).get("reserved_bytes.all.peak", 0)


def reset_peak_memory_stats(device: Any = None) -> None:
    """Reset the ``peak`` statistics of ``device`` to their current values."""
    torch.accelerator.reset_peak_memory_stats(_device_index(device, optional=True))


def reset_accumulated_memory_stats(device: Any = None) -> None:
    """Reset the ``allocated``/``freed`` counters of ``device``."""
    torch.accelerator.reset_accumulated_memory_stats(_device_index(device, optional=True))


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """``(free, total)`` bytes of ``device``'s memory, as the device reports it
    (total is ``KILN_DEVICE_MEMORY``)."""
    return torch.accelerator.get_memory_info(_device_index(device, optional=True))


def _format_size(size: int) -> str:
    for unit in ("B  ", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:6d} {unit}" if unit == "B  " else f"{size:6.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """A printable table of ``memory_stats(device)``: current, peak, total
    allocated and total freed for allocated, active, requested and reserved
    memory, and allocation and segment counts (the layout of
    ``torch.cuda.memory_summary``). ``abbreviated`` omits the per-pool rows."""
    index = _device_index(device, optional=True)
    stats = memory_stats(index)
    rows = [
        ("allocated_bytes", "Allocated memory", True),
        ("active_bytes", "Active memory", True),
        ("requested_bytes", "Requested memory", True),
        ("reserved_bytes", "Device reserved memory", True),
        ("allocation", "Allocations", False),
        ("active", "Active allocs", False),
        ("segment", "Device reserved segments", False),
    ]
    pools = [("all", "")] if abbreviated else [
        ("all", ""), ("large_pool", "  from large pool"), ("small_pool", "  from small pool")]
    width = 75
    lines = ["=" * width,
             f" Kiln memory summary, device kiln:{index}".ljust(width),
             "-" * width,
             f"{'Metric':<28}|{'Cur Usage':>11} |{'Peak Usage':>11} |{'Tot Alloc':>11} |{'Tot Freed':>11}",
             "-" * width]
    for key, title, is_bytes in rows:
        for pool, suffix in pools:
            values = [stats.get(f"{key}.{pool}.{field}", 0)
                      for field in ("current", "peak", "allocated", "freed")]
            cells = [_format_size(v) if is_bytes else f"{v:10d}" for v in values]
            lines.append(f"{(title if not suffix else suffix):<28}|" + "|".join(f"{c:>11} " for c in cells))
        lines.append("-" * width)
    lines.append(f"{'Allocation retries':<28}| {stats.get('num_alloc_retries', 0)}")
    lines.append(f"{'Out-of-memory errors':<28}| {stats.get('num_ooms', 0)}")
    lines.append("=" * width)
    return "\n".join(lines) + "\n"


def _checked_device(device: Any, what: str) -> int:
    """``device`` as a kiln device index, where a negative index is an error."""
    index = _device_index(device, optional=True)
    if index < 0:
        raise ValueError(f"{what}: expected a kiln device (None, an index >= 0, \"kiln:N\" or a "
                         f"torch.device), got {device!r}.")
    return index


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """Limit the memory the caching allocator may reserve on ``device`` to
    ``fraction`` of its capacity, as ``torch.cuda.set_per_process_memory_fraction``.

    Args:
        fraction (float): between 0 and 1; the allocator may reserve at most
            ``fraction * total_memory`` bytes (``total_memory`` is the
            device's capacity, ``KILN_DEVICE_MEMORY``; see ``mem_get_info``).
            1.0 removes the limit.
        device: the kiln device (``None``: the current device).

    An allocation that would need more raises ``torch.OutOfMemoryError`` (after
    releasing cached blocks and retrying, as for a full device) whose message
    names the limit. Memory already reserved is not released when the limit
    is lowered. The limit applies to this process only.

    Raises:
        TypeError: ``fraction`` is not a float (CUDA's rule: ``1`` is rejected,
            pass ``1.0``).
        ValueError: ``fraction`` is outside ``[0, 1]`` or NaN, or ``device`` is
            not a kiln device.
        RuntimeError: the device index is not below ``device_count()``.
    """
    index = _checked_device(device, "set_per_process_memory_fraction")
    if not isinstance(fraction, float):
        raise TypeError(f"set_per_process_memory_fraction: fraction must be a float between 0 and "
                        f"1, got {type(fraction).__name__} {fraction!r}.")
    if math.isnan(fraction) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"set_per_process_memory_fraction: invalid fraction {fraction}; it must be "
                         "between 0 and 1 (the share of the device's capacity this process may use).")
    _C._set_memory_fraction(float(fraction), index)


def get_per_process_memory_fraction(device: Any = None) -> float:
    """The fraction of ``device``'s capacity the allocator may reserve, as set
    by ``set_per_process_memory_fraction`` (1.0 if never set). ``device``:
    ``None`` for the current device. Raises like ``set_per_process_memory_fraction``
    for a bad device."""
    return _C._get_memory_fraction(_checked_device(device, "get_per_process_memory_fraction"))
