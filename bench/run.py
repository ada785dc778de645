"""Kiln's benchmark suite: kiln next to PyTorch CPU, side by side in one run.

    python bench/run.py [--quick] [--json PATH] [--threads N] [--groups G,...]
    make bench                      # the full run

Prints one table. Columns:
  CPU    the benchmark on PyTorch's CPU device (synchronous: an op's time is
         its kernel plus PyTorch's dispatch on the calling thread)
  kiln   the same benchmark on kiln:0 (asynchronous: ops are queued on the
         default stream and run by its worker thread; every kiln timing ends
         with torch.kiln.synchronize())
  ratio  kiln / CPU of the unit shown: for times (us, ms) lower is better
         for kiln, for throughputs (GB/s, images/s, tokens/s) higher is
  noise  the larger of the two columns' interquartile range / median
  target issue 4's target for that row, and PASS or MISS (by how much)

Like with like: the kernels on both sides are ATen's CPU kernels with the
same number of intra-op threads. --threads N (default 1) is applied with
torch.set_num_threads(N) before kiln's first use, and the run checks, with a
probe op executed inside a kiln task, that the kiln stream worker reports the
same at::get_num_threads(); a mismatch is printed as an error. Why 1 by
default: on this 2-core VM, 2-thread OpenMP kernels are erratic (several
times slower than 1 thread for some shapes, and at the mercy of any other
load), and kiln's worker runs beside the Python thread, so kiln with 2
intra-op threads would put 3 busy threads on 2 cores. Note that kiln's
asynchrony means its Python thread and its worker run concurrently: with
N = 1, CPU uses one core, kiln up to two (as a GPU adds its own hardware).
The group training-default-threads runs the training rows again at
PyTorch's default thread count (harness.DEFAULT_INTRA_OP_THREADS), where
both devices use every core.

Method: see bench/harness.py (warm-up, interleaved repetitions, medians) and
bench/README.md for what every row measures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

import harness  # noqa: E402  (bench/ is on sys.path as the script's directory)
import micro  # noqa: E402
import training  # noqa: E402
import compilation  # noqa: E402
import kernels  # noqa: E402
import collectives  # noqa: E402
import graphs  # noqa: E402
import fusion  # noqa: E402

GROUPS = {
    "add": micro.add_overhead,
    "empty": micro.empty_free,
    "matmul": micro.matmul,
    "conv": micro.conv,
    "copies": micro.copies,
    "queue": micro.pending_op_memory,
    "training": training.throughput,
    "training-default-threads": training.throughput_at_default_threads,
    "memory": training.peak_memory,
    "compile": compilation.throughput,
    "compile-time": compilation.compile_time,
    "kernels": kernels.throughput,
    "collectives": collectives.throughput,
    "graphs": graphs.replay_overhead,
    "fusion": fusion.chain_fused_vs_unfused,
}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _kiln_build() -> str:
    """The Kiln source the run measured: git commit (+dirty) of the checkout
    holding torch_kiln, and when its compiled extension was built."""
    import subprocess
    import torch_kiln
    root = os.path.dirname(os.path.dirname(os.path.abspath(torch_kiln.__file__)))
    try:
        commit = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"],
                                capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    built = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(torch_kiln._C.__file__)))
    return f"{root} at {commit or 'unknown commit'}, extension built {built}"


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.1f}"
    if value >= 10:
        return f"{value:.2f}"
    return f"{value:.3f}"


def print_table(rows: list[harness.Row]) -> None:
    headers = ["benchmark", "unit", "CPU", "kiln", "ratio", "noise", "target", "status"]
    table = []
    for r in rows:
        ratio = r.ratio
        table.append([
            r.name, r.unit, _fmt(r.cpu), _fmt(r.kiln),
            "-" if ratio is None else f"{ratio:.2f}x",
            "-" if r.noise is None else f"{r.noise * 100:.0f}%",
            "" if r.target is None else r.target.describe(r.unit), r.status(),
        ])
    widths = [max(len(headers[i]), *(len(t[i]) for t in table)) for i in range(len(headers))]
    right = {2, 3, 4, 5}

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    print(line(headers))
    print("  ".join("-" * w for w in widths))
    group = None
    for r, cells in zip(rows, table):
        if r.group != group and group is not None:
            print()
        group = r.group
        print(line(cells))
    notes = [(r.name, r.note) for r in rows if r.note]
    if notes:
        print()
        for name, note in notes:
            print(f"  {name}: {note}")


def _warn_if_busy(other_cpus: float) -> None:
    """Timings on a machine busy with other work are inflated and noisy."""
    if other_cpus > 0.2:
        print(f"WARNING: other processes kept {other_cpus:.1f} of the {os.cpu_count()} CPUs "
              f"busy during the run: timings are inflated and noisy, and kiln (a Python "
              f"thread plus a stream worker) suffers more than CPU (one thread).")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer repetitions and steps (under 2 minutes)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads for both devices' kernels (default 1)")
    parser.add_argument("--groups", default=",".join(GROUPS),
                        help="comma-separated subset of: " + ", ".join(GROUPS))
    args = parser.parse_args()
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        parser.error(f"unknown group(s) {unknown}; choose from {list(GROUPS)}")

    started = time.perf_counter()
    # Before kiln's first use, so its stream worker picks the setting up too.
    torch.set_num_threads(args.threads)
    if not (hasattr(torch, "kiln") and torch.kiln.is_available()):
        print("kiln is not available (is Kiln installed? `make build`)", file=sys.stderr)
        return 1
    worker_threads, worker_tid = harness.kiln_task_threads()
    workers = harness.kiln_stream_workers()
    load_start = os.getloadavg()
    other_load = harness.OtherLoad()

    mode = "quick" if args.quick else "full"
    print(f"Kiln benchmarks ({mode} run): torch {torch.__version__}, {os.cpu_count()} CPUs "
          f"({_cpu_model()}), Python {platform.python_version()}")
    print(f"kiln: {_kiln_build()}")
    print(f"intra-op threads: CPU ops: torch.get_num_threads() = {torch.get_num_threads()}; "
          f"kiln ops: at::get_num_threads() inside a kiln task = {worker_threads} "
          f"(set with --threads {args.threads} before kiln started)")
    print(f"                  interop threads {torch.get_num_interop_threads()}; "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
          f"MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS', 'unset')}")
    print(f"kiln stream workers: {workers} (threads named kiln-stream; this run uses kiln:0's "
          f"default stream, worker tid {worker_tid})")
    print(f"load average at start: {load_start[0]:.2f} (1 min); method: medians of interleaved "
          f"CPU/kiln repetitions after warm-up, kiln synchronized before every timer stop")
    if worker_threads != torch.get_num_threads():
        print(f"\nERROR: kiln's stream worker runs kernels with {worker_threads} intra-op "
              f"threads but the caller has {torch.get_num_threads()}: CPU and kiln columns "
              f"would not compare like with like (a Kiln bug).\n")
    print(flush=True)

    rows: list[harness.Row] = []
    group_other_load: dict[str, float] = {}
    for group in groups:
        t0 = time.perf_counter()
        group_load = harness.OtherLoad()
        rows += GROUPS[group](args.quick)
        group_other_load[group] = group_load.cpus()
        print(f"  [{group}: {time.perf_counter() - t0:.1f} s; other processes used "
              f"{group_other_load[group]:.2f} CPUs meanwhile]", file=sys.stderr, flush=True)

    print_table(rows)

    targets = [r for r in rows if r.target is not None]
    missed = [r for r in targets if not r.status().startswith("PASS")]
    follow = harness.check_threads_follow_caller(args.threads)
    load_end = os.getloadavg()
    others = other_load.cpus()
    elapsed = time.perf_counter() - started
    print()
    print(f"targets: {len(targets) - len(missed)} of {len(targets)} met"
          + (f"; missed: {'; '.join(r.name for r in missed)}" if missed else ""))
    print(f"thread check: after torch.set_num_threads({follow['caller_set']}) on a running kiln, "
          f"a kiln task reports {follow['worker_reports']} intra-op threads: "
          + ("follows the caller" if follow["follows"] else
             "DOES NOT follow the caller (a Kiln bug: see Note [Intra-op threads of kiln "
             "kernels]; this run's comparisons are unaffected because --threads is set "
             "before kiln starts)"))
    print(f"other processes used {others:.2f} of {os.cpu_count()} CPUs on average during the "
          f"run (load average at end {load_end[0]:.2f}); wall time {elapsed:.0f} s")
    _warn_if_busy(others)

    if args.json:
        result = {
            "mode": mode, "torch": torch.__version__, "cpus": os.cpu_count(),
            "cpu_model": _cpu_model(), "threads": {
                "requested": args.threads, "cpu_intra_op": torch.get_num_threads(),
                "kiln_task_intra_op": worker_threads,
                "interop": torch.get_num_interop_threads(), "kiln_stream_workers": workers,
                "follow_check": follow},
            "load_average": {"start": load_start, "end": load_end},
            "other_processes_cpus": {"run": others, **group_other_load},
            "seconds": elapsed, "rows": [r.to_json() for r in rows],
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
