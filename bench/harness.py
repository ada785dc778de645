"""Measurement machinery shared by the benchmark groups of bench/run.py.

Method (the same for every benchmark, see bench/README.md):
  * A benchmark gives one *repetition* function per device. A repetition
    runs a fixed amount of work (k ops, or k training steps) and returns the
    elapsed time per unit of work in seconds, from time.perf_counter(). For
    kiln it calls torch.kiln.synchronize() before starting the timer (so no
    earlier work is counted) and again before stopping it (so all of its own
    work is counted).
  * Each device's repetition is first run `warmup` times untimed, then the
    devices' repetitions alternate (CPU, kiln, kiln, CPU, CPU, kiln, ...) so
    that drift on this shared machine affects both equally; the reported
    value is the median of each device's repetitions. The Python garbage
    collector is off while timing (as in timeit), for both devices.
"""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

KILN = "kiln"
CPU = "cpu"
DEVICES = (CPU, KILN)

# PyTorch's own choice of intra-op threads for this machine, read at import
# (run.py imports this module before it applies --threads): the
# training-default-threads group runs at it.
DEFAULT_INTRA_OP_THREADS = torch.get_num_threads()


def sync(device: str) -> None:
    """Waits for `device`'s queued work (a no-op for the synchronous CPU)."""
    if device == KILN:
        torch.kiln.synchronize()


def timed(device: str, body: Callable[[], None], units: float) -> Callable[[], float]:
    """A repetition function: runs body() once between synchronizations and
    returns the elapsed seconds divided by `units` (the work body() does)."""
    perf_counter = time.perf_counter

    def rep() -> float:
        sync(device)
        start = perf_counter()
        body()
        sync(device)
        return (perf_counter() - start) / units

    return rep


def interleaved(reps: dict[str, Callable[[], float]], repetitions: int,
                warmup: int = 1) -> dict[str, list[float]]:
    """Runs each device's repetition `warmup` times, then `repetitions` times
    alternating between devices (the order flips every round). Returns the
    samples (seconds per unit) of each device."""
    order = list(reps)
    for _ in range(warmup):
        for device in order:
            reps[device]()
    samples: dict[str, list[float]] = {device: [] for device in order}
    gc.collect()
    gc.disable()
    try:
        for r in range(repetitions):
            for device in (order if r % 2 == 0 else order[::-1]):
                samples[device].append(reps[device]())
    finally:
        gc.enable()
    return samples


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> float:
    """Relative interquartile range of `values` (0.05 = 5%), a noise gauge."""
    if len(values) < 4:
        return (max(values) - min(values)) / statistics.median(values)
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / statistics.median(values)


# ---------------------------------------------------------------- results

@dataclass
class Target:
    """A target from issue 4. kind: 'ratio<=' (kiln/CPU time ratio at most
    `value`), 'ratio>=' (kiln/CPU throughput ratio at least `value`),
    'kiln<=' (kiln's own value, in the row's unit, at most `value`)."""
    kind: str
    value: float

    def describe(self, unit: str) -> str:
        if self.kind == "kiln<=":
            return f"kiln <= {self.value:g}" + ("" if unit == "x" else f" {unit}")
        return f"kiln/CPU {self.kind[5:]} {self.value:g}"


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.1f}%" if fraction < 0.1 else f"{fraction * 100:.0f}%"


@dataclass
class Row:
    """One line of the table. `cpu` and `kiln` are in `unit`; `higher_is_better`
    tells whether they are throughputs (ratio = kiln/CPU throughput) or times
    (ratio = kiln/CPU time)."""
    group: str
    name: str
    unit: str
    cpu: float | None
    kiln: float | None
    higher_is_better: bool = False
    target: Target | None = None
    noise: float | None = None
    note: str = ""
    samples: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.cpu is None or self.kiln is None or self.cpu == 0:
            return None
        return self.kiln / self.cpu

    def status(self) -> str:
        """'' (no target), 'PASS', or 'MISS (x% over/under)'."""
        if self.target is None:
            return ""
        measured = self.kiln if self.target.kind == "kiln<=" else self.ratio
        if measured is None:
            return "n/a"
        limit = self.target.value
        if self.target.kind in ("ratio<=", "kiln<="):
            if measured <= limit:
                return "PASS"
            return f"MISS (+{_pct(measured / limit - 1)})"
        if measured >= limit:
            return "PASS"
        return f"MISS (-{_pct(1 - measured / limit)})"

    def to_json(self) -> dict:
        return {
            "group": self.group, "name": self.name, "unit": self.unit, "cpu": self.cpu,
            "kiln": self.kiln, "ratio": self.ratio, "higher_is_better": self.higher_is_better,
            "target": None if self.target is None else {"kind": self.target.kind,
                                                        "value": self.target.value},
            "status": self.status(), "noise": self.noise, "note": self.note,
            "samples": self.samples,
        }


def row_from_samples(group: str, name: str, unit: str, samples: dict[str, list[float]],
                     scale: Callable[[float], float], higher_is_better: bool = False,
                     target: Target | None = None, note: str = "") -> Row:
    """A Row from per-device samples (seconds per unit of work); `scale` turns
    a median into the displayed unit (e.g. s -> us, or s/byte -> GB/s)."""
    values = {d: scale(median(s)) for d, s in samples.items()}
    return Row(group, name, unit, values.get(CPU), values.get(KILN), higher_is_better, target,
               noise=max(spread(s) for s in samples.values()), note=note,
               samples={d: [scale(x) for x in s] for d, s in samples.items()})


# ---------------------------------------------------------------- machine load

class OtherLoad:
    """How much CPU other processes used since construction, in CPUs (1.0 =
    one core fully busy): all busy time in /proc/stat minus this process's
    own CPU time. On a shared machine this says how far timings can be
    trusted."""

    def __init__(self):
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        ticks = os.sysconf("SC_CLK_TCK")
        busy = (sum(fields[:8]) - idle) / ticks
        own = sum(os.times()[:2])  # user + system of all our threads
        return time.monotonic(), busy, own

    def cpus(self) -> float:
        t0, busy0, own0 = self._start
        t1, busy1, own1 = self._sample()
        if t1 - t0 <= 0:
            return 0.0
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / (t1 - t0))


# ---------------------------------------------------------------- threads

_probe_library = None


def _define_thread_probe() -> None:
    """Defines kiln_bench::intra_op_threads(Tensor x) -> Tensor: its CPU
    kernel (Python) returns [at::get_num_threads(), OS thread id] of the
    thread that runs it. On a kiln tensor Kiln runs that CPU kernel as a task
    on the stream's worker thread, so it reports the worker's settings. The
    kernel needs the GIL; the caller releases it in torch.kiln.synchronize()."""
    global _probe_library
    if _probe_library is not None:
        return
    lib = torch.library.Library("kiln_bench", "DEF")
    lib.define("intra_op_threads(Tensor x) -> Tensor")

    def cpu_kernel(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor([torch.get_num_threads(), threading.get_native_id()], dtype=torch.int64)

    lib.impl("intra_op_threads", cpu_kernel, "CPU")
    torch.library.register_fake("kiln_bench::intra_op_threads", lambda x: torch.empty(
        2, dtype=torch.int64, device=x.device), lib=lib)
    _probe_library = lib


def kiln_task_threads() -> tuple[int, int]:
    """(at::get_num_threads() inside a task on kiln's current stream, the OS
    thread id that ran the task)."""
    _define_thread_probe()
    out = torch.ops.kiln_bench.intra_op_threads(torch.zeros(1, device=KILN))
    torch.kiln.synchronize()
    threads, tid = out.cpu().tolist()
    return int(threads), int(tid)


def kiln_stream_workers() -> int:
    """Number of live kiln stream worker threads (named 'kiln-stream')."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == "kiln-stream"
        except OSError:
            pass
    return count


def check_threads_follow_caller(threads: int) -> dict:
    """Asks whether kiln's worker follows a torch.set_num_threads() made
    after the worker started: sets `threads + 1` (or 1), probes, restores.
    Run it last: the worker may keep the changed setting."""
    other = threads + 1 if threads == 1 else 1
    torch.set_num_threads(other)
    worker, _ = kiln_task_threads()
    torch.set_num_threads(threads)
    return {"caller_set": other, "worker_reports": worker, "follows": worker == other}
