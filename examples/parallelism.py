"""Data, fully sharded and tensor parallelism for train_char_gpt.py (--parallel).

Plain torch.distributed, nothing kiln-specific: the script runs under
torchrun, one process per rank, each on ``<device type>:LOCAL_RANK``, and
``init_process_group`` picks the device's backend (kccl for kiln, NCCL for
CUDA, Gloo for the CPU):

    KILN_DEVICE_COUNT=2 torchrun --standalone --nproc_per_node=2 \\
        examples/train_char_gpt.py --parallel fsdp

Modes (``MODES``):
  ddp      DistributedDataParallel. Each rank trains on its batch_size / world
           rows of the global batch; gradients are averaged.
  fsdp     FSDP2 (``fully_shard``) on every block and on the whole model,
           the same split of the data.
  tp       tensor parallelism, Megatron-style (torch.distributed.tensor.parallel):
           in every block the q, k, v projections and the MLP's first layer are
           split by output features (``ColwiseParallel``: each rank holds
           heads / world attention heads), the attention output projection and
           the MLP's second layer by input features (``RowwiseParallel``, whose
           outputs are summed across ranks). Embeddings, the final LayerNorm
           and the tied output head stay replicated. Every rank sees the whole
           batch.
  fsdp+tp  a 2-D mesh (dp, tp) with tp = 2: tensor parallelism inside each
           block over "tp", FSDP2 over "dp", the data split over "dp".

The global batch is --batch-size rows in every mode, drawn in the same order
as one process draws it, so the losses match a single-process run on the same
global batch (the tests hold them within 1e-5 relative over 50 steps).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

MODES = ("ddp", "fsdp", "tp", "fsdp+tp")
TP_SIZE_2D = 2  # the "tp" dimension of fsdp+tp's mesh


@dataclass
class Parallelism:
    """What one rank needs to train its part.

    mode: one of MODES. device: this rank's device. dp_rank, dp_size: its
    place along the data-parallel dimension (dp_size 1 for tp), which says
    which rows of the global batch it trains on. dp_group: the process group
    of that dimension (None when dp_size is 1). mesh: the device mesh
    (None for ddp). is_main: rank 0, which prints and writes results.
    """

    mode: str
    device: torch.device
    dp_rank: int
    dp_size: int
    dp_group: dist.ProcessGroup | None
    mesh: object | None
    is_main: bool


def init(mode: str, device_type: str, heads: int, batch_size: int) -> Parallelism:
    """Joins the torchrun job and sets this rank's device.

    Raises SystemExit with a message naming the problem when the script was
    not started by torchrun, the host has fewer devices than ranks, or the
    sizes do not divide (heads by the tensor-parallel size, the batch by the
    data-parallel size).
    """
    if mode not in MODES:
        raise SystemExit(f"--parallel {mode!r}: expected one of {', '.join(MODES)}")
    missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if v not in os.environ]
    if missing:
        raise SystemExit(f"--parallel {mode} runs under torchrun (one process per rank); "
                         f"{', '.join(missing)} not set. For example: torchrun --standalone "
                         f"--nproc_per_node=2 examples/train_char_gpt.py --parallel {mode}")
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    tp_size = {"ddp": 1, "fsdp": 1, "tp": world, "fsdp+tp": TP_SIZE_2D}[mode]
    if world % tp_size:
        raise SystemExit(f"--parallel {mode} needs a world size divisible by {tp_size}, got {world}")
    dp_size = world // tp_size
    if heads % tp_size:
        raise SystemExit(f"--parallel {mode}: --heads {heads} must be a multiple of the "
                         f"tensor-parallel size {tp_size}")
    if batch_size % dp_size:
        raise SystemExit(f"--parallel {mode}: --batch-size {batch_size} must be a multiple of "
                         f"the data-parallel size {dp_size}")

    if device_type == "cpu":
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        count = torch.accelerator.device_count()
        if count < local_world:
            hint = " (set KILN_DEVICE_COUNT)" if device_type == "kiln" else ""
            raise SystemExit(f"--parallel {mode}: {local_world} ranks on this host but only "
                             f"{count} {device_type} devices{hint}")
        device = torch.device(device_type, local_rank)
        torch.accelerator.set_device_index(local_rank)
        # Bound to the device, as TorchTitan joins: init_device_mesh then
        # makes a 2-D mesh's groups with split_group.
        dist.init_process_group(device_id=device)

    from torch.distributed.device_mesh import init_device_mesh

    mesh, dp_group, dp_rank = None, None, dist.get_rank()
    if mode == "fsdp+tp":
        mesh = init_device_mesh(device_type, (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
        dp_group, dp_rank = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    elif mode in ("fsdp", "tp"):
        mesh = init_device_mesh(device_type, (world,))
    if mode == "tp":
        dp_rank = 0
    elif mode in ("ddp", "fsdp"):
        dp_group = dist.group.WORLD
    return Parallelism(mode, device, dp_rank, dp_size, dp_group if dp_size > 1 else None,
                       mesh, dist.get_rank() == 0)


def _tensor_parallel_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
            "proj": RowwiseParallel(), "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}


def parallelize(model: nn.Module, par: Parallelism) -> nn.Module:
    """Applies the mode to ``model`` (already on par.device; changed in place
    for fsdp and tp) and returns the module to train with: the DDP wrapper
    for ddp, ``model`` itself otherwise. Make the optimizer afterwards: FSDP2
    and tensor parallelism replace the parameters with DTensors."""
    if par.mode == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    if par.mode in ("tp", "fsdp+tp"):
        tp_mesh = par.mesh if par.mode == "tp" else par.mesh["tp"]
        for block in model.blocks:
            parallelize_module(block, tp_mesh, _tensor_parallel_plan())
    if par.mode in ("fsdp", "fsdp+tp"):
        dp_mesh = par.mesh if par.mode == "fsdp" else par.mesh["dp"]
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def optimizer_options(par: Parallelism) -> dict:
    """Keyword arguments for torch.optim's constructor under this mode. tp
    and fsdp+tp leave some parameters plain tensors (or DTensors on another
    mesh) next to the blocks' DTensors; torch.optim's foreach kernels take
    one list per device and dtype and cannot mix them ("got mixed
    torch.Tensor and DTensor"), so those modes step one tensor at a time
    (the math is the same)."""
    return {"foreach": False} if par.mode in ("tp", "fsdp+tp") else {}


def local_rows(batch: torch.Tensor, par: Parallelism) -> torch.Tensor:
    """This rank's rows of a global batch (batch, ...): the dp_rank-th of
    dp_size equal parts."""
    rows = batch.shape[0] // par.dp_size
    return batch[par.dp_rank * rows:(par.dp_rank + 1) * rows]


def global_mean(loss: torch.Tensor, par: Parallelism) -> float:
    """The mean of the data-parallel ranks' losses: the loss over the global
    batch, since every rank holds the same number of rows."""
    value = loss.detach().clone()
    if par.dp_group is not None:
        dist.all_reduce(value, op=dist.ReduceOp.AVG, group=par.dp_group)
    return value.item()


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a model whose parameters are plain
    tensors and DTensors on one or more meshes (tp keeps the embeddings
    replicated, fsdp+tp shards blocks on two dimensions and the rest on one),
    which the stock function cannot stack into one norm. The total L2 norm is
    the norm of the groups' norms; returns it (a plain tensor)."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    if len(groups) <= 1:
        return torch.nn.utils.clip_grad_norm_([p for ps in groups.values() for p in ps], max_norm)
    norms = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def finish() -> None:
    dist.destroy_process_group()
