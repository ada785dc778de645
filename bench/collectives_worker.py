"""One rank of the collectives benchmark (bench/collectives.py starts it
under torchrun; not a benchmark on its own).

    collectives_worker.py --sizes 4096,1048576 --reps 7 --json OUT

The group is ``backend="cpu:gloo,kiln:kccl"``: the same processes time kccl
on kiln tensors and Gloo on CPU tensors, interleaved per size. A repetition
is ``k`` back-to-back collectives (k so that a repetition moves about
64 MiB, 1 to 50 operations) ended by ``torch.kiln.synchronize()`` for kccl;
the ranks start it together (a Gloo barrier) and its time is the slowest
rank's (an all_reduce MAX over Gloo). Rank 0 writes
{"world": N, "results": [{"op", "bytes", "backend", "seconds": [per-op
time of each repetition]}]} to OUT. "bytes" is nccl-tests' size: the
tensor of all_reduce, the output of all_gather_into_tensor, the input of
reduce_scatter_tensor, float32.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def _buffers(op: str, nbytes: int, world: int, device: str):
    n = max(nbytes // 4, world)
    n -= n % world
    if op == "all_reduce":
        t = torch.ones(n, device=device)
        return lambda: dist.all_reduce(t)
    if op == "all_gather_into_tensor":
        out, inp = torch.empty(n, device=device), torch.ones(n // world, device=device)
        return lambda: dist.all_gather_into_tensor(out, inp)
    out, inp = torch.empty(n // world, device=device), torch.ones(n, device=device)
    return lambda: dist.reduce_scatter_tensor(out, inp)


def _repetition(run, calls: int, device: str) -> float:
    sync = torch.kiln.synchronize if device.startswith("kiln") else (lambda: None)
    sync()
    dist.barrier(group=_CPU_GROUP)
    start = time.perf_counter()
    for _ in range(calls):
        run()
    sync()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=_CPU_GROUP)
    return elapsed.item() / calls


_CPU_GROUP = None


def main() -> None:
    global _CPU_GROUP
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.set_num_threads(1)
    torch.kiln.set_device(local_rank)
    dist.init_process_group(backend="cpu:gloo,kiln:kccl")
    _CPU_GROUP = dist.new_group(backend="gloo")
    world = dist.get_world_size()
    device = f"kiln:{local_rank}"
    results = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        calls = max(1, min(50, (64 << 20) // max(nbytes, 1)))
        for op in OPS:
            runs = {"kccl": _buffers(op, nbytes, world, device), "gloo": _buffers(op, nbytes, world, "cpu")}
            for backend, run in runs.items():  # warm-up: connections, allocations
                _repetition(run, 1, device if backend == "kccl" else "cpu")
            seconds = {"kccl": [], "gloo": []}
            for rep in range(args.reps):
                order = ("kccl", "gloo") if rep % 2 == 0 else ("gloo", "kccl")
                for backend in order:
                    seconds[backend].append(
                        _repetition(runs[backend], calls, device if backend == "kccl" else "cpu"))
            for backend, values in seconds.items():
                results.append({"op": op, "bytes": nbytes, "backend": backend, "calls": calls,
                                "seconds": values})
            del runs
    if dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump({"world": world, "results": results}, f)
    dist.barrier(group=_CPU_GROUP)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
