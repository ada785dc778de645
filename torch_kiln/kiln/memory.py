"""Memory management of kiln devices (mirrors ``torch.cuda.memory``).

Statistics come from Kiln's caching allocator and use CUDA's
``memory_stats`` key names, so tools written for CUDA read them unchanged.
All sizes are in bytes.

The memory snapshot tools are CUDA's too: ``_record_memory_history`` starts
recording allocator events and the stack of each allocation,
``_snapshot``/``memory_snapshot`` return the allocator's state in
``torch.cuda.memory._snapshot()``'s format, and ``_dump_snapshot`` pickles
it for https://pytorch.org/memory_viz and ``torch.cuda._memory_viz``.
"""

from __future__ import annotations

import collections
import inspect
import math
import pickle
import sys
from typing import Any

import torch

from torch_kiln import _C
from torch_kiln.kiln._utils import _device_index

_ENABLED = ("state", "all")
_CONTEXTS = ("state", "alloc", "all")
_STACKS = ("python", "all")
_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom",
            "snapshot")


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


def _record_memory_history(enabled: str | bool | None = "all", *args, **kwargs) -> None:
    """Record the caching allocator's actions and the stack of every
    allocation, for ``_snapshot()`` (``torch.cuda.memory._record_memory_history``).

    Args:
        enabled: ``None`` stops recording (and drops the recorded trace);
            ``"state"`` keeps the stack of each current allocation;
            ``"all"`` (default) also keeps a trace of every alloc/free event.
        context: which stacks to keep: ``None``, ``"state"`` (of current
            allocations), ``"alloc"`` (also of trace alloc events), ``"all"``
            (default; also of free events).
        stacks: ``"python"`` (Python and TorchScript frames) or ``"all"``
            (default; also C++ frames, slower to gather and symbolize).
        max_entries (int): the trace of each device keeps the newest
            ``max_entries`` events (default: ``sys.maxsize``, unbounded).
        device: accepted for CUDA's signature; recording covers every device,
            as on CUDA (a bad device still raises).
        clear_history (bool): drop what was recorded so far.
        compile_context, global_record_annotations (bool): not supported on
            kiln; True raises ``NotImplementedError``.
        skip_actions (list[str]): trace actions not to record, among
            ``"alloc"``, ``"free_requested"``, ``"free_completed"``,
            ``"segment_alloc"``, ``"segment_free"``, ``"oom"``, ``"snapshot"``.

    ``enabled=True``/``False`` selects CUDA's legacy signature
    (``record_context``, ``trace_alloc_max_entries``,
    ``trace_alloc_record_context``, ``device``, ``record_context_cpp``).

    Recording is off the allocator's hot path while disabled. Stacks are
    gathered on the thread that allocates or frees; a free on a kiln stream's
    worker thread (a kernel held the last reference) has no Python frames.

    Raises:
        ValueError: an unknown ``enabled``, ``context``, ``stacks`` or action,
            or ``max_entries`` below 1.
        TypeError: ``max_entries`` is not an int, or an unexpected argument.
    """
    if isinstance(enabled, bool):
        return _record_memory_history_legacy(enabled, *args, **kwargs)
    return _record_memory_history_impl(enabled, *args, **kwargs)


def _record_memory_history_impl(
    enabled: str | None = "all",
    context: str | None = "all",
    stacks: str = "all",
    max_entries: int = sys.maxsize,
    device: Any = None,
    clear_history: bool = False,
    compile_context: bool = False,
    global_record_annotations: bool = False,
    skip_actions: list[str] | None = None,
) -> None:
    if enabled is not None and enabled not in _ENABLED:
        raise ValueError(f"_record_memory_history: enabled must be 'state', 'all' or None, "
                         f"got {enabled!r}.")
    if context is not None and context not in _CONTEXTS:
        raise ValueError(f"_record_memory_history: context must be 'state', 'alloc', 'all' or "
                         f"None, got {context!r}.")
    if stacks not in _STACKS:
        raise ValueError(f"_record_memory_history: stacks must be 'python' or 'all', got {stacks!r}.")
    if isinstance(max_entries, bool) or not isinstance(max_entries, int):
        raise TypeError(f"_record_memory_history: max_entries must be an int, got "
                        f"{type(max_entries).__name__}.")
    if max_entries < 1:
        raise ValueError(f"_record_memory_history: max_entries must be at least 1, got {max_entries}.")
    if device is not None:
        _checked_device(device, "_record_memory_history")
    for flag, name in ((compile_context, "compile_context"),
                       (global_record_annotations, "global_record_annotations")):
        if flag:
            raise NotImplementedError(f"_record_memory_history: {name}=True is not supported on "
                                      "kiln (torch.compile and record_function annotations are not "
                                      "recorded in kiln's memory history); leave it False.")
    skip = list(skip_actions or [])
    for action in skip:
        if action not in _ACTIONS:
            raise ValueError(f"_record_memory_history: unknown action {action!r} in skip_actions "
                             f"(allowed: {', '.join(_ACTIONS)}).")
    _C._record_memory_history(enabled, context, stacks, min(max_entries, sys.maxsize),
                              bool(clear_history), skip)


_record_memory_history.__signature__ = inspect.signature(_record_memory_history_impl)  # type: ignore[attr-defined]


def _record_memory_history_legacy(
    enabled: bool,
    record_context: bool = True,
    trace_alloc_max_entries: int = 1,
    trace_alloc_record_context: bool = False,
    device: Any = None,
    record_context_cpp: bool = False,
    clear_history: bool = False,
    compile_context: bool = False,
    global_record_annotations: bool = False,
    skip_actions: list[str] | None = None,
) -> None:
    """CUDA's older signature, mapped onto the current one."""
    if not enabled:
        return _record_memory_history_impl(None)
    if trace_alloc_record_context:
        context = "alloc"
    elif record_context:
        context = "state"
    else:
        context = None
    return _record_memory_history_impl(
        "all" if trace_alloc_max_entries > 1 else "state", context,
        "all" if record_context_cpp else "python", trace_alloc_max_entries, device, clear_history,
        compile_context, global_record_annotations, skip_actions)


def _snapshot(device: Any = None, augment_with_fx_traces: bool = False) -> dict[str, Any]:
    """The caching allocator's state on every kiln device, in the format of
    ``torch.cuda.memory._snapshot()``::

        {"segments": [Segment], "device_traces": [[TraceEntry] per device],
         "allocator_settings": {...}}

    A Segment (one allocation from the device runtime, sorted by device and
    address) has ``device``, ``address``, ``total_size``, ``allocated_size``,
    ``active_size``, ``requested_size`` (bytes), ``stream``,
    ``segment_type`` (``"small"``/``"large"`` pool), ``segment_pool_id``,
    ``is_expandable``, ``frames`` (stack of the allocation that created it)
    and ``blocks``: in address order, each with ``address``, ``size``,
    ``requested_size`` (bytes), ``state`` (``"active_allocated"``,
    ``"active_pending_free"``: freed but waiting for another stream's work,
    ``"inactive"``: cached) and ``frames``. A TraceEntry has ``action``
    (``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``,
    ``segment_free``, ``oom``, ``snapshot``), ``addr`` (``device_free`` for
    ``oom``), ``size`` (bytes), ``stream``, ``device``, ``time_us`` (wall
    clock, microseconds) and ``frames``. A frame is
    ``{"filename", "line", "name"}``; frames are empty for memory allocated
    while recording was off. ``stream`` is the kiln stream's ``stream_id``
    (0: the default stream). Traces are empty unless ``_record_memory_history``
    is on; frames only with a ``context``.

    The sum of the active_allocated blocks' sizes of a device is its
    ``memory_allocated()``, the sum of its segments' ``total_size`` its
    ``memory_reserved()``.

    Args:
        device: accepted for CUDA's signature; the snapshot covers every device.
        augment_with_fx_traces (bool): add FX source information to frames
            (``torch._utils._augment_memory_snapshot_stack_traces``).
    """
    if device is not None:
        _checked_device(device, "_snapshot")
    snapshot = _C._memory_snapshot(True)
    if augment_with_fx_traces:
        from torch._utils import _augment_memory_snapshot_stack_traces
        snapshot = _augment_memory_snapshot_stack_traces(snapshot)
    return snapshot


def memory_snapshot(mempool_id: Any = None, include_traces: bool = True) -> list[dict[str, Any]]:
    """The segments of ``_snapshot()``: every kiln segment with its blocks, as
    ``torch.cuda.memory_snapshot`` returns (see ``_snapshot`` for the keys;
    sizes in bytes).

    Args:
        mempool_id: ``None`` or ``(0, 0)``: kiln has only the default memory
            pool (no private pools); anything else raises ``ValueError``.
        include_traces (bool): accepted for CUDA's signature (the segments
            never contain traces).
    """
    if mempool_id is not None and tuple(mempool_id) != (0, 0):
        raise ValueError(f"memory_snapshot: kiln has no private memory pools, so mempool_id must be "
                         f"None or (0, 0), got {mempool_id!r}.")
    return _C._memory_snapshot(False)["segments"]


def _dump_snapshot(filename: str = "dump_snapshot.pickle", augment_with_fx_traces: bool = False) -> None:
    """Pickle ``_snapshot()`` to ``filename``, for https://pytorch.org/memory_viz
    or ``python -m torch.cuda._memory_viz`` (``torch.cuda.memory._dump_snapshot``).
    The file grows with the trace (several KB per entry with stacks); bound it
    with ``_record_memory_history(max_entries=...)``. Raises ``OSError`` if
    the file cannot be written."""
    snapshot = _snapshot(augment_with_fx_traces=augment_with_fx_traces)
    with open(filename, "wb") as f:
        pickle.dump(snapshot, f)
