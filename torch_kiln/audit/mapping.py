"""``--map-cuda``: make an unmodified CUDA program run on kiln, for one run.

Note [Mapping CUDA to kiln]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The mapping has two parts, both undone when :class:`CudaMapping` exits:

1. **Arguments**, rewritten by the audit's ``TorchFunctionMode``
   (:mod:`torch_kiln.audit.tracer` calls :func:`map_call` on every call that
   reaches ``__torch_function__``): a ``"cuda"``/``"cuda:N"`` string or a
   ``torch.device`` of type ``cuda`` passed to a torch function becomes
   ``kiln``/``kiln:N``; ``torch.device("cuda")`` itself constructs
   ``kiln:0`` (``torch.device`` is a C type, but its constructor does go
   through ``__torch_function__``); ``Tensor.cuda()`` becomes
   ``Tensor.to("kiln:N")``.
2. **Attributes**, patched for the run: ``torch.cuda.is_available`` (True),
   ``device_count``, ``synchronize``, ``manual_seed``, streams, events, the
   memory queries and the other functions ``torch.kiln`` mirrors;
   ``torch.cuda.amp.autocast``/``GradScaler``; ``torch.autocast`` and
   ``torch.amp.GradScaler`` given ``"cuda"``; ``nn.Module.cuda``;
   ``torch.load``'s ``map_location`` (a device, a string or a dict of
   them) and ``torch.Generator(device=...)``, which do not reach
   ``__torch_function__``; CUDA graphs (``torch.cuda.CUDAGraph`` becomes
   ``torch.kiln.KilnGraph``, ``torch.cuda.graph`` kiln's); NVTX ranges
   become ``torch.kiln.nvtx`` ranges (``record_function``, seen by
   ``torch.profiler``); an ``"nccl"`` backend given to
   ``torch.distributed.init_process_group`` or ``new_group`` becomes
   ``"kccl"``.

Limits (what the mapping cannot see): a device made with ``torch.device``
reads ``type == "kiln"`` afterwards, so a program's own ``device.type ==
"cuda"`` branches take their non-CUDA side (the static findings list every
such branch); ``Tensor.is_cuda`` is False for kiln tensors; code that calls
``torch._C._cuda_*`` directly, CUDA extensions, Triton kernels and CUDA-only
libraries still fail (they are findings, not something to map); names bound
with ``from torch.cuda import synchronize`` *before* the mapping started keep
the original (the audited script is started after the mapping, so its own
imports see the patched functions).
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any, Callable

import torch

__all__ = ["CudaMapping", "map_call", "map_device"]

_CUDA_DEVICE = re.compile(r"cuda(?::(\d+))?")

# torch.cuda functions that become torch.kiln's function of the same name.
_SAME_NAME = (
    "current_device", "set_device", "device", "device_of", "synchronize", "manual_seed",
    "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state", "set_rng_state",
    "get_rng_state_all", "set_rng_state_all", "empty_cache", "memory_allocated",
    "max_memory_allocated", "memory_reserved", "max_memory_reserved", "memory_stats",
    "memory_summary", "memory_snapshot", "reset_peak_memory_stats",
    "reset_accumulated_memory_stats", "mem_get_info", "get_device_name",
    "get_device_capability", "is_bf16_supported", "current_stream",
    "default_stream", "set_stream", "stream", "Stream", "Event", "StreamContext",
    "set_per_process_memory_fraction", "get_per_process_memory_fraction", "ipc_collect",
    "device_count", "init", "is_initialized",
    # graphs
    "graph", "graph_pool_handle", "is_current_stream_capturing", "make_graphed_callables",
    # memory
    "memory_stats_as_nested_dict", "reset_max_memory_allocated", "reset_max_memory_cached",
    "memory_cached", "max_memory_cached", "caching_allocator_alloc", "caching_allocator_delete",
    "caching_allocator_enable", "caching_allocator_disabled", "get_allocator_backend",
    "MemPool", "use_mem_pool", "host_memory_stats", "host_memory_stats_as_nested_dict",
    "reset_accumulated_host_memory_stats", "reset_peak_host_memory_stats",
    "device_memory_used", "list_gpu_processes",
    # device queries and debugging
    "can_device_access_peer", "is_tf32_supported", "get_arch_list", "get_gencode_flags",
    "set_sync_debug_mode", "get_sync_debug_mode", "utilization", "memory_usage",
    "temperature", "power_draw", "clock_rate",
)

# torch.cuda names whose kiln counterpart has another name.
_RENAMED = {"CUDAGraph": "KilnGraph"}


def map_device(value: Any) -> Any:
    """``value`` with a CUDA device replaced by the same-index kiln device;
    anything else is returned unchanged. Accepts ``str`` and ``torch.device``."""
    if isinstance(value, str):
        match = _CUDA_DEVICE.fullmatch(value)
        if match:
            return f"kiln:{match.group(1)}" if match.group(1) else "kiln"
    elif isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("kiln", value.index) if value.index is not None else torch.device("kiln")
    return value


def map_call(func: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple, dict]:
    """The call to make instead of ``func(*args, **kwargs)`` under the
    mapping (see Note [Mapping CUDA to kiln])."""
    if func is torch.Tensor.cuda:
        device = kwargs.pop("device", args[1] if len(args) > 1 else None)
        if isinstance(device, int):
            target = torch.device("kiln", device)
        else:
            target = map_device(device) if device is not None else "kiln"
        return torch.Tensor.to, (args[0], target), kwargs
    if func is torch.device:
        if args and isinstance(args[0], str) and _CUDA_DEVICE.fullmatch(args[0]):
            return func, (map_device(args[0]),) + tuple(args[1:]), kwargs
        if args and args[0] == "cuda":  # torch.device("cuda", 1)
            return func, ("kiln",) + tuple(args[1:]), kwargs
        return func, args, kwargs
    new_args = tuple(map_device(a) for a in args)
    new_kwargs = {k: map_device(v) for k, v in kwargs.items()}
    return func, new_args, new_kwargs


def _kiln_backend(backend: Any) -> Any:
    """A process-group backend string with NCCL replaced by kccl, kiln's
    collectives ("nccl" -> "kccl", "cpu:gloo,cuda:nccl" ->
    "cpu:gloo,kiln:kccl"); anything else unchanged."""
    if not isinstance(backend, str) or "nccl" not in backend.lower():
        return backend
    parts = []
    for part in backend.split(","):
        device, _, name = part.rpartition(":")
        if name.strip().lower() == "nccl":
            name = "kccl"
        parts.append(f"{'kiln' if device.strip() == 'cuda' else device}:{name}" if device
                     else name)
    return ",".join(parts)


def _backend_on_kiln(function: Callable) -> Callable:
    """torch.distributed.init_process_group / new_group under the mapping:
    an NCCL backend (by keyword or first positional argument) becomes kccl
    (without it: "Distributed package doesn't have NCCL built in")."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = _kiln_backend(kwargs["backend"])
        elif args and function.__name__ == "init_process_group":
            args = (_kiln_backend(args[0]),) + args[1:]
        return function(*args, **kwargs)

    return wrapper


def _cuda_device_properties(device: Any = None):
    """torch.cuda.get_device_properties under the mapping: the kiln device's
    properties, plus ``gcnArchName`` (its name). PyTorch's CUDA properties
    have that field, and Inductor's cache key (CacheBase.get_system) reads
    it whenever ``torch.version.cuda`` is None, as on the CPU build kiln runs
    on: without it every ``torch.compile`` with the default backend failed
    under --map-cuda with AttributeError."""
    properties = torch.kiln.get_device_properties(map_device(device))
    properties.gcnArchName = properties.name
    return properties


def _kiln_autocast(enabled: bool = True, dtype: torch.dtype = torch.float16,
                   cache_enabled: bool = True):
    """torch.cuda.amp.autocast under --map-cuda (same arguments and defaults)."""
    return torch.amp.autocast("kiln", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


def _kiln_grad_scaler(*args, **kwargs):
    """torch.cuda.amp.GradScaler under --map-cuda (same arguments)."""
    return torch.amp.GradScaler("kiln", *args, **kwargs)


def _generator_on_kiln() -> type:
    """torch.Generator under --map-cuda: ``torch.Generator(device="cuda")``
    makes a kiln generator. A subclass whose constructor returns the real
    type, with an instance check that accepts every ``torch._C.Generator``,
    so ``isinstance(g, torch.Generator)`` stays true everywhere."""
    base = torch._C.Generator

    class _Meta(type(base)):
        def __instancecheck__(cls, obj) -> bool:
            return isinstance(obj, base)

        def __subclasscheck__(cls, other) -> bool:
            return issubclass(other, base)

    class Generator(base, metaclass=_Meta):
        __doc__ = base.__doc__

        def __new__(cls, device="cpu"):
            return base(map_device(device))

    return Generator


class CudaMapping(contextlib.AbstractContextManager):
    """Patches ``torch.cuda``, ``torch.autocast``, ``torch.amp.GradScaler`` and
    ``nn.Module.cuda`` so that CUDA requests reach kiln; restores every
    attribute on exit (also if the body raises). Argument rewriting is the
    tracer's job (:func:`map_call`). Not re-entrant; not thread-safe (it
    patches modules, as a test's monkeypatch does). Raises ``RuntimeError``
    if the kiln device is not available."""

    def __init__(self) -> None:
        self._saved: list[tuple[object, str, object, bool]] = []

    def _set(self, owner: object, name: str, value: object) -> None:
        had = name in vars(owner) if isinstance(owner, type) else hasattr(owner, name)
        self._saved.append((owner, name, getattr(owner, name, None), had))
        setattr(owner, name, value)

    def __enter__(self) -> "CudaMapping":
        if not hasattr(torch, "kiln") or not torch.kiln.is_available():
            raise RuntimeError("--map-cuda needs the kiln device, and torch.kiln is not "
                               "available; is torch_kiln installed and importable?")
        kiln = torch.kiln
        cuda = torch.cuda
        self._set(cuda, "is_available", lambda: True)
        for name in _SAME_NAME:
            if hasattr(kiln, name):
                self._set(cuda, name, getattr(kiln, name))
        for cuda_name, kiln_name in _RENAMED.items():
            self._set(cuda, cuda_name, getattr(kiln, kiln_name))
        self._set(cuda, "get_device_properties", _cuda_device_properties)
        amp = torch.cuda.amp
        self._set(amp, "autocast", _kiln_autocast)
        self._set(amp, "GradScaler", _kiln_grad_scaler)
        nvtx = torch.cuda.nvtx
        for name in ("range_push", "range_pop", "range_start", "range_end", "mark", "range"):
            self._set(nvtx, name, getattr(kiln.nvtx, name))

        autocast_init = torch.amp.autocast.__init__

        @functools.wraps(autocast_init)
        def autocast_on_kiln(self_, device_type, dtype=None, *args, **kwargs):
            if device_type == "cuda":
                # CUDA's autocast defaults to float16; kiln's default may differ.
                device_type, dtype = "kiln", torch.float16 if dtype is None else dtype
            autocast_init(self_, device_type, dtype, *args, **kwargs)

        self._set(torch.amp.autocast, "__init__", autocast_on_kiln)

        scaler_init = torch.amp.GradScaler.__init__

        @functools.wraps(scaler_init)
        def scaler_on_kiln(self_, device="cuda", *args, **kwargs):
            scaler_init(self_, "kiln" if device == "cuda" else device, *args, **kwargs)

        self._set(torch.amp.GradScaler, "__init__", scaler_on_kiln)

        def module_cuda(self_, device=None):
            """nn.Module.cuda under --map-cuda: moves to the kiln device."""
            if isinstance(device, int):
                return self_.to(torch.device("kiln", device))
            return self_.to(map_device(device) if device is not None else "kiln")

        self._set(torch.nn.Module, "cuda", module_cuda)

        # Neither goes through __torch_function__, so the tracer cannot map
        # their arguments: torch.load is plain Python, torch.Generator a C type.
        load = torch.load

        @functools.wraps(load)
        def load_on_kiln(f, map_location=None, *args, **kwargs):
            if isinstance(map_location, dict):  # {saved location: where to load}
                map_location = {k: map_device(v) for k, v in map_location.items()}
            elif map_location is not None and not callable(map_location):
                map_location = map_device(map_location)
            return load(f, map_location, *args, **kwargs)

        self._set(torch, "load", load_on_kiln)
        self._set(torch, "Generator", _generator_on_kiln())
        if torch.distributed.is_available():
            distributed = torch.distributed
            for name in ("init_process_group", "new_group"):
                self._set(distributed, name, _backend_on_kiln(getattr(distributed, name)))
        return self

    def __exit__(self, *exc_info) -> None:
        while self._saved:
            owner, name, value, had = self._saved.pop()
            if had:
                setattr(owner, name, value)
            else:
                delattr(owner, name)
