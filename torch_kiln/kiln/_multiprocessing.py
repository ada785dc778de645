"""Kiln tensors on torch.multiprocessing queues and pipes, as CUDA tensors.

A kiln tensor sent to another process shares its device memory: the
receiver's tensor is a view of the same bytes on the same device index
(writes on either side are seen by the other after the writer's device work
has completed), views keep their sizes, strides and storage offset, and
several views of one storage in one message share one storage on arrival.
The sender waits for the storage's device before the tensor leaves, so
queued writes arrive. See Note [Sharing kiln tensors between processes] in
torch_kiln/csrc/python/StorageSharing.cc.

Lifetime: the sender keeps every shared storage alive until all receivers
have released it (their storages closed the pipe sent along with it), so
its caching allocator cannot hand the memory to another tensor meanwhile;
``torch.kiln.ipc_collect()`` releases what receivers are done with (this
also happens at every send). As with CUDA, the processes must use the
``spawn`` (or ``forkserver``) start method once kiln is initialised.
"""

from __future__ import annotations

import os
import threading
from multiprocessing.context import get_spawning_popen
from multiprocessing.reduction import DupFd, ForkingPickler
from multiprocessing.util import Finalize

import torch
from torch.multiprocessing import reductions as _torch_reductions

from torch_kiln import _C

# (read end of the pipe, storage): storages receivers may still use.
_sent: list[tuple[int, torch.UntypedStorage]] = []
_sent_lock = threading.Lock()


def ipc_collect() -> int:
    """Releases the device memory of kiln tensors sent to other processes
    that every receiver has released (like ``torch.cuda.ipc_collect``).
    Returns how many shared storages are still held for receivers."""
    with _sent_lock:
        keep = []
        for read_end, storage in _sent:
            try:
                done = os.read(read_end, 1) == b""  # end of file: every receiver let go
            except BlockingIOError:
                done = False
            if done:
                os.close(read_end)
            else:
                keep.append((read_end, storage))
        _sent[:] = keep
        return len(keep)


def _dup_fd(fd: int):
    """A DupFd of ``fd`` for a message; the caller closes ``fd`` after this.

    Pickled for a Queue or Pipe, DupFd duplicates ``fd`` at once. Pickled as
    a ``Process`` argument while a ``spawn`` or ``forkserver`` child is being
    started, DupFd only records the number for the child to inherit at its
    launch, after this returns: then a copy is kept open until that Popen
    object is finalized (before, the closed descriptor failed the start with
    "bad value(s) in fds_to_keep", or the child with "fd ... holds 0 bytes")."""
    popen = get_spawning_popen()
    if popen is None:
        return DupFd(fd)
    kept = os.dup(fd)
    Finalize(popen, os.close, args=(kept,))
    return DupFd(kept)


def _share_storage(storage: torch.UntypedStorage) -> tuple:
    ipc_collect()
    fd, allocation_size, offset, nbytes, device = _C._share_storage(storage)
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    try:
        memory = _dup_fd(fd) if fd >= 0 else None
        alive = _dup_fd(write_end)  # the copy travels with the message
    finally:
        if fd >= 0:
            os.close(fd)
        os.close(write_end)
    with _sent_lock:
        _sent.append((read_end, storage))
    return (memory, allocation_size, offset, nbytes, device, alive)


def _receive_fd(dup_fd) -> int:
    """The file descriptor a DupFd carries; multiprocessing fetches it from
    the sending process, which must still be alive."""
    try:
        return dup_fd.detach()
    except (OSError, EOFError) as error:  # FileNotFoundError, ConnectionRefusedError, ...
        raise RuntimeError(
            "Cannot receive a kiln tensor: the process that sent it exited before this "
            "process read it. As with CUDA tensors, keep the sending process alive until "
            "every receiver has read its messages.") from error


def _import_storage(memory, allocation_size, offset, nbytes, device, alive):
    alive_fd = _receive_fd(alive)
    if memory is None:
        return _C._import_storage(-1, 0, 0, 0, device, alive_fd)
    try:
        fd = _receive_fd(memory)
    except RuntimeError:
        os.close(alive_fd)
        raise
    try:
        stat = os.fstat(fd)
        key = ("kiln", stat.st_dev, stat.st_ino, offset, nbytes)
        cached = _torch_reductions.storage_from_cache(torch.UntypedStorage, key)
        if cached is not None:
            os.close(alive_fd)  # the cached storage already holds one
            return cached
        storage = _C._import_storage(fd, allocation_size, offset, nbytes, device, alive_fd)
        _torch_reductions.shared_cache[key] = _torch_reductions.StorageWeakRef(storage)
        return storage
    finally:
        os.close(fd)


def _rebuild_kiln_tensor(cls, shared, dtype, size, stride, storage_offset, requires_grad):
    storage = _import_storage(*shared)
    t = torch.empty(0, dtype=dtype, device=torch.device("kiln", shared[4]))
    t.set_(storage, storage_offset, size, stride)
    if cls is torch.nn.parameter.Parameter:
        return torch.nn.parameter.Parameter(t, requires_grad=requires_grad)
    t.requires_grad_(requires_grad)
    return t


def _reduce_tensor(tensor: torch.Tensor):
    if tensor.device.type != "kiln":
        return _torch_reductions.reduce_tensor(tensor)
    if tensor.requires_grad and not tensor.is_leaf:
        raise RuntimeError(
            "Cowardly refusing to serialize non-leaf tensor which requires_grad, since "
            "autograd does not support crossing process boundaries.  If you just want to "
            "transfer the data, call detach() on the tensor before serializing (e.g., "
            "putting it on the queue).")
    if tensor.layout != torch.strided:
        return _reduce_sparse_tensor(tensor)
    return (_rebuild_kiln_tensor,
            (type(tensor), _share_storage(tensor.untyped_storage()), tensor.dtype,
             tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset(),
             tensor.requires_grad))


def _reduce_sparse_tensor(sparse: torch.Tensor):
    """A sparse kiln tensor travels as its member tensors, each shared like
    any kiln tensor, and is rebuilt with torch's own sparse rebuilders (as
    torch.multiprocessing does for CPU and CUDA sparse tensors)."""
    if sparse.layout is torch.sparse_coo:
        return (_torch_reductions.rebuild_sparse_coo_tensor,
                (*_reduce_tensor(sparse._indices()), *_reduce_tensor(sparse._values()),
                 sparse.shape, sparse.is_coalesced()))
    if sparse.layout in (torch.sparse_csr, torch.sparse_bsr):
        compressed, plain = sparse.crow_indices(), sparse.col_indices()
    elif sparse.layout in (torch.sparse_csc, torch.sparse_bsc):
        compressed, plain = sparse.ccol_indices(), sparse.row_indices()
    else:
        raise RuntimeError(f"Cannot send a {sparse.layout} kiln tensor to another process. "
                           f"Send tensor.cpu() instead.")
    return (_torch_reductions.rebuild_sparse_compressed_tensor,
            (*_reduce_tensor(compressed), *_reduce_tensor(plain),
             *_reduce_tensor(sparse.values()), sparse.shape, sparse.layout))


def _reduce_untyped_storage(storage: torch.UntypedStorage):
    if storage.device.type != "kiln":
        return _torch_reductions.reduce_storage(storage)
    return (_import_storage, _share_storage(storage))


def register() -> None:
    """Makes multiprocessing pickle kiln tensors and storages by sharing
    (torch registers its reducers for every tensor class at import; ours take
    their place and hand non-kiln objects back to torch's)."""
    for t in torch._tensor_classes:
        ForkingPickler.register(t, _reduce_tensor)
    ForkingPickler.register(torch.Tensor, _reduce_tensor)
    ForkingPickler.register(torch.nn.parameter.Parameter, _reduce_tensor)
    ForkingPickler.register(torch.UntypedStorage, _reduce_untyped_storage)
