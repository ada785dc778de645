"""``torch.kiln``: the kiln device API, mirroring ``torch.cuda``.

Devices are numbered ``kiln:0`` to ``kiln:N-1`` where N is
``KILN_DEVICE_COUNT`` (default 2). Every function taking ``device`` accepts
an ``int``, a string such as ``"kiln:1"``, a ``torch.device``, or ``None``
for the current device, and raises ``RuntimeError`` naming the device count
for an index outside ``[0, N)``.
"""

from __future__ import annotations

import atexit
import functools
import glob
import os
import sys
import uuid
from typing import Any

import torch

from torch_kiln import _C
from torch_kiln.kiln import _utils
from torch_kiln.kiln._utils import _device_index
from torch_kiln.kiln import _multiprocessing
from torch_kiln.kiln._multiprocessing import ipc_collect
from torch_kiln.kiln.amp import get_amp_supported_dtype, is_bf16_supported
from torch_kiln.kiln import _autograd_exit, _fused_kernels, amp, graphs, memory, nvtx
from torch_kiln.kiln._device_queries import (
    KilnError,
    can_device_access_peer,
    check_error,
    clock_rate,
    get_arch_list,
    get_gencode_flags,
    is_tf32_supported,
    memory_usage,
    power_draw,
    temperature,
    utilization,
)
from torch_kiln.kiln._mempool import MemPool, use_mem_pool
from torch_kiln.kiln.graphs import (
    KilnGraph,
    graph,
    graph_pool_handle,
    is_current_stream_capturing,
    make_graphed_callables,
)
from torch_kiln.kiln.memory import (
    caching_allocator_alloc,
    caching_allocator_delete,
    caching_allocator_disabled,
    caching_allocator_enable,
    device_memory_used,
    empty_cache,
    get_allocator_backend,
    get_per_process_memory_fraction,
    host_memory_stats,
    host_memory_stats_as_nested_dict,
    list_gpu_processes,
    max_memory_allocated,
    max_memory_cached,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_cached,
    memory_reserved,
    memory_snapshot,
    memory_stats,
    memory_stats_as_nested_dict,
    memory_summary,
    reset_accumulated_host_memory_stats,
    reset_accumulated_memory_stats,
    reset_max_memory_allocated,
    reset_max_memory_cached,
    reset_peak_host_memory_stats,
    reset_peak_memory_stats,
    set_per_process_memory_fraction,
)
from torch_kiln.kiln.op_tracking import (
    clear_op_tracking,
    get_executed_ops,
    get_fused_ops,
    get_sync_debug_mode,
    get_sync_ops,
    set_sync_debug_mode,
)
from torch_kiln.kiln.streams import (
    Event,
    ExternalStream,
    Stream,
    StreamContext,
    current_stream,
    default_stream,
    set_stream,
    stream,
)
from torch_kiln.kiln.random import (
    get_rng_state,
    get_rng_state_all,
    initial_seed,
    manual_seed,
    manual_seed_all,
    seed,
    seed_all,
    set_rng_state,
    set_rng_state_all,
)

# adaptive eager's generated kernels are built by torch_kiln.kernels (a
# callback; no thread starts here)
_fused_kernels.register()

_initialized = False

# torch.cuda.has_half: kiln computes float16 (ATen's CPU kernels).
has_half: bool = True


# At exit, queued device work may run for _EXIT_DRAIN_MS; then what has not
# started is dropped, and a task still running gets _EXIT_TIMEOUT_MS more.
_EXIT_DRAIN_MS = 1000
_EXIT_TIMEOUT_MS = 2000


def _shut_down_at_exit() -> None:
    """At exit: stop accepting device work, let the queues run for
    _EXIT_DRAIN_MS, then drop the queued work that has not started, and say
    so (Note [Shutdown at exit] in runtime/src/host_wait.cc);
    then report a device kernel that failed if the program never synchronized
    afterwards (its error would otherwise go unseen). Waiting for the queues
    instead could last forever while daemon threads keep launching."""
    if not _initialized or _is_in_bad_fork():
        return
    dropped, still_running = _C._shutdown(_EXIT_DRAIN_MS, _EXIT_TIMEOUT_MS)
    if dropped:
        sys.stderr.write(f"torch.kiln: the process exited with {dropped} queued device "
                         f"operation(s) that never ran; synchronize (torch.kiln.synchronize()) "
                         f"before exiting to run them\n")
    if still_running:
        # Checking for unraised errors would wait for it.
        sys.stderr.write(f"torch.kiln: a device operation was still running "
                         f"{_EXIT_DRAIN_MS + _EXIT_TIMEOUT_MS} ms after exit began; it was "
                         f"left running\n")
        return
    for message in _C._pending_errors():
        sys.stderr.write(f"torch.kiln: a device kernel failed and its error was never raised "
                         f"(the program exited without synchronizing): {message}\n")


atexit.register(_shut_down_at_exit)


def _drain_autograd_at_exit() -> None:
    """Before the shutdown above (atexit runs handlers in reverse): Note
    [Autograd device threads at exit] in _autograd_exit.py."""
    if _initialized and not _is_in_bad_fork():
        _autograd_exit.drain_autograd_device_threads()


atexit.register(_drain_autograd_at_exit)


def _lazy_init() -> None:
    """Called by PyTorch before the first kiln tensor is created (and by
    functions here). Raises ``RuntimeError`` in a process forked after kiln
    was initialised, and if no kiln device is available."""
    global _initialized
    if _is_in_bad_fork():
        raise RuntimeError(
            "Cannot re-initialize kiln in a forked subprocess. To use kiln with "
            "multiprocessing, use the 'spawn' start method "
            "(torch.multiprocessing.set_start_method('spawn'))."
        )
    if _initialized:
        return
    _C._init()
    _initialized = True


def _is_in_bad_fork() -> bool:
    """True in a child process forked after kiln was initialised."""
    return _C._is_in_bad_fork()


def is_initialized() -> bool:
    """Whether kiln has been initialised in this process."""
    return _initialized and not _is_in_bad_fork()


def init() -> None:
    """Initialise kiln explicitly (it initialises itself on first use)."""
    _lazy_init()


def is_available() -> bool:
    """True if at least one kiln device is usable. Never raises."""
    return _C._get_device_count() > 0


def device_count() -> int:
    """Number of kiln devices (``KILN_DEVICE_COUNT``, default 2); 0 if the
    runtime cannot start (a warning says why)."""
    count = _utils._device_count()
    return 0 if count is None else count


def current_device() -> int:
    """Index of the calling thread's current kiln device."""
    if torch.compiler.is_compiling():
        return torch.accelerator.current_device_index()  # Note [torch.kiln under torch.compile]
    return _C._get_device()


def set_device(device: Any) -> None:
    """Set the calling thread's current kiln device. A negative index is a
    no-op, as in ``torch.cuda.set_device``."""
    index = _device_index(device)
    if index >= 0:
        _C._set_device(index)


class device:
    """Context manager that makes ``device`` current for its block, then
    restores the previous one (``torch.cuda.device``). ``None`` or a negative
    index is a no-op."""

    def __init__(self, device: Any):
        self.idx = _device_index(device, optional=True)
        self.prev_idx = -1

    def __enter__(self):
        self.prev_idx = _C._exchange_device(self.idx)

    def __exit__(self, exc_type, exc_value, traceback):
        self.idx = _C._maybe_exchange_device(self.prev_idx)
        return False


class device_of(device):
    """``device`` context manager for the device of tensor ``obj`` (no-op for
    a CPU tensor)."""

    def __init__(self, obj: torch.Tensor):
        idx = obj.get_device() if obj.device.type == "kiln" else -1
        super().__init__(idx)


def synchronize(device: Any = None) -> None:
    """Wait for all work on every stream of ``device`` (default: current),
    raising the error of a failed kernel if one is pending.

    Inside a function compiled with ``torch.compile`` this traces into the
    graph, as ``torch.cuda.synchronize()`` does (Note [torch.kiln under
    torch.compile] in ``streams.py``)."""
    index = _device_index(device, optional=True)
    if torch.compiler.is_compiling():
        torch.accelerator.synchronize(torch.device("kiln", index))
        return
    _C._synchronize(index)


_CAPABILITY = (1, 0)  # see get_device_capability


@functools.cache
def _host_l2_cache_size() -> int:
    """Bytes of the L2 cache of host CPU 0, from Linux's sysfs; 0 if unknown
    (read once: a few hundred microseconds)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for cache in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            with open(os.path.join(cache, "level")) as level, open(os.path.join(cache, "size")) as size:
                if level.read().strip() != "2":
                    continue
                text = size.read().strip()
        except OSError:
            continue
        if text[-1:] in units and text[:-1].isdigit():
            return int(text[:-1]) * units[text[-1]]
        return int(text) if text.isdigit() else 0
    return 0


class _KilnDeviceProperties:
    """Properties of a kiln device (like ``torch.cuda.get_device_properties``):
    ``name`` (str), ``total_memory`` (bytes, ``KILN_DEVICE_MEMORY``),
    ``multi_processor_count`` (host cores its kernels may use), and ``major``
    and ``minor`` (1 and 0: kiln has no compute capability levels, see
    ``get_device_capability``); and the device's tile model, which kl kernels
    are checked against (torch_kiln/kl/tile_model.py): ``tile_max_partition_dim``
    (largest leading tile dimension), ``tile_partitions``,
    ``tile_scratch_bytes_per_partition`` (on-chip scratch per partition, bytes)
    and ``tile_dtypes`` (tuple of torch.dtype). ``pci_bus_id`` (int) says
    which of the ``KILN_DEVICE_COUNT`` devices this is, whatever number
    ``KILN_VISIBLE_DEVICES`` gives it (as CUDA's names the board behind a
    renumbered GPU).

    CUDA's other fields, for code that reads them, describe the host cores
    the kernels run on: ``uuid`` (a ``uuid.UUID`` fixed per ``pci_bus_id``,
    the same in every process), ``L2_cache_size`` (bytes of host CPU 0's L2
    cache, from Linux's sysfs; 0 if the host does not say), ``warp_size``
    and ``max_threads_per_multi_processor`` (1: a kernel's work item is one
    host thread, with no SIMT lanes), ``is_integrated`` and
    ``is_multi_gpu_board`` (0: a kiln device has its own memory and is one
    device), ``pci_device_id`` and ``pci_domain_id`` (0)."""

    def __init__(self, name: str, total_memory: int, multi_processor_count: int, pci_bus_id: int):
        from torch_kiln.kl import tile_model

        self.name = name
        self.total_memory = total_memory
        self.multi_processor_count = multi_processor_count
        self.pci_bus_id = pci_bus_id
        self.pci_device_id = 0
        self.pci_domain_id = 0
        self.uuid = uuid.uuid5(uuid.NAMESPACE_URL, f"kiln://reference-device/{pci_bus_id}")
        self.L2_cache_size = _host_l2_cache_size()
        self.warp_size = 1
        self.max_threads_per_multi_processor = 1
        self.is_integrated = 0
        self.is_multi_gpu_board = 0
        self.major, self.minor = _CAPABILITY
        self.tile_max_partition_dim = tile_model.MAX_PARTITION_DIM
        self.tile_partitions = tile_model.PARTITIONS
        self.tile_scratch_bytes_per_partition = tile_model.SCRATCH_BYTES_PER_PARTITION
        self.tile_dtypes = tile_model.DTYPES

    def __repr__(self) -> str:
        return (
            f"_KilnDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
            f"total_memory={self.total_memory // (1024 * 1024)}MB, "
            f"multi_processor_count={self.multi_processor_count})"
        )


def get_device_properties(device: Any = None) -> _KilnDeviceProperties:
    """Properties of ``device`` (default: current)."""
    return _KilnDeviceProperties(*_C._get_device_properties(_device_index(device, optional=True)))


def get_device_name(device: Any = None) -> str:
    """Name of ``device`` (default: current)."""
    return get_device_properties(device).name


def _sleep(milliseconds: float) -> None:
    """Queue device work on the current stream that takes ``milliseconds``
    (the counterpart of ``torch.cuda._sleep``, for tests of stream order)."""
    _C._sleep(float(milliseconds))


# Raised when a kiln allocation fails (torch.cuda.OutOfMemoryError is the
# same class).
OutOfMemoryError = torch.OutOfMemoryError


def get_device_capability(device: Any = None) -> tuple[int, int]:
    """``(major, minor)`` of ``device`` (default: current), as
    ``torch.cuda.get_device_capability`` returns CUDA's compute capability.

    Kiln has no compute capability levels (every kiln device runs every
    kernel, see ``torch.accelerator.get_device_capability()["supported_dtypes"]``
    for the dtypes), so this is ``(1, 0)`` for every device, also the
    ``major``/``minor`` of ``get_device_properties``: below every CUDA level,
    so code gating a CUDA-only feature on ``>= (x, y)`` (TF32, Flash
    attention kernels) takes its portable path. Raises ``RuntimeError`` for
    an invalid device (a negative index included), as
    ``get_device_properties`` does."""
    _C._get_device_properties(_device_index(device, optional=True))  # checks the index
    return _CAPABILITY


_multiprocessing.register()  # kiln tensors on torch.multiprocessing queues

# torch.kiln.FloatTensor, ..., BoolTensor: the legacy typed tensor classes, as
# torch.cuda has them (Note [Legacy typed tensor classes] in
# torch_kiln/csrc/python/LegacyTensorTypes.cc).
_LEGACY_TENSOR_TYPES = (
    "BFloat16Tensor",
    "BoolTensor",
    "ByteTensor",
    "CharTensor",
    "DoubleTensor",
    "FloatTensor",
    "HalfTensor",
    "IntTensor",
    "LongTensor",
    "ShortTensor",
)
_C._add_legacy_tensor_types(sys.modules[__name__])

__all__ = [
    *_LEGACY_TENSOR_TYPES,
    "Event",
    "ExternalStream",
    "KilnError",
    "MemPool",
    "OutOfMemoryError",
    "Stream",
    "StreamContext",
    "caching_allocator_alloc",
    "caching_allocator_delete",
    "caching_allocator_disabled",
    "caching_allocator_enable",
    "can_device_access_peer",
    "check_error",
    "clear_op_tracking",
    "clock_rate",
    "current_stream",
    "default_generators",
    "default_stream",
    "current_device",
    "device",
    "device_count",
    "device_memory_used",
    "device_of",
    "empty_cache",
    "get_allocator_backend",
    "get_arch_list",
    "get_device_capability",
    "get_gencode_flags",
    "ipc_collect",
    "get_device_name",
    "get_device_properties",
    "get_amp_supported_dtype",
    "get_per_process_memory_fraction",
    "get_executed_ops",
    "get_fused_ops",
    "get_rng_state",
    "get_rng_state_all",
    "get_sync_debug_mode",
    "get_sync_ops",
    "graph",
    "graph_pool_handle",
    "has_half",
    "host_memory_stats",
    "host_memory_stats_as_nested_dict",
    "init",
    "initial_seed",
    "is_available",
    "is_bf16_supported",
    "is_current_stream_capturing",
    "is_initialized",
    "is_tf32_supported",
    "KilnGraph",
    "list_gpu_processes",
    "make_graphed_callables",
    "manual_seed",
    "manual_seed_all",
    "max_memory_allocated",
    "max_memory_cached",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_cached",
    "memory_reserved",
    "memory_snapshot",
    "memory_stats",
    "memory_stats_as_nested_dict",
    "memory_summary",
    "memory_usage",
    "power_draw",
    "reset_accumulated_host_memory_stats",
    "reset_accumulated_memory_stats",
    "reset_max_memory_allocated",
    "reset_max_memory_cached",
    "reset_peak_host_memory_stats",
    "reset_peak_memory_stats",
    "seed",
    "seed_all",
    "set_device",
    "set_per_process_memory_fraction",
    "set_rng_state",
    "set_rng_state_all",
    "set_stream",
    "set_sync_debug_mode",
    "stream",
    "synchronize",
    "temperature",
    "use_mem_pool",
    "utilization",
]

# Inductor's lazy hook for a PrivateUse1 device (init_backend_registration in
# torch/_inductor/codegen/common.py) looks these names up on torch.kiln the
# first time Inductor compiles anything. Kiln uses the lookup as its trigger
# and registers itself (torch_kiln.compiler.inductor.register), with the
# custom backend pass that carries kiln's part of the cache key, which the
# hook's own registration would drop; the names then stay undefined so the
# hook keeps that registration instead of overwriting it.
_INDUCTOR_HOOK_NAMES = frozenset(
    ("Scheduling", "PythonWrapperCodegen", "CppWrapperCodegen", "WrapperFxCodegen")
)


def __dir__() -> list[str]:
    # default_generators is made on first access (below) but listed as torch.cuda's is.
    return sorted(set(globals()) | {"default_generators"})


def __getattr__(name: str) -> Any:
    if name == "default_generators":
        # torch.cuda.default_generators: each device's default generator,
        # made on first access (making them initialises kiln, which must
        # not happen at import: a later fork would be a bad fork).
        global default_generators
        _lazy_init()
        default_generators = tuple(_C._get_default_generator(i) for i in range(device_count()))
        return default_generators
    if name in _INDUCTOR_HOOK_NAMES:
        from torch_kiln.compiler.inductor import register

        register()
    raise AttributeError(f"module 'torch.kiln' has no attribute '{name}'")
