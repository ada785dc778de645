"""One rank of tests/test_distributed_apis.py, started by torchrun:
    distributed_apis_worker.py SCENARIO DIR

Scenarios (each prints "APIS-OK <scenario> <rank> <world>" when its checks
pass, and raises otherwise):
  dcp-save  FSDP2 model + AdamW, one step, torch.distributed.checkpoint.save to
            DIR/checkpoint; rank 0 also writes the full (unsharded) model and
            optimizer state to DIR/reference.pt.
  dcp-load  the same model sharded over this job's world size (any), load
            from DIR/checkpoint, compare every parameter and optimizer state
            tensor with DIR/reference.pt bit for bit (on rank 0, which holds
            the full state).
  funcol    torch.distributed._functional_collectives (all_reduce,
            all_gather_tensor, reduce_scatter_tensor) eagerly and inside
            torch.compile(fullgraph=True), against the values computed on the CPU.
  fsdp-options       FSDP2's reshard_after_forward (False, True, an int) and a
            bf16 MixedPrecisionPolicy, clipping the DTensor gradients, against
            one process on the global batch.
  sequence-parallel  SequenceParallel + colwise/rowwise on sequence shards,
            forward and backward against one process.
  failed-read  a collective that fails (sizes differ across ranks): reading
            its output raises that failure, then "never computed".
  init      only makes the group.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def _model(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("kiln", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    model.to("kiln")
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _full_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optim": optim_state}


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}{key}.")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _flatten(value, f"{prefix}{i}.")
    else:
        yield prefix.rstrip("."), tree


def dcp_save(directory: str, rank: int, world: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = _model(world)
    torch.manual_seed(1)
    model(torch.randn(4, 16, device="kiln")).square().sum().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state},
             checkpoint_id=os.path.join(directory, "checkpoint"))
    full = _full_state(model, optimizer)
    if rank == 0:
        torch.save(full, os.path.join(directory, "reference.pt"))


def dcp_load(directory: str, rank: int, world: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = _model(world)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=os.path.join(directory, "checkpoint"))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    got = dict(_flatten(_full_state(model, optimizer)))
    if rank != 0:  # a full state dict with cpu_offload lives on rank 0 only
        assert got == {}, sorted(got)
        return
    want = dict(_flatten(torch.load(os.path.join(directory, "reference.pt"))))
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    tensors = 0
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key].cpu(), value), key
            tensors += 1
        else:
            assert got[key] == value, (key, got[key], value)
    assert tensors >= 10, tensors  # 4 parameters, their exp_avg and exp_avg_sq, steps


def funcol(directory: str, rank: int, world: int) -> None:
    import torch.distributed._functional_collectives as fc

    group = dist.group.WORLD
    base = [torch.arange(6, dtype=torch.float32) + r for r in range(world)]  # every rank's input
    x = base[rank].to("kiln")

    def step(x):
        summed = fc.all_reduce(x * 2, "sum", group)
        gathered = fc.all_gather_tensor(x + 1, 0, group)
        scattered = fc.reduce_scatter_tensor(x.repeat(world), "sum", 0, group)
        return summed * 3 + 1, gathered, scattered

    want = (sum(b * 2 for b in base) * 3 + 1, torch.cat([b + 1 for b in base]), sum(base))
    for name, fn in (("eager", step), ("compiled", torch.compile(step, fullgraph=True))):
        for got, expected in zip(fn(x), want):
            assert got.device == x.device, (name, got.device)
            assert torch.equal(got.cpu(), expected), (name, got, expected)


def _reference_training(model: torch.nn.Module, batches, clip: float) -> torch.nn.Module:
    """One process on the global batches: SGD with gradient clipping."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for x in batches:
        model(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return model


def fsdp_options(directory: str, rank: int, world: int) -> None:
    """FSDP2 with reshard_after_forward False / True / an int, and with a
    bf16 MixedPrecisionPolicy; gradient clipping over the DTensor grads;
    three SGD steps against one process on the global batch."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("kiln", (world,))
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                               torch.nn.GELU(), torch.nn.Linear(32, 4)).to("kiln")
    batches = [torch.randn(4 * world, 8, device="kiln") for _ in range(3)]
    reference = _reference_training(copy.deepcopy(base), batches, clip=0.1)
    configs = [({"reshard_after_forward": False}, 1e-5), ({"reshard_after_forward": True}, 1e-5),
               ({"reshard_after_forward": world if world > 1 else True}, 1e-5),
               ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)}, 3e-2)]
    for options, tolerance in configs:
        model = copy.deepcopy(base)
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for x in batches:
            local = x.chunk(world)[rank]
            model(local).float().square().mean().backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            assert type(norm).__name__ == "DTensor", type(norm)
            optimizer.step()
            optimizer.zero_grad()
        for (name, got), want in zip(model.named_parameters(), reference.parameters()):
            full = got.full_tensor()
            assert full.dtype == torch.float32, (options, name, full.dtype)
            gap = ((full - want).abs().max() / want.abs().max()).item()
            assert gap <= tolerance, (options, name, gap)


def sequence_parallel(directory: str, rank: int, world: int) -> None:
    """parallelize_module with SequenceParallel on a LayerNorm and colwise /
    rowwise linears that take and give sequence shards, forward and backward
    against one process."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(16)
            self.up = torch.nn.Linear(16, 32)
            self.down = torch.nn.Linear(32, 16)

        def forward(self, x):
            return self.down(torch.relu(self.up(self.norm(x))))

    mesh = init_device_mesh("kiln", (world,))
    torch.manual_seed(0)
    reference = Block().to("kiln")
    model = copy.deepcopy(reference)
    parallelize_module(model, mesh, {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    })
    x = torch.randn(2, 4 * world, 16, device="kiln")
    want = reference(x)
    want.square().sum().backward()
    local = x.chunk(world, dim=1)[rank]  # this rank's sequence shard
    got = model(local)
    got.square().sum().backward()
    assert torch.allclose(got, want.chunk(world, dim=1)[rank], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert torch.allclose(grad, q.grad, rtol=1e-4, atol=1e-5), (name, (grad - q.grad).abs().max())


def failed_read(directory: str, rank: int, world: int) -> bool:
    """A collective that fails on its communication stream (ranks disagree
    on the size): reading its output raises the failure itself, as reading a
    failed eager kernel's output does; reading again says it was raised
    before; synchronize has nothing left to raise. Returns True: the group
    is unusable afterwards (as an aborted NCCL communicator), so no barrier."""
    from torch_kiln import _C

    x = torch.ones(3 + rank, device="kiln")
    # The collective runs after this device work, so it fails only after
    # all_reduce returned (Work.wait() raises a failure it already sees).
    _C._sleep(1000.0)
    dist.all_reduce(x)
    try:
        x.tolist()
        raise AssertionError("reading the failed all_reduce's output did not raise")
    except RuntimeError as e:
        assert "Kiln error: all_reduce: kccl: mismatched collectives" in str(e), str(e)
    try:
        x.tolist()
        raise AssertionError("reading it again did not raise")
    except RuntimeError as e:
        assert "were never computed" in str(e) and "mismatched collectives" in str(e), str(e)
    torch.kiln.synchronize()
    return True


def init_only(directory: str, rank: int, world: int) -> None:
    """Makes the group (and its shared-memory segments) and nothing else."""


def main() -> None:
    scenario, directory = sys.argv[1], sys.argv[2]
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.kiln.set_device(local_rank)
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    scenarios = {"dcp-save": dcp_save, "dcp-load": dcp_load, "funcol": funcol,
                 "fsdp-options": fsdp_options, "sequence-parallel": sequence_parallel,
                 "failed-read": failed_read, "init": init_only}
    if not scenarios[scenario](directory, rank, world):
        dist.barrier()
    print(f"APIS-OK {scenario} {rank} {world}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
