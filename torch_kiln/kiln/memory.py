"""Memory management of kiln devices (mirrors ``torch.cuda.memory``).

Statistics come from Kiln's caching allocator and use CUDA's
``memory_stats`` key names, so tools written for CUDA read them unchanged.
All sizes are in bytes.

The memory snapshot tools are CUDA's too: ``_record_memory_history`` starts
recording allocator events and the stack of each allocation,
``_snapshot``/``memory_snapshot`` return the allocator's state in
``torch.cuda.memory._snapshot()``'s format, and ``_dump_snapshot`` pickles
it for https://pytorch.org/memory_viz and ``torch.cuda._memory_viz``.

Also here, as in ``torch.cuda.memory``: the deprecated aliases
(``memory_cached``, ``reset_max_memory_allocated``, ...), raw allocations
(``caching_allocator_alloc``/``_delete``), switching caching off
(``caching_allocator_enable``), the pinned host allocator's statistics
(``host_memory_stats``), ``device_memory_used``, ``list_gpu_processes`` and
``get_allocator_backend``.
Memory pools (``MemPool``, ``use_mem_pool``) live in ``_mempool.py``.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import math
import pickle
import sys
import warnings
from typing import Any

import torch
from typing_extensions import deprecated

from torch_kiln import _C
from torch_kiln.kiln._utils import _checked_device, _device_index

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


def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
    """``memory_stats(device)`` as a nested dictionary, as
    ``torch.cuda.memory_stats_as_nested_dict`` returns it:
    ``stats["allocated_bytes"]["all"]["current"]`` is
    ``memory_stats()["allocated_bytes.all.current"]`` (bytes); the event
    counters (``"num_ooms"``, ...) are at the top level. Raises like
    ``memory_stats`` for a bad device."""
    nested: dict[str, Any] = {}
    for key, value in memory_stats(device).items():
        *path, last = key.split(".")
        level = nested
        for part in path:
            level = level.setdefault(part, {})
        level[last] = value
    return nested


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


def reset_max_memory_allocated(device: Any = None) -> None:
    """Deprecated, as in CUDA: calls ``reset_peak_memory_stats(device)``, which
    resets *all* peak statistics, with CUDA's ``FutureWarning`` saying so."""
    warnings.warn(
        "torch.kiln.reset_max_memory_allocated now calls torch.kiln.reset_peak_memory_stats, "
        "which resets /all/ peak memory stats.", FutureWarning, stacklevel=2)
    reset_peak_memory_stats(device)


def reset_max_memory_cached(device: Any = None) -> None:
    """Deprecated, as in CUDA: calls ``reset_peak_memory_stats(device)``, which
    resets *all* peak statistics, with CUDA's ``FutureWarning`` saying so."""
    warnings.warn(
        "torch.kiln.reset_max_memory_cached now calls torch.kiln.reset_peak_memory_stats, "
        "which resets /all/ peak memory stats.", FutureWarning, stacklevel=2)
    reset_peak_memory_stats(device)


@deprecated("`torch.kiln.memory_cached` has been renamed to `torch.kiln.memory_reserved`",
            category=FutureWarning)
def memory_cached(device: Any = None) -> int:
    """Deprecated alias of ``memory_reserved`` (bytes), with CUDA's ``FutureWarning``."""
    return memory_reserved(device)


@deprecated("`torch.kiln.max_memory_cached` has been renamed to `torch.kiln.max_memory_reserved`",
            category=FutureWarning)
def max_memory_cached(device: Any = None) -> int:
    """Deprecated alias of ``max_memory_reserved`` (bytes), with CUDA's ``FutureWarning``."""
    return max_memory_reserved(device)


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


def _pool_id(mempool_id: Any, what: str) -> tuple[int, int]:
    """``mempool_id`` as a pool id kiln handed out, or ``(0, 0)``."""
    if not (isinstance(mempool_id, (tuple, list)) and len(mempool_id) == 2 and
            all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in mempool_id)):
        raise TypeError(f"{what}: mempool_id must be None or a pool id (a tuple of two ints, "
                        f"torch.kiln.MemPool().id or a graph's pool()), got {mempool_id!r}.")
    pool = (int(mempool_id[0]), int(mempool_id[1]))
    if pool != (0, 0) and not _C._mempool_is_issued(pool):
        raise ValueError(f"{what}: {pool} is not a memory pool kiln made (pool ids come from "
                         "torch.kiln.MemPool().id, torch.kiln.graph_pool_handle() and "
                         "KilnGraph.pool()); pass one of those, or None for every pool.")
    return pool


def memory_snapshot(mempool_id: Any = None, include_traces: bool = True) -> list[dict[str, Any]]:
    """The segments of ``_snapshot()``: every kiln segment with its blocks, as
    ``torch.cuda.memory_snapshot`` returns (see ``_snapshot`` for the keys;
    sizes in bytes).

    Args:
        mempool_id: ``None`` or ``(0, 0)``: every segment; the id of a memory
            pool (``MemPool.id``, ``graph_pool_handle()``, ``KilnGraph.pool()``):
            only the segments of that pool (their ``segment_pool_id``), on
            every device.
        include_traces (bool): accepted for CUDA's signature (the segments
            never contain traces).

    Raises:
        TypeError: ``mempool_id`` is not ``None`` or a pair of ints.
        ValueError: ``mempool_id`` is not a pool kiln made.
    """
    pool = (0, 0) if mempool_id is None else _pool_id(mempool_id, "memory_snapshot")
    return _C._memory_snapshot(False, pool)["segments"]


def _dump_snapshot(filename: str = "dump_snapshot.pickle", augment_with_fx_traces: bool = False) -> None:
    """Pickle ``_snapshot()`` to ``filename``, for https://pytorch.org/memory_viz
    or ``python -m torch.cuda._memory_viz`` (``torch.cuda.memory._dump_snapshot``).
    The file grows with the trace (several KB per entry with stacks); bound it
    with ``_record_memory_history(max_entries=...)``. Raises ``OSError`` if
    the file cannot be written."""
    snapshot = _snapshot(augment_with_fx_traces=augment_with_fx_traces)
    with open(filename, "wb") as f:
        pickle.dump(snapshot, f)


def _stream_id_for(stream: Any, index: int, what: str) -> int:
    """The c10 stream id of ``stream`` (a kiln ``torch.Stream`` of device
    ``index``, or a runtime stream handle as ``Stream.kiln_stream`` gives)."""
    if isinstance(stream, torch.Stream):
        if stream.device.type != "kiln" or stream.device_index != index:
            raise ValueError(f"{what}: the stream {stream} is not a stream of kiln:{index}; pass "
                             f"a stream of that device (torch.kiln.current_stream({index})).")
        return stream.stream_id
    if isinstance(stream, int) and not isinstance(stream, bool):
        if not 0 <= stream < 1 << 64:
            raise ValueError(f"{what}: {stream} is not a kiln runtime stream handle (an address).")
        if stream == 0:  # NULL: the device's default stream (stream id 0), as in the runtime API
            return 0
        try:
            stream_id, stream_device, _ = _C._stream_from_external(stream, -1)
        except ValueError as e:
            raise ValueError(f"{what}: {stream:#x} is not a kiln runtime stream ({e})") from None
        if stream_device != index:
            raise ValueError(f"{what}: the stream {stream:#x} is not a stream of kiln:{index} (it "
                             f"belongs to kiln:{stream_device}); pass a stream of that device.")
        return stream_id
    raise TypeError("Invalid type for stream argument, must be `torch.kiln.Stream` or `int` "
                    f"representing a pointer to an existing stream, got {type(stream).__name__}.")


def caching_allocator_alloc(size: int, device: Any = None, stream: Any = None) -> int:
    """Allocate ``size`` bytes of device memory from kiln's caching allocator,
    outside any tensor, as ``torch.cuda.caching_allocator_alloc`` (for other
    libraries working on kiln memory). Returns the address (an ``int``; 0 for
    ``size == 0``). Free it with ``caching_allocator_delete``; until then it
    counts in ``memory_allocated``.

    Args:
        size (int): bytes, at least 0.
        device: the kiln device (``None``: the current device).
        stream: the stream that will use the memory (``None``: the device's
            current stream): a ``torch.kiln.Stream`` of that device, or a
            runtime stream handle (``int``, ``Stream.kiln_stream``). As for a
            tensor, the block is reused at once by later allocations on that
            stream after it is freed; use from another stream must be ordered
            by the caller.

    Raises:
        TypeError: ``size`` is not an int, or ``stream`` is neither a stream
            nor an int.
        ValueError: ``size`` is negative, ``device`` is not a kiln device, or
            ``stream`` belongs to another device (or is an unknown handle).
        RuntimeError: the device index is not below ``device_count()``.
        torch.OutOfMemoryError: the device cannot hold ``size`` more bytes.
    """
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"caching_allocator_alloc: size must be an int (bytes), got "
                        f"{type(size).__name__} {size!r}.")
    if size < 0:
        raise ValueError(f"caching_allocator_alloc: size must be at least 0 bytes, got {size}.")
    index = _checked_device(device, "caching_allocator_alloc")
    from torch_kiln.kiln import _lazy_init
    _lazy_init()
    if stream is None:
        stream = torch.accelerator.current_stream(index)
    stream_id = _stream_id_for(stream, index, "caching_allocator_alloc")
    return _C._caching_allocator_raw_alloc(size, index, stream_id)


def caching_allocator_delete(mem_ptr: int) -> None:
    """Free memory from ``caching_allocator_alloc`` (``torch.cuda.caching_allocator_delete``).
    The device and stream are the ones it was allocated for; the block returns
    to the cache of that stream. 0 is a no-op.

    Raises:
        TypeError: ``mem_ptr`` is not an int.
        RuntimeError: ``mem_ptr`` is not an address ``caching_allocator_alloc``
            returned, or was freed already.
    """
    if isinstance(mem_ptr, bool) or not isinstance(mem_ptr, int):
        raise TypeError(f"caching_allocator_delete: mem_ptr must be an int (an address from "
                        f"caching_allocator_alloc), got {type(mem_ptr).__name__}.")
    _C._caching_allocator_raw_delete(mem_ptr)


def caching_allocator_enable(value: bool = True) -> None:
    """Turn caching on (``True``, the default state) or off, on every kiln device
    (``torch.cuda.caching_allocator_enable``).

    Off, no freed block is reused: every allocation gets memory of its own
    rounded size from the device runtime, and what was freed goes back to the
    runtime at the next allocation or ``empty_cache()`` (each return waits for
    the device, as ``cudaFree`` does, so this is slow: for debugging and for
    sharing the device with another allocator). Unlike CUDA's uncached mode,
    statistics stay exact, and the setting also holds before kiln is
    initialised (CUDA ignores the call then). Memory pools (graph pools,
    ``MemPool``) keep caching, since their blocks must stay theirs.

    Raises ``TypeError`` if ``value`` is not a bool.
    """
    if not isinstance(value, bool):
        raise TypeError(f"caching_allocator_enable: value must be a bool, got "
                        f"{type(value).__name__} {value!r}.")
    _C._caching_allocator_enable(value)


@contextlib.contextmanager
def caching_allocator_disabled():
    """Context manager that turns caching off for its block and restores the
    previous setting (``torch.cuda.caching_allocator_disabled``); see
    ``caching_allocator_enable``."""
    previous = _C._caching_allocator_is_enabled()
    caching_allocator_enable(False)
    try:
        yield
    finally:
        caching_allocator_enable(previous)


def get_allocator_backend() -> str:
    """``"native"``: kiln's own caching allocator (the only backend; kiln reads no
    ``PYTORCH_ALLOC_CONF`` backend setting), as ``torch.cuda.get_allocator_backend``
    names PyTorch's native allocator."""
    return "native"


def _flatten(prefix: str, value: Any, out: list) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else key, inner, out)
    else:
        out.append((prefix, value))


def host_memory_stats_as_nested_dict() -> dict[str, Any]:
    """``host_memory_stats()`` as a nested dictionary
    (``torch.cuda.host_memory_stats_as_nested_dict``)."""
    return _C._host_memory_stats()


def host_memory_stats() -> collections.OrderedDict:
    """Statistics of the pinned host allocator (``pin_memory()``,
    ``DataLoader(pin_memory=True)``, ``torch.empty(..., pin_memory=True)``),
    with the keys of ``torch.cuda.host_memory_stats``: PyTorch's caching host
    allocator serves kiln's pinned memory, as it serves CUDA's.

    - ``"allocations.{current,peak,allocated,freed}"``: pinned blocks the
      allocator owns (in use and cached);
    - ``"allocated_bytes.{...}"``: their bytes (block sizes are rounded up to
      a power of two);
    - ``"active_requests.{...}"`` / ``"active_bytes.{...}"``: blocks (bytes)
      handed out and not yet reusable;
    - ``"num_host_alloc"`` / ``"num_host_free"``: blocks made by and returned
      to the runtime (``kilnMallocHost``/``kilnFreeHost``);
    - ``"host_alloc_time.{total,max,min,count,avg}"`` and
      ``"host_free_time.{...}"``: microseconds spent in those calls.
    """
    result: list = []
    _flatten("", host_memory_stats_as_nested_dict(), result)
    result.sort()
    return collections.OrderedDict(result)


def reset_accumulated_host_memory_stats() -> None:
    """Reset the ``allocated``/``freed`` counters (and the timing totals) of
    ``host_memory_stats()``."""
    _C._reset_accumulated_host_memory_stats()


def reset_peak_host_memory_stats() -> None:
    """Reset the ``peak`` values of ``host_memory_stats()`` to the current ones."""
    _C._reset_peak_host_memory_stats()


def device_memory_used(device: Any = None) -> int:
    """Bytes of ``device``'s memory in use, as the device reports it: its
    capacity minus its free memory (``mem_get_info``), so memory the caching
    allocator reserves counts, as in ``nvidia-smi`` (``torch.cuda.device_memory_used``).
    Raises like ``mem_get_info`` for a bad device."""
    free, total = mem_get_info(device)
    return total - free


def list_gpu_processes(device: Any = None) -> str:
    """A printable list of the processes using ``device`` and their memory, in
    the layout of ``torch.cuda.list_gpu_processes``::

        kiln:0
        process      12345 uses       12.000 MB GPU memory

    Each process has its own instance of the reference device (its memory is
    the process's), so the list is this process, with the device memory it
    holds (``device_memory_used``, MB of 2**20 bytes); memory another process
    shared with it (kiln tensors received through ``torch.multiprocessing``)
    is counted by its owner. Raises like ``memory_stats`` for a bad device."""
    import os

    index = _checked_device(device, "list_gpu_processes")
    used = device_memory_used(index)
    lines = [f"kiln:{index}"]
    if used == 0:
        lines.append("no processes are running")
    else:
        lines.append(f"process {os.getpid():>10d} uses {used / (1024 * 1024):>12.3f} MB GPU memory")
    return "\n".join(lines)


def is_initialized() -> bool:
    """Whether kiln has been initialised in this process (as
    ``torch.cuda.memory.is_initialized``, which is ``torch.cuda.is_initialized``)."""
    from torch_kiln import kiln

    return kiln.is_initialized()


# `from torch.kiln.memory import MemPool, use_mem_pool`, as CUDA code imports
# them from torch.cuda.memory. Last: _mempool imports this module's helpers.
from torch_kiln.kiln._mempool import MemPool, use_mem_pool  # noqa: E402, F401
