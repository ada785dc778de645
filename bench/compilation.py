"""torch.compile on kiln, measured against Inductor on the CPU (issue 11).

Two row kinds, for each example model of bench/training.py (the examples'
models and training steps):
  * throughput: training steps of the model compiled with the default
    backend (Inductor; on kiln, Inductor for kiln) on kiln and on the CPU,
    after warm-up steps that include the compilation, interleaved as every
    benchmark here (harness.py). Rows: compiled kiln vs compiled CPU
    (target kiln >= 1.0x CPU), and the compiled/eager speedup on each device
    (target: kiln's speedup >= CPU's, a ratio of ratios >= 1.0), with the
    eager steps measured in the same interleaved run.
  * compile seconds: a fresh Python process builds the model, compiles it and
    runs one training step (time from torch.compile to the step's end,
    synchronized), first with an empty Inductor cache directory (cold), then
    again in a new process with the cache the first one filled (warm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch

import training
from harness import CPU, KILN, Row, Target, interleaved, median, row_from_samples, spread, sync, timed

PLANS = {"quick": (2, 5, 3), "full": (3, 20, 7)}  # warmup steps, steps per rep, reps
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))


def throughput(quick: bool) -> list[Row]:
    rows = []
    warmup, steps, repetitions = PLANS["quick" if quick else "full"]
    for name, trainer_class, _ in training.MODELS:
        trainers = {(device, backend): trainer_class(device, backend)
                    for device in (CPU, KILN) for backend in (None, "inductor")}
        for trainer in trainers.values():
            trainer.step(warmup)  # compiles (forward and backward) on the first step
        sync(KILN)
        reps = {f"{device}/{backend or 'eager'}": timed(device, lambda t=t: t.step(steps),
                                                         steps * t.items_per_step)
                for (device, backend), t in trainers.items()}
        samples = interleaved(reps, repetitions, warmup=0)
        note = f"{steps} steps x {repetitions} reps after {warmup} warm-up steps"
        unit = f"{trainer_class.unit}/s"
        rows.append(row_from_samples(
            "compile", f"{name} training, compiled", unit,
            {CPU: samples["cpu/inductor"], KILN: samples["kiln/inductor"]},
            lambda s: 1.0 / s, higher_is_better=True, target=Target("ratio>=", 1.0), note=note))
        speedup = {device: median(samples[f"{device}/eager"]) / median(samples[f"{device}/inductor"])
                   for device in (CPU, KILN)}
        rows.append(Row(
            "compile", f"{name}: compiled / eager speedup", "x", speedup[CPU], speedup[KILN],
            higher_is_better=True, target=Target("ratio>=", 1.0),
            noise=max(spread(s) for s in samples.values()),
            note=note + "; ratio = kiln's speedup / CPU's speedup",
            samples={k: [1.0 / x for x in v] for k, v in samples.items()}))
        del trainers, reps
    return rows


def _compile_seconds(model: str, device: str, cache_dir: str) -> float:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    result = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--probe", model, device],
        env=env, capture_output=True, text=True, timeout=1800, cwd=BENCH_DIR)
    if result.returncode != 0:
        raise RuntimeError(f"compile probe for {model} on {device} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])["seconds"]


def compile_time(quick: bool) -> list[Row]:
    rows = []
    models = training.MODELS[1:] if quick else training.MODELS  # quick: the GPT only
    for name, trainer_class, _ in models:
        key = "gpt" if trainer_class is training.GptTrainer else "cnn"
        seconds = {}
        for device in (CPU, KILN):
            with tempfile.TemporaryDirectory(prefix="kiln-bench-inductor-") as cache_dir:
                seconds[device] = (_compile_seconds(key, device, cache_dir),
                                   _compile_seconds(key, device, cache_dir))
        for i, which in enumerate(("cold", "warm")):
            rows.append(Row(
                "compile", f"{name}: compile + first step, {which} cache", "s",
                seconds[CPU][i], seconds[KILN][i],
                note="fresh process; " + ("empty Inductor cache directory" if i == 0 else
                                          "the cache the cold process filled")))
    return rows


def _probe(model: str, device: str) -> None:
    import time
    trainer_class = training.GptTrainer if model == "gpt" else training.CnnTrainer
    trainer_class.data()  # data loading is not compile time
    start = time.perf_counter()
    trainer = trainer_class(device, "inductor")
    trainer.step(1)
    sync(device)
    print(json.dumps({"seconds": time.perf_counter() - start}))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--probe":
        _probe(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python bench/run.py --groups compile,compile-time "
                 "(this file's own command line is the compile-time probe)")
