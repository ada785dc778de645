"""Memory pools of kiln's caching allocator: ``torch.kiln.MemPool`` and
``torch.kiln.use_mem_pool``, with ``torch.cuda.MemPool``'s semantics.

Inside ``with torch.kiln.use_mem_pool(pool):`` the calling thread's
allocations on the pool's device come from ``pool``; blocks freed later (on
any thread) return to it, never to ordinary allocations, and are reused only
by allocations into the same pool on the same stream (stream-ordered reuse
holds inside a pool as outside). ``pool.snapshot()`` lists the pool's
segments; a graph can capture into it (``torch.kiln.graph(g, pool=pool.id)``).
Note [User memory pools] in ``torch_kiln/csrc/core/KilnCachingAllocator.cc``
has the rules.

What CUDA has and kiln does not: custom allocators (``MemPool(allocator=...)``
raises ``NotImplementedError``; kiln has no pluggable allocator), and per-pool
statistics in ``memory_stats()`` (CUDA's ``"reserved_bytes_by_private_pools"``):
a pool's memory counts in the device's statistics, and ``pool.snapshot()``
shows its segments.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

from torch_kiln import _C
from torch_kiln.kiln._utils import _current_device
from torch_kiln.kiln._utils import _checked_device
from torch_kiln.kiln.memory import memory_snapshot

__all__ = ["MemPool", "use_mem_pool"]


class MemPool:
    """A pool of memory in kiln's caching allocator (``torch.cuda.MemPool``).

    The pool belongs to the device that is current when it is made; route
    allocations to it with ``use_mem_pool``. While the pool exists, its free
    blocks stay reserved for it (``empty_cache()`` keeps them); when it is
    destroyed, they go back to the device. Tensors allocated from it may
    outlive it: their memory returns to the device when they are freed and
    the cache is emptied.

    Args:
        allocator: must be ``None`` (kiln's caching allocator); custom
            allocators are not supported on kiln.
        use_on_oom (bool): an ordinary allocation (outside the pool) that
            would fail with ``torch.OutOfMemoryError`` may take a free block of
            this pool (of the same stream) instead; it returns to the pool when
            freed.
        no_split (bool): the pool never splits a block: each allocation takes
            a whole cached block, or a segment of its own rounded size.

    Raises:
        NotImplementedError: ``allocator`` is not ``None``.
        TypeError: ``use_on_oom`` or ``no_split`` is not a bool.
        RuntimeError: no kiln device is available.
    """

    def __init__(self, allocator: Any = None, use_on_oom: bool = False, no_split: bool = False):
        if allocator is not None:
            raise NotImplementedError(
                "torch.kiln.MemPool: custom allocators (allocator=...) are not supported on kiln: "
                "kiln has no pluggable allocator (torch.cuda.CUDAPluggableAllocator). Leave "
                "allocator=None to take the pool's memory from kiln's caching allocator.")
        for name, value in (("use_on_oom", use_on_oom), ("no_split", no_split)):
            if not isinstance(value, bool):
                raise TypeError(f"torch.kiln.MemPool: {name} must be a bool, got "
                                f"{type(value).__name__} {value!r}.")
        from torch_kiln.kiln import _lazy_init

        _lazy_init()
        self._device = _current_device()
        self._id = tuple(_C._mempool_create(self._device, no_split, use_on_oom))
        self._use_on_oom = use_on_oom
        self._no_split = no_split

    @property
    def id(self) -> tuple[int, int]:
        """The pool's id, ``(0, n)``: pass it as ``pool=`` to ``torch.kiln.graph``
        or ``KilnGraph.capture_begin``, or to ``memory_snapshot``."""
        return self._id

    @property
    def allocator(self) -> None:
        """``None``: the pool's memory comes from kiln's caching allocator."""
        return None

    @property
    def device(self) -> int:
        """Index of the kiln device the pool belongs to."""
        return self._device

    def use_count(self) -> int:
        """The pool's reference count on its device, as CUDA counts it: 1 for
        the pool itself, plus one per active ``use_mem_pool`` and per kiln
        graph holding the pool."""
        return _C._mempool_use_count(self._device, self._id)

    def snapshot(self, include_traces: bool = True) -> list[dict[str, Any]]:
        """The pool's segments on every device, in ``memory_snapshot``'s format
        (sizes in bytes; each has ``segment_pool_id == pool.id``)."""
        return memory_snapshot(self._id, include_traces=include_traces)

    def __repr__(self) -> str:
        return f"torch.kiln.MemPool(id={self._id}, device=kiln:{self._device})"

    def __del__(self) -> None:
        if getattr(self, "_id", None) is None or sys.is_finalizing():
            return  # __init__ failed, or exiting: the runtime returns the memory
        try:
            _C._release_pool(self._device, self._id)
            _C._empty_pool_cache(self._id)
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


@contextlib.contextmanager
def use_mem_pool(pool: MemPool, device: Any = None) -> Iterator[None]:
    """Route the calling thread's allocations on ``device`` to ``pool`` for the
    block (``torch.cuda.use_mem_pool``).

    Only this thread's allocations go to the pool: work on threads started
    inside the block (the autograd engine's, a DataLoader's) allocates
    normally, as on CUDA. A graph capture underway on the current stream
    takes precedence. Nested blocks route to the innermost pool.

    Args:
        pool (torch.kiln.MemPool): the pool.
        device: the kiln device whose allocations are routed (``None``: the
            current device). As on CUDA, a device other than the pool's makes
            the pool (same id) on that device for the block; its memory is no
            longer reserved after the block.

    Raises:
        TypeError: ``pool`` is not a ``torch.kiln.MemPool``.
        ValueError: ``device`` is not a kiln device.
        RuntimeError: the device index is not below ``device_count()``.
    """
    if not isinstance(pool, MemPool):
        raise TypeError(f"use_mem_pool: pool must be a torch.kiln.MemPool, got "
                        f"{type(pool).__name__} {pool!r}.")
    index = _checked_device(device, "use_mem_pool")
    _C._begin_allocate_current_thread_to_pool(index, pool.id)
    try:
        yield
    finally:
        _C._end_allocate_current_thread_to_pool(index, pool.id)
        _C._release_pool(index, pool.id)
