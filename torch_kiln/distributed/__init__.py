"""torch.distributed on kiln: the ``kccl`` c10d backend.

``kccl`` is to kiln what NCCL is to CUDA: the communication backend of
``torch.distributed`` for kiln tensors, a C++ ``c10d::Backend``
(``torch_kiln/csrc/distributed/ProcessGroupKCCL.h``). It is registered when
``torch_kiln`` loads (``import torch`` is enough), for the ``kiln`` device, so::

    import torch, torch.distributed as dist
    dist.init_process_group()                          # kiln:kccl (the accelerator's default)
    dist.init_process_group(backend="kccl")            # the same, by name
    dist.init_process_group(backend="cpu:gloo,kiln:kccl")  # CPU tensors too
    dist.get_default_backend_for_device("kiln")        # 'kccl'

Each rank is a process using its own kiln device (``kiln:LOCAL_RANK``: set
``KILN_DEVICE_COUNT`` to at least the number of ranks per host and call
``torch.kiln.set_device(local_rank)``). Ranks of one host exchange data
through POSIX shared memory; every collective is a task on a kiln
communication stream, ordered after the caller's current stream, as NCCL's
are on CUDA streams. Ranks on different hosts (by hostname and boot id, or
``KCCL_HOST_ID``) exchange data through Gloo's transport, with shared memory
still inside each host (Note [kccl across hosts] in
``torch_kiln/csrc/distributed/CrossHost.h``). See docs/distributed.md for what works and what does
not yet.

Environment:
    ``KCCL_SHM_SLOT_BYTES``: bytes of each rank's shared-memory slot (default
    4 MiB, 4096 .. 2**30, a multiple of 64); larger collectives run in chunks.
    ``KCCL_HOST_ID``: this rank's host identity (default: hostname and boot
    id); ranks with different identities talk through Gloo (``GLOO_SOCKET_IFNAME``
    picks Gloo's interface).
"""

from __future__ import annotations

import atexit
import datetime
import functools
import os
import socket
import types

import torch

__all__ = ["BACKEND_NAME", "host_id", "host_layout", "is_registered"]

BACKEND_NAME = "kccl"
_registered = False


def _create_backend(dist_backend_opts, backend_options):
    """The ``kccl`` creator c10d calls (``extended_api=True``) for each new
    process group: returns a ``torch._C._distributed_c10d.Backend``.

    ``dist_backend_opts``: c10d's ``_DistributedBackendOptions`` (store,
    group_rank, group_size, timeout, group_id). ``backend_options`` is unused
    (kccl has no options of its own yet).

    Collective: the ranks exchange their host identities through the Store
    and, when they are on several hosts, make the Gloo groups between hosts.
    Raises torch.distributed.DistBackendError if the ranks cannot set up their
    shared memory (or Gloo's connections) within the timeout."""
    from torch_kiln import _C

    timeout = dist_backend_opts.timeout
    if isinstance(timeout, datetime.timedelta):
        timeout_ms = max(1, int(timeout.total_seconds() * 1000))
    else:
        timeout_ms = max(1, int(timeout))
    store = dist_backend_opts.store
    rank = dist_backend_opts.group_rank
    size = dist_backend_opts.group_size
    group_name = str(dist_backend_opts.group_id)
    hosts = _hosts_of_ranks(store, rank, size, group_name, timeout_ms)
    _layouts[group_name] = hosts
    gloo_leaders = gloo_all = None
    if len(hosts) > 1:
        gloo_leaders, gloo_all = _gloo_between_hosts(store, rank, hosts, timeout_ms, group_name)
    backend = _C._kccl_create_backend(
        store, rank, size, timeout_ms, group_name, hosts, gloo_leaders, gloo_all
    )
    global _exit_handler_registered
    if not _exit_handler_registered:
        # Registered after torch.kiln's own handler, so it runs before it.
        atexit.register(_C._kccl_abandon_completions_at_exit)
        _exit_handler_registered = True
    return backend


def _split_backend(store, rank: int, size: int, timeout_ms: int, group_name: str):
    """How ProcessGroupKCCL::split makes the new group's backend (Note
    [Splitting a kccl group] in torch_kiln/csrc/distributed/SplitKCCL.cc):
    the creator new_group uses, with the split's PrefixStore, the caller's
    rank among the split ranks, their count, timeout and name."""
    options = types.SimpleNamespace(store=store, group_rank=rank, group_size=size,
                                    timeout=timeout_ms, group_id=group_name)
    return _create_backend(options, None)


def _backend_options_class():
    """``Backend.Options`` that ``copy.deepcopy`` accepts: split_group copies
    the parent backend's ``options`` before it splits (torch's own Options
    cannot be copied)."""
    from torch._C._distributed_c10d import Backend

    class KcclOptions(Backend.Options):
        def __init__(self, timeout=None):
            if timeout is None:
                super().__init__(BACKEND_NAME)
            else:
                super().__init__(BACKEND_NAME, timeout)

        def __deepcopy__(self, memo):
            copied = KcclOptions(self._timeout)
            copied.group_name = self.group_name
            return copied

        __copy__ = lambda self: self.__deepcopy__({})  # noqa: E731

    return KcclOptions


def _add_split_methods() -> None:
    """What torch.distributed asks of a backend that supports splitting,
    for kccl backends (which reach Python as the base
    ``torch._C._distributed_c10d.Backend``; NCCL's class defines both):

    * ``backend.options``: split_group deep-copies it (a ``Backend.Options``
      that can be copied);
    * ``backend.perform_nocolor_split(device)``: new_group calls it on the
      ranks outside the new group when the default group has a bound device
      (NCCL's ncclCommSplit needs every parent rank); kccl makes a group
      from its members only, so there is nothing to do.

    Other backends keep raising AttributeError for both."""
    from torch._C._distributed_c10d import Backend

    if "options" in Backend.__dict__:
        return
    options_class = _backend_options_class()

    def _require_kccl(backend, attribute):
        if backend.name() != BACKEND_NAME:
            raise AttributeError(f"'{type(backend).__name__}' object has no attribute '{attribute}'")

    def options(backend):
        _require_kccl(backend, "options")
        return options_class()

    def perform_nocolor_split(backend, device):
        _require_kccl(backend, "perform_nocolor_split")

    Backend.options = property(options, doc="kccl: a Backend.Options for split_group.")
    Backend.perform_nocolor_split = perform_nocolor_split


def _kccl_backend_of(c10d, group):
    """``group``'s kccl backend (default: the default group), or None if its
    kiln backend is not kccl or it has none."""
    group = c10d._get_default_group() if group is None else group
    try:
        backend = group._get_backend(torch.device("kiln"))
    except RuntimeError:
        return None
    return backend if backend.name() == BACKEND_NAME else None


def _wrap_monitored_barrier(c10d) -> None:
    """torch.distributed.monitored_barrier for groups with a kccl backend
    (Note [kccl monitored barrier] in
    torch_kiln/csrc/distributed/MonitoredBarrierKCCL.cc): PyTorch's function
    refuses every group but Gloo's in Python ("monitored_barrier is only
    implemented for GLOO backend"); for a kccl group this runs kccl's
    monitored barrier with PyTorch's argument handling (default timeout,
    float seconds, not-in-group warning). Other groups go to PyTorch's."""
    import torch.distributed as dist

    original = c10d.monitored_barrier
    if getattr(original, "_kccl", False):
        return

    @functools.wraps(original)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        if c10d._rank_not_in_group(group):
            return original(group, timeout, wait_all_ranks)
        backend = _kccl_backend_of(c10d, group)
        if backend is None:
            return original(group, timeout, wait_all_ranks)
        if timeout is None:
            timeout = c10d._get_default_timeout(c10d.get_backend(group))
        elif isinstance(timeout, float):
            timeout = datetime.timedelta(seconds=timeout)
        c10d._check_valid_timeout(timeout)
        return backend.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    monitored_barrier._kccl = True
    c10d.monitored_barrier = monitored_barrier
    dist.monitored_barrier = monitored_barrier


# Note [kccl completion thread] (ProcessGroupKCCL.cc): before the interpreter
# finalizes, every group's completion thread ends, leaving unfinished Works.
_exit_handler_registered = False


# The host layout of each kccl group made by this process, by group name.
_layouts: dict[str, list[list[int]]] = {}


def host_layout(group=None) -> list[list[int]]:
    """The group ranks of each host of ``group``'s kccl backend (default: the
    default group), hosts in the order of their lowest rank: ``[[0, 1]]``
    when all ranks share this host (shared memory only), ``[[0, 1], [2, 3]]``
    for two hosts of two ranks (Gloo between them). Raises ValueError if
    this process made no kccl backend for the group."""
    import torch.distributed as dist

    name = (group or dist.group.WORLD).group_name
    if name not in _layouts:
        raise ValueError(f"host_layout: process group {name!r} has no kccl backend made by this process")
    return [list(h) for h in _layouts[name]]


# Groups made so far per group name: every rank makes the kccl groups of a
# store in the same order, so the generation keeps their Store keys apart
# (as ProcessGroupKCCL's constructor does for its own keys).
_generations: dict[str, int] = {}


def host_id() -> str:
    """This process's host identity for kccl (Note [kccl across hosts] in
    torch_kiln/csrc/distributed/CrossHost.h): ``KCCL_HOST_ID`` if set,
    else the hostname and the kernel's boot id. Ranks with the same identity
    exchange data through shared memory; ranks with different ones through
    Gloo. Giving the ranks of one machine different ``KCCL_HOST_ID`` values
    forces the cross-host path there (tests do)."""
    forced = os.environ.get("KCCL_HOST_ID", "")
    if forced:
        return forced
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _hosts_of_ranks(store, rank: int, size: int, group_name: str,
                    timeout_ms: int) -> list[list[int]]:
    """The group ranks of each host, hosts in the order of their lowest rank
    (collective: every rank publishes its host identity in the group's Store
    and reads everyone's). Raises ``torch.distributed.DistBackendError``
    naming the missing ranks if they have not published theirs within the
    group's timeout (a ``store.get`` alone would wait for the Store's own
    timeout, 5 minutes for a FileStore, whatever the group's)."""
    import torch.distributed as dist

    if size == 1:
        return [[0]]
    generation = _generations.get(group_name, 0)
    _generations[group_name] = generation + 1
    prefix = f"kccl-hosts/{generation}/"
    store.set(prefix + str(rank), host_id())
    keys = [prefix + str(r) for r in range(size)]
    try:
        store.wait(keys, datetime.timedelta(milliseconds=timeout_ms))
    except RuntimeError as error:  # TCPStore: DistStoreError; FileStore: "Wait timeout"
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if not missing:
            raise
        raise dist.DistBackendError(
            f"kccl: creating process group {group_name!r} on rank {rank}: ranks {missing} did not "
            f"join within {timeout_ms} ms (the process group's timeout); every rank of the "
            f"group must create it") from error
    ids = [store.get(key).decode() for key in keys]
    hosts: dict[str, list[int]] = {}
    for r, ident in enumerate(ids):
        hosts.setdefault(ident, []).append(r)
    return list(hosts.values())


def _gloo_between_hosts(store, rank: int, hosts: list[list[int]], timeout_ms: int, group_name: str):
    """Gloo groups on the group's Store (Note [kccl across hosts]): among the
    hosts' lowest ranks (None on the others) and among all ranks. Gloo picks
    its network interface as usual (``GLOO_SOCKET_IFNAME``, else the
    hostname's address)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(milliseconds=timeout_ms)
    generation = _generations[group_name] - 1
    leaders = [h[0] for h in hosts]
    gloo_leaders = None
    if rank in leaders:
        gloo_leaders = dist.ProcessGroupGloo(
            dist.PrefixStore(f"kccl-gloo-leaders/{generation}/", store),
            leaders.index(rank), len(leaders), timeout,
        )
    gloo_all = dist.ProcessGroupGloo(
        dist.PrefixStore(f"kccl-gloo-all/{generation}/", store), rank, sum(map(len, hosts)), timeout
    )
    return gloo_leaders, gloo_all


# Note [kccl as the default backend of an undefined group]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `init_process_group()` with neither `backend` nor `device_id` makes a
# group with backend "undefined": PyTorch 2.13 then creates the accelerator's
# default backend (kiln:kccl, from Backend.default_device_backend_map) but
# marks the group's *default backend type* as NCCL if NCCL is in the map and
# Gloo otherwise (distributed_c10d._new_process_group_helper). On a kiln
# machine there is no Gloo backend in that group, so everything that asks the
# group for its default backend from C++ (DDP's constructor logs
# `getBackendName()`; `_has_hooks`) fails with "Could not find backend type 1
# for Process Group with name gloo". kiln wraps the helper: when the group it
# made says Gloo is its default but has no CPU backend and has a kiln one,
# the default becomes that (CUSTOM) backend, as `backend="kccl"` would have
# set it. The wrapper changes nothing else, and nothing for other groups.


def _has_backend(pg, device: str) -> bool:
    try:
        pg._get_backend(torch.device(device))
    except RuntimeError:
        return False
    return True


def _wrap_process_group_helper(c10d) -> None:
    original = c10d._new_process_group_helper
    if getattr(original, "_kiln_default_backend_fix", False):
        return

    @functools.wraps(original)
    def helper(*args, **kwargs):
        result = original(*args, **kwargs)
        pg = result[0] if isinstance(result, tuple) else result
        if isinstance(pg, c10d.ProcessGroup) and pg._get_backend_name() == "gloo":
            if _has_backend(pg, "kiln") and not _has_backend(pg, "cpu"):
                pg._set_default_backend(c10d.ProcessGroup.BackendType.CUSTOM)
        return result

    helper._kiln_default_backend_fix = True
    c10d._new_process_group_helper = helper


def is_registered() -> bool:
    """True once ``kccl`` is registered with torch.distributed."""
    return _registered


def register() -> None:
    """Registers ``kccl`` with ``torch.distributed.Backend`` for the
    ``kiln`` device (idempotent; called when ``torch_kiln`` loads). Does
    nothing where this PyTorch build has no distributed support."""
    global _registered
    if _registered:
        return
    # `import torch` imports torch.distributed already, so this is free.
    import torch.distributed as dist

    if not dist.is_available():
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=["kiln"]
    )
    # Note [Splitting a kccl group] (torch_kiln/csrc/distributed/SplitKCCL.cc)
    from torch_kiln import _C

    _C._kccl_set_factory(_split_backend)
    _add_split_methods()
    # Note [kccl as the default backend of an undefined group]
    import torch.distributed.distributed_c10d as c10d

    _wrap_process_group_helper(c10d)
    _wrap_monitored_barrier(c10d)
    _registered = True
