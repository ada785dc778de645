"""torch.nn.parallel.comm's device primitives for kiln devices, so that
``nn.DataParallel`` (and ``torch.nn.parallel.comm.broadcast``/``scatter``/
``gather`` called directly) work over kiln devices as over CUDA ones.

``torch.nn.parallel.comm`` turns its arguments into device indices and then
calls ``torch._C._broadcast``, ``_broadcast_out``, ``_broadcast_coalesced``,
``_scatter``, ``_scatter_out``, ``_gather`` and ``_gather_out``: C++ of CUDA
builds only (torch/csrc/cuda/comm.cpp), which CPU builds of PyTorch lack, so
DataParallel failed with ``AttributeError: module 'torch._C' has no attribute
'_scatter'``. ``install()`` (called once by ``import torch_kiln``) sets each of
them on ``torch._C`` to a function that does the kiln case here and hands
every other case to the original (on a CUDA build) or raises a clear error
(on a CPU build, which has no devices for them).

The kiln versions follow comm.cpp's semantics, with kiln copies (tasks on the
current streams, ``non_blocking=True`` as there): broadcast returns the
source tensor itself for ``devices[0]`` and copies for the others;
broadcast_coalesced flattens tensors into buffers of at most
``buffer_size`` bytes per dtype, copies those, and gives each unflattened
output its own version counter (comm.cpp's Note [Version Counter in
comm.*_coalesced]); scatter splits along ``dim`` (``chunk_sizes`` or
``tensor.chunk``) and copies chunk i to ``devices[i]``, on ``streams[i]`` when
given; gather concatenates along ``dim`` onto kiln ``destination`` (None: the
current device; -1: the CPU). Integer device indices are kiln's when a tensor
involved is on kiln, or when it is on the CPU and kiln is the current
accelerator (``torch.accelerator.current_accelerator()``, as DataParallel's
own device choice).

Errors: ``RuntimeError`` (comm.cpp's messages, plus which kiln devices exist)
for an empty device list, more chunk sizes than devices (fewer streams
than devices leave the rest on the current streams, as in comm.cpp), a
broadcast source not on ``devices[0]``, chunk sizes that do not sum to the
size of ``dim`` or are negative, a stream of another device, inputs
to gather on several device types or of mismatched shapes, an ``out=``
tensor of broadcast or scatter that is not on kiln (gather's may be on the
CPU) or of the wrong shape (all checked before anything is written), and a
device index out of range (also the one a CPU batch meets first
in DataParallel's scatter: see ``_checked_get_stream``).
"""

from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _take_tensors, _unflatten_dense_tensors


def _kiln(index: int) -> torch.device:
    count = torch.kiln.device_count()
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
        raise RuntimeError(f"torch.nn.parallel.comm: kiln device index {index!r} is out of "
                           f"range; this process has kiln devices 0 to {count - 1}")
    return torch.device("kiln", index)


def _is_kiln(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "kiln"


def _current_accelerator_is_kiln() -> bool:
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type == "kiln"


def _for_kiln(tensors) -> bool:
    """Whether a call on these tensors (and integer device indices) is kiln's."""
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if any(_is_kiln(t) for t in tensors):
        return True
    return all(t.device.type == "cpu" for t in tensors) and _current_accelerator_is_kiln()


def _check_outputs_on_kiln(out, what: str) -> list:
    # comm.cpp's broadcast_out and scatter_out take device outputs only (its
    # gather_out also takes a CPU one, as gather's destination=-1 does)
    if not isinstance(out, (list, tuple)):
        raise TypeError(f"{what}: out must be a list or tuple of tensors, got "
                        f"{type(out).__name__}")
    for i, o in enumerate(out):
        if not _is_kiln(o):
            device = o.device if isinstance(o, torch.Tensor) else type(o).__name__
            raise RuntimeError(f"Expected all output tensors to be kiln tensors, but output "
                               f"tensor at index {i} has device '{device}'")
    return list(out)


def _wrap_dim(dim: int, ndim: int) -> int:
    """dim in [-ndim, ndim - 1] as a non-negative index (at::maybe_wrap_dim)."""
    low, high = (-ndim, ndim - 1) if ndim > 0 else (-1, 0)
    if not low <= dim <= high:
        raise IndexError(f"Dimension out of range (expected to be in range of [{low}, {high}], "
                         f"but got {dim})")
    return dim + ndim if dim < 0 else dim


def _targets(devices, what: str) -> list[torch.device]:
    targets = [_kiln(d) for d in devices]
    if not targets:
        raise RuntimeError(f"{what}: expected at least one device, got an empty device list")
    return targets


def broadcast(tensor: torch.Tensor, devices) -> list[torch.Tensor]:
    """comm.broadcast: ``tensor`` on each kiln device of ``devices`` (ints);
    for ``devices[0]``, ``tensor`` itself when it is on it."""
    targets = _targets(devices, "broadcast")
    if _is_kiln(tensor) and tensor.device != targets[0]:
        raise RuntimeError(f"broadcast: the device of the broadcast tensor ({tensor.device}) "
                           f"must appear as the first on the devices list, got {list(devices)}")
    outputs = [tensor] if _is_kiln(tensor) else []
    for device in targets[len(outputs):]:
        outputs.append(tensor.to(device, non_blocking=True, copy=True))
    return outputs


def broadcast_out(tensor: torch.Tensor, out) -> list[torch.Tensor]:
    """comm.broadcast(out=...): copies ``tensor`` into each tensor of ``out``."""
    out = _check_outputs_on_kiln(out, "broadcast")
    for i, o in enumerate(out):  # every output checked before any is written
        if o.shape != tensor.shape:
            raise RuntimeError(f"Expected all output tensors to have same shape as the source "
                               f"tensor {tuple(tensor.shape)}, but output tensor at index {i} "
                               f"has shape {tuple(o.shape)}")
    for o in out:
        o.copy_(tensor, non_blocking=True)
    return out


def broadcast_coalesced(tensors, devices, buffer_size: int) -> list[list[torch.Tensor]]:
    """comm.broadcast_coalesced: ``outputs[i][j]`` is ``tensors[j]`` on
    ``devices[i]``; ``outputs[0]`` are ``tensors`` themselves."""
    targets = _targets(devices, "broadcast_coalesced")
    for t in tensors:
        if t.device != targets[0]:
            raise RuntimeError(f"broadcast_coalesced: all tensors must be on devices[0] "
                               f"({targets[0]}), got one on {t.device}")
    outputs: list[list[torch.Tensor]] = [list(tensors)]
    # id(input) -> its copies in input order (a tensor given twice gets two)
    copied: list[dict[int, list[torch.Tensor]]] = [{} for _ in targets]
    for chunk in _take_tensors(list(tensors), buffer_size):  # one dtype and layout per chunk
        if chunk[0].is_sparse:
            raise RuntimeError("broadcast_coalesced: sparse tensors are not supported on kiln")
        copies = broadcast(_flatten_dense_tensors(chunk), devices)
        for i in range(1, len(targets)):
            # .data: each output its own version counter (Note [Version Counter
            # in comm.*_coalesced] in torch/csrc/cuda/comm.cpp)
            for t, out in zip(chunk, _unflatten_dense_tensors(copies[i], chunk)):
                copied[i].setdefault(id(t), []).append(out.data)
    # (_take_tensors groups by dtype, keeping the input order within a dtype:
    # each device's list is put back in input order)
    outputs.extend([copied[i][id(t)].pop(0) for t in tensors] for i in range(1, len(targets)))
    return outputs


def _chunks(tensor: torch.Tensor, count: int, chunk_sizes, dim: int) -> list[torch.Tensor]:
    if count == 0:
        raise RuntimeError("scatter: expected at least one device (or output tensor) to scatter to")
    if chunk_sizes is None:
        return list(tensor.chunk(count, dim))
    chunk_sizes = list(chunk_sizes)
    if len(chunk_sizes) != count:
        raise RuntimeError(f"scatter: {len(chunk_sizes)} chunk sizes for {count} devices; "
                           f"give one chunk size per device")
    if sum(chunk_sizes) != tensor.size(dim):
        raise RuntimeError(f"scatter: given chunk sizes don't sum up to the tensor's size "
                           f"(sum(chunk_sizes) == {sum(chunk_sizes)}, but expected "
                           f"{tensor.size(dim)})")
    if any(size < 0 for size in chunk_sizes):
        raise RuntimeError(f"scatter: chunk sizes must not be negative, got {chunk_sizes}")
    return list(tensor.split(chunk_sizes, dim))


def _stream_at(streams, i: int):
    # comm.cpp: streams[i] where given (a shorter list leaves the rest on the
    # current stream)
    return streams[i] if streams is not None and i < len(streams) else None


def _copy_on(stream, index: int, device: torch.device, copy):
    if stream is None:
        return copy()
    if stream.device != device:
        raise RuntimeError(f"scatter: expected the device associated with the stream at index "
                           f"{index} (was {stream.device}) to match the device supplied at "
                           f"that index (expected {device})")
    with torch.kiln.stream(stream):
        return copy()


def scatter(tensor: torch.Tensor, devices, chunk_sizes, dim: int, streams) -> list[torch.Tensor]:
    """comm.scatter: ``tensor`` split along ``dim``, chunk i on kiln ``devices[i]``
    (copied on ``streams[i]`` when given)."""
    targets = [_kiln(d) for d in devices]
    dim = _wrap_dim(dim, tensor.dim())
    chunks = _chunks(tensor, len(targets), chunk_sizes, dim)
    out = []
    for i, chunk in enumerate(chunks):
        stream = _stream_at(streams, i)
        out.append(_copy_on(stream, i, targets[i],
                            lambda c=chunk, d=targets[i]: c.to(d, non_blocking=True,
                                                                 memory_format=torch.preserve_format)))
    return out


def scatter_out(tensor: torch.Tensor, out, dim: int, streams) -> list[torch.Tensor]:
    """comm.scatter(out=...): chunk i (sized as ``out[i]`` along ``dim``) copied
    into ``out[i]``."""
    out = _check_outputs_on_kiln(out, "scatter")
    if not out:
        raise RuntimeError("scatter: expected at least one device (or output tensor) to scatter to")
    dim = _wrap_dim(dim, tensor.dim())
    for i, o in enumerate(out):  # every output checked before any is written (comm.cpp's checks)
        if o.dim() != tensor.dim() or any(o.size(d) != tensor.size(d)
                                          for d in range(tensor.dim()) if d != dim):
            raise RuntimeError(f"Output tensor at index {i} has incorrect shape: "
                               f"{tuple(o.shape)}. Expected same shape except for scatter dim "
                               f"{dim} as the source tensor: {tuple(tensor.shape)}")
    for i in range(len(out)):
        stream = _stream_at(streams, i)
        if stream is not None and stream.device != out[i].device:
            raise RuntimeError(f"scatter: expected the device associated with the stream at "
                               f"index {i} (was {stream.device}) to match the device supplied "
                               f"at that index (expected {out[i].device})")
    chunks = _chunks(tensor, len(out), [o.size(dim) for o in out], dim)
    for i, (chunk, o) in enumerate(zip(chunks, out)):
        _copy_on(_stream_at(streams, i), i, o.device,
                 lambda c=chunk, o=o: o.copy_(c, non_blocking=True))
    return out


def _gathered_shape(tensors, dim: int) -> list[int]:
    if not tensors:
        raise RuntimeError("gather: expected at least one tensor to gather from")
    first = tensors[0]
    if any(t.device.type != "kiln" for t in tensors):
        raise RuntimeError(f"gather: expects all inputs on kiln devices, got "
                           f"{[str(t.device) for t in tensors]}")
    dim = _wrap_dim(dim, first.dim())
    total = 0
    for t in tensors:
        if t.dim() != first.dim() or any(t.size(d) != first.size(d)
                                         for d in range(first.dim()) if d != dim):
            raise RuntimeError(f"gather: got an input of invalid size: got {tuple(t.shape)}, "
                               f"but expected {tuple(first.shape)} except in dim {dim}")
        total += t.size(dim)
    shape = list(first.shape)
    shape[dim] = total
    return shape


def gather(tensors, dim: int, destination) -> torch.Tensor:
    """comm.gather: ``tensors`` concatenated along ``dim`` on kiln ``destination``
    (None: the current kiln device; -1: the CPU)."""
    shape = _gathered_shape(list(tensors), dim)
    if destination == -1:
        device = torch.device("cpu")
    else:
        device = _kiln(torch.kiln.current_device() if destination is None else destination)
    # channels_last when every input is (as comm.cpp's gather)
    channels_last = all(t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
                        and not t.is_contiguous() for t in tensors)
    result = torch.empty(shape, dtype=tensors[0].dtype, device=device,
                         memory_format=torch.channels_last if channels_last
                         else torch.contiguous_format)
    return _concatenate_into(tensors, result, dim)


def gather_out(tensors, out: torch.Tensor, dim: int) -> torch.Tensor:
    """comm.gather(out=...): ``tensors`` concatenated along ``dim`` into ``out``."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"gather: out must be a tensor, got {type(out).__name__}")
    shape = _gathered_shape(list(tensors), dim)
    if list(out.shape) != shape:
        raise RuntimeError(f"gather: out has shape {tuple(out.shape)}, expected {tuple(shape)}")
    return _concatenate_into(tensors, out, dim)


def _concatenate_into(tensors, out: torch.Tensor, dim: int) -> torch.Tensor:
    dim = dim + out.dim() if dim < 0 else dim
    start = 0
    for t in tensors:
        out.narrow(dim, start, t.size(dim)).copy_(t, non_blocking=True)
        start += t.size(dim)
    return out


_KILN = {"_broadcast": broadcast, "_broadcast_out": broadcast_out,
         "_broadcast_coalesced": broadcast_coalesced, "_scatter": scatter,
         "_scatter_out": scatter_out, "_gather": gather, "_gather_out": gather_out}


def _tensors_of(name: str, args) -> list:
    """The tensors whose devices decide whose call this is."""
    first = args[0] if args else None
    if name in ("_broadcast_coalesced", "_gather", "_gather_out"):
        tensors = list(first or ())
        if name == "_gather_out" and len(args) > 1:
            tensors.append(args[1])
        return tensors
    if name in ("_broadcast_out", "_scatter_out"):
        return [first, *(args[1] if len(args) > 1 else ())]
    return [first]


def _dispatcher(name: str, original):
    kiln_version = _KILN[name]

    def call(*args, **kwargs):
        if _for_kiln(_tensors_of(name, args)):
            return kiln_version(*args, **kwargs)
        if original is not None:
            return original(*args, **kwargs)
        raise RuntimeError(f"torch.nn.parallel.comm needs torch._C.{name}, which this "
                           f"CPU-only build of PyTorch does not have; kiln provides it for "
                           f"kiln tensors (on kiln devices, or on the CPU while kiln is the "
                           f"current accelerator)")
    call.__name__ = name
    call.__qualname__ = name
    call.__doc__ = kiln_version.__doc__
    call._kiln_dispatcher = True
    return call


def _checked_get_stream(original):
    """torch.nn.parallel._functions._get_stream with kiln's device check first.

    Scatter of a CPU batch asks ``_get_stream(torch.device(i))`` for each
    target before calling ``_scatter``, and that indexes a list by device
    count: ``DataParallel(device_ids=[0, 5])`` failed there with a bare
    ``IndexError: list index out of range`` (CUDA's DataParallel rejects the
    index at construction, in ``_check_balance``, which runs for CUDA only).
    """
    def _get_stream(device):
        if isinstance(device, torch.device) and device.type == "kiln" and device.index is not None:
            _kiln(device.index)
        return original(device)
    _get_stream.__doc__ = original.__doc__
    _get_stream._kiln_dispatcher = True
    return _get_stream


def install() -> None:
    """Sets the seven primitives on ``torch._C`` and the device check in
    ``torch.nn.parallel._functions._get_stream`` (once; idempotent)."""
    for name in _KILN:
        current = getattr(torch._C, name, None)
        if not getattr(current, "_kiln_dispatcher", False):
            setattr(torch._C, name, _dispatcher(name, current))
    from torch.nn.parallel import _functions
    if not getattr(_functions._get_stream, "_kiln_dispatcher", False):
        _functions._get_stream = _checked_get_stream(_functions._get_stream)
