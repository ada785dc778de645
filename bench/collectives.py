"""torch.distributed collectives (issue 12): kccl on kiln tensors next to
Gloo on CPU tensors, measured in the same torchrun job.

For 2 and 4 ranks (quick: 2) and sizes from 4 KiB to 256 MiB (quick: 4 KiB,
1 MiB, 32 MiB), bench/collectives_worker.py times all_reduce,
all_gather_into_tensor and reduce_scatter_tensor on float32 with
``backend="cpu:gloo,kiln:kccl"``. Rows, with the CPU column holding Gloo and
the kiln column kccl:
  * bus bandwidth, GB/s (1e9 bytes/s), from the p50 per-operation time with
    nccl-tests' formulas (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md):
    algbw = bytes / time; busbw = algbw * 2(n-1)/n for all_reduce and
    algbw * (n-1)/n for all_gather and reduce_scatter, where bytes is the
    all_reduce tensor, the all_gather output, the reduce_scatter input.
    Target (issue 12): all_reduce at 32 MiB, kccl >= 10x Gloo's.
  * latency at 4 KiB, us (p50): target kccl <= 1/5 of Gloo's.
  * DDP training step time (issue 12 asks for it next to one process, no
    target): examples/train_char_gpt.py on kiln, the same global batch, as
    one process (CPU column) and as `--parallel ddp` over 2 ranks under
    torchrun (kiln column), ms per step (the run's training seconds over its
    steps, first step included).
Each torchrun job has a timeout (TIMEOUT) and is killed as a process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

from harness import Row, Target, median, spread

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = {"quick": [4 << 10, 1 << 20, 32 << 20],
         "full": [4 << 10, 64 << 10, 1 << 20, 32 << 20, 256 << 20]}
RANKS = {"quick": [2], "full": [2, 4]}
DDP_STEPS = {"quick": 20, "full": 50}
ROOT = os.path.dirname(HERE)
REPS = {"quick": 5, "full": 9}
TIMEOUT = 1800  # seconds per torchrun job
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n,
              "all_gather_into_tensor": lambda n: (n - 1) / n,
              "reduce_scatter_tensor": lambda n: (n - 1) / n}


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _measure(ranks: int, sizes: list[int], reps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "collectives.json")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={ranks}", os.path.join(HERE, "collectives_worker.py"),
                   "--sizes", ",".join(map(str, sizes)), "--reps", str(reps), "--json", out]
        env = dict(os.environ, KILN_DEVICE_COUNT=str(max(ranks, 2)), OMP_NUM_THREADS="1")
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            raise RuntimeError(f"collectives benchmark with {ranks} ranks did not finish "
                               f"within {TIMEOUT} s:\n{log[-3000:]}")
        if proc.returncode != 0:
            raise RuntimeError(f"collectives benchmark with {ranks} ranks failed:\n{log[-3000:]}")
        with open(out) as f:
            return json.load(f)


def _run_char_gpt(command: list[str], json_path: str, env: dict) -> dict:
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True, cwd=ROOT)
    try:
        log, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise RuntimeError(f"{' '.join(command)} did not finish within {TIMEOUT} s:\n{log[-3000:]}")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{log[-3000:]}")
    with open(json_path) as f:
        return json.load(f)


def ddp_step_time(quick: bool) -> Row:
    """The char GPT's training step on kiln: one process vs DDP over 2 ranks."""
    steps = DDP_STEPS["quick" if quick else "full"]
    script = os.path.join(ROOT, "examples", "train_char_gpt.py")
    flags = ["--device", "kiln", "--max-steps", str(steps), "--sample-length", "1"]
    env = dict(os.environ, KILN_DEVICE_COUNT="2", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        one = _run_char_gpt([sys.executable, script, *flags, "--json", f"{tmp}/one.json"],
                            f"{tmp}/one.json", env)
        ddp = _run_char_gpt([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node=2", script, *flags, "--parallel", "ddp",
                             "--json", f"{tmp}/ddp.json"], f"{tmp}/ddp.json", env)
    return Row("collectives", "char GPT training step, DDP over 2 ranks vs 1 process", "ms",
               one["seconds"] / len(one["steps"]) * 1e3, ddp["seconds"] / len(ddp["steps"]) * 1e3,
               note=f"examples/train_char_gpt.py on kiln, {steps} steps, default sizes, the same "
                    f"global batch; CPU column = one process, kiln column = --parallel ddp under "
                    f"torchrun with 2 ranks (kccl); training seconds / steps, first step included; "
                    f"one run each")


def throughput(quick: bool) -> list[Row]:
    plan = "quick" if quick else "full"
    rows: list[Row] = []
    for ranks in RANKS[plan]:
        data = _measure(ranks, SIZES[plan], REPS[plan])
        by_key = {(r["op"], r["bytes"], r["backend"]): r for r in data["results"]}
        for op in BUS_FACTOR:
            for nbytes in SIZES[plan]:
                gloo, kccl = by_key[(op, nbytes, "gloo")], by_key[(op, nbytes, "kccl")]
                factor = BUS_FACTOR[op](ranks)
                busbw = {name: nbytes / median(r["seconds"]) * factor / 1e9
                         for name, r in (("gloo", gloo), ("kccl", kccl))}
                noise = max(spread(gloo["seconds"]), spread(kccl["seconds"]))
                first = not any(r.note for r in rows if f"{ranks} ranks" in r.name)
                note = (f"{ranks} ranks, float32, p50 of {len(kccl['seconds'])} repetitions of "
                        f"1-50 ops (about 64 MiB each); CPU column = Gloo on CPU tensors in "
                        f"the same job, kiln column = kccl on kiln tensors") if first else ""
                target = Target("ratio>=", 10.0) if op == "all_reduce" and nbytes == 32 << 20 \
                    else None
                rows.append(Row("collectives", f"{op} {_size(nbytes)}, {ranks} ranks: bus bandwidth",
                                "GB/s", busbw["gloo"], busbw["kccl"], higher_is_better=True,
                                target=target, noise=noise, note=note))
                if nbytes == 4 << 10:
                    rows.append(Row("collectives", f"{op} {_size(nbytes)}, {ranks} ranks: latency",
                                    "us", median(gloo["seconds"]) * 1e6,
                                    median(kccl["seconds"]) * 1e6,
                                    target=Target("ratio<=", 0.2) if op == "all_reduce" else None,
                                    noise=noise, note=note))
    rows.append(ddp_step_time(quick))
    return rows
