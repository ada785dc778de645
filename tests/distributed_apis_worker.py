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


def main() -> None:
    scenario, directory = sys.argv[1], sys.argv[2]
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.kiln.set_device(local_rank)
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    {"dcp-save": dcp_save, "dcp-load": dcp_load, "funcol": funcol}[scenario](directory, rank, world)
    dist.barrier()
    print(f"APIS-OK {scenario} {rank} {world}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
