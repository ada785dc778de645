"""The reference device's tile model: the limits every kl tile must respect.

A kl kernel (torch_kiln.kl) computes on tiles held in an on-chip scratch
memory, as an NKI kernel computes on SBUF tiles of a Trainium NeuronCore. The
reference kiln device declares the same kind of model a real chip does, and
the tracer (tracer.py), the simulator (simulator.py) and the compiled
lowering (lowering.py) all read it from here; ``torch.kiln.
get_device_properties()`` reports it (``tile_max_partition_dim``,
``tile_scratch_bytes_per_partition``, ``tile_partitions``, ``tile_dtypes``).

* ``MAX_PARTITION_DIM`` (128): the largest leading ("partition") dimension of
  a tile of rank >= 2. A rank-1 tile (or a scalar) lives in one partition.
  128 is the partition count of Trainium's SBUF (NKI's
  ``nl.tile_size.pmax``).
* ``SCRATCH_BYTES_PER_PARTITION`` (196608 = 192 KiB): bytes of scratch each
  partition holds; the figure of Trainium's (trn1) SBUF, 24 MiB over 128
  partitions, as NKI's documentation describes it. A tile of shape
  (P, F1, F2, ...) uses ``F1 * F2 * ... * itemsize`` bytes in each of its P
  partitions; a program's scratch in use at any point is the sum of that
  over its live tiles (tracer.py computes the peak), and must not exceed
  this figure.
* ``DTYPES``: the element types of tiles and of the tensors kernels load
  from and store to: float32, bfloat16, float16, int32, int64, bool.

The host CPU has no such memory; the limits are the contract a kernel is
written against, so a kernel that runs on the reference device fits a chip
with the same model.
"""

from __future__ import annotations

import torch

MAX_PARTITION_DIM = 128
PARTITIONS = 128
SCRATCH_BYTES_PER_PARTITION = 192 * 1024
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.bool)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def supported_dtype_names() -> str:
    return ", ".join(dtype_name(d) for d in DTYPES)


def partition_dim(shape: tuple[int, ...]) -> int:
    """The partition (leading) extent of a tile: shape[0] for rank >= 2, else 1."""
    return shape[0] if len(shape) >= 2 else 1


def bytes_per_partition(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Scratch bytes a tile uses in each of its partitions."""
    free = shape[1:] if len(shape) >= 2 else shape
    n = 1
    for s in free:
        n *= s
    return n * dtype.itemsize
