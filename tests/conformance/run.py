"""Kiln conformance run: PyTorch's OpInfo and ModuleInfo databases on kiln.

    python tests/conformance/run.py [--json PATH] [--report PATH] [--quick]
                                    [--ops add,mul,...] [--modules nn.Linear,...]
                                    [--passes forward,out,...] [--jobs N]

Runs every OpInfo in op_db (and every ModuleInfo in module_db) on kiln and on
the CPU and compares the results (see op_cases.py, module_cases.py); the
database's own skips apply (see suites.py). Then checks the failures against
known_failures.txt and exits 0 only if no case failed that the file does not
list and no listed case now passes.

--quick: every op in float32 and int64, the first few samples, forward and
backward (the shard `make test` runs). --ops/--modules select by key
("max.binary") or name ("max"); with --ops and no --modules no module runs.
--update-known-failures rewrites known_failures.txt for this run (new
failures get a "TODO classify" reason to edit).

--passes compiled (never run otherwise; `make conformance-compiled`): every
op in float32 and int64, the first sample, under torch.compile on kiln
compared with eager kiln (compiled_cases.py). It runs alone, judged against
known_failures_compiled.txt, with Inductor's cache in LOG_DIR/inductor-cache;
--report replaces only the compiled section of the page (the eager report
keeps that section when it rewrites the page).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import sys
import time

import known_failures
import settings
from driver import Driver, RunSpec
from outcomes import FAILED, CaseResult
from report import (Tally, compiled_markdown, compiled_section_of, markdown, summary,
                    with_compiled_section)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=pathlib.Path, help="write the JSON summary here")
    parser.add_argument("--report", type=pathlib.Path, help="write the markdown report here")
    parser.add_argument("--records", type=pathlib.Path,
                        help="write every case result here, one JSON line each")
    parser.add_argument("--quick", action="store_true",
                        help="float32 and int64, first samples, forward and backward")
    parser.add_argument("--ops", help="comma-separated op keys or names, 'all' (default) "
                        "or 'none'")
    parser.add_argument("--modules", help="comma-separated module names, 'all' or 'none' "
                        "(default: all, or none when --ops is given)")
    parser.add_argument("--passes", help="comma-separated, among "
                        f"{','.join(settings.ALL_PASSES)} (default: all but compiled)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--case-timeout", type=float, default=settings.DEFAULT_CASE_TIMEOUT_S,
                        help="seconds without progress before a worker counts as hung")
    parser.add_argument("--log-dir", default="/tmp/kiln-conformance",
                        help="worker logs and specs (default /tmp/kiln-conformance)")
    parser.add_argument("--known-failures", type=pathlib.Path,
                        help="default known_failures.txt, or known_failures_compiled.txt "
                        "for --passes compiled")
    parser.add_argument("--update-known-failures", action="store_true",
                        help="rewrite the known-failures file to match this run")
    parser.add_argument("--quiet", action="store_true", help="no per-test progress lines")
    parser.add_argument("--from-records", type=pathlib.Path,
                        help="run nothing: rebuild the summary and report from a --records file")
    return parser.parse_args(argv)


def _selection(text: str | None) -> list[str] | None:
    """'all' or absent -> None (everything); 'none' -> []; else the names."""
    if text is None or text == "all":
        return None
    if text == "none":
        return []
    return text.split(",")


def run_spec(args: argparse.Namespace) -> RunSpec:
    """What to run, from the command line."""
    ops = _selection(args.ops)
    modules = _selection(args.modules)
    if args.modules is None and ops is not None:
        modules = []
    if args.passes:
        passes = args.passes.split(",")
        unknown = set(passes) - set(settings.ALL_PASSES)
        if unknown:
            raise SystemExit(f"unknown passes {sorted(unknown)}; choose among "
                             f"{settings.ALL_PASSES}")
        if settings.COMPILED_PASS in passes and len(passes) > 1:
            raise SystemExit("--passes compiled runs alone (its own known-failures file "
                             "and report section)")
    elif args.quick:
        passes = list(settings.QUICK_OP_PASSES)
    else:
        passes = list(settings.PASSES)
    if "modules" not in passes:
        modules = []
    quick = args.quick
    if passes == [settings.COMPILED_PASS]:
        quick = True  # float32 and int64 (or an op's first dtype), first samples
    return RunSpec(ops=ops, modules=modules, passes=passes, quick=quick)


def is_compiled_run(spec: RunSpec) -> bool:
    return spec.passes == [settings.COMPILED_PASS]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    spec = run_spec(args)
    compiled = is_compiled_run(spec)
    if args.known_failures is None:
        args.known_failures = (settings.KNOWN_FAILURES_COMPILED_FILE if compiled
                               else settings.KNOWN_FAILURES_FILE)
    if compiled:
        args.quick = True
        # Inductor's on-disk caches stay on, under the run's log dir, so a
        # re-run compiles nothing it compiled before (workers inherit it).
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                              os.path.join(os.path.abspath(args.log_dir), "inductor-cache"))
    entries = known_failures.load(args.known_failures)
    tally = Tally()
    records = open(args.records, "w") if args.records else None
    reported_groups: set[tuple[str, str, str]] = set()

    def on_result(result) -> None:
        tally.add(result)
        if records:
            records.write(json.dumps(result.to_json()) + "\n")
        group = (result.op, result.dtype, result.pass_name)
        if result.status == FAILED and group not in reported_groups:
            reported_groups.add(group)
            listed = any(e.matches(group, result.index) for e in entries)
            marker = "known" if listed else "NEW"
            print(f"  FAIL [{marker}] {result.op} {result.dtype} {result.pass_name} "
                  f"#{result.index} (first in this group): {result.message}", flush=True)

    start = time.monotonic()
    harness_errors: list[str] = []
    command = "python tests/conformance/run.py " + " ".join(shlex.quote(a) for a in argv)
    recorded_runtime, recorded_command = None, None
    if args.from_records:
        with open(args.from_records) as lines:
            for line in lines:
                data = json.loads(line)
                if "runtime_s" in data:  # the trailer a recorded run ends with
                    recorded_runtime = data["runtime_s"]
                    args.quick = data.get("quick", False)
                    recorded_command = data.get("command")
                    compiled = compiled or data.get("compiled", False)
                else:
                    on_result(CaseResult.from_json(data))
    else:
        driver = Driver(spec, jobs=args.jobs, case_timeout=args.case_timeout,
                        log_dir=args.log_dir, on_result=on_result,
                        echo=(lambda _: None) if args.quiet else (lambda s: print(s, flush=True)))
        driver.run()
        harness_errors = driver.harness_errors
    runtime = recorded_runtime or time.monotonic() - start
    if records:
        records.write(json.dumps({"runtime_s": runtime, "quick": args.quick,
                                  "compiled": compiled, "command": command}) + "\n")
        records.close()

    verdict = known_failures.judge(entries, tally.ledger)
    data = summary(tally, verdict, runtime_s=runtime, quick=args.quick)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        existing = args.report.read_text() if args.report.exists() else ""
        report_command = (recorded_command or command).strip()
        rebuilt_by = command.strip() if args.from_records else None
        if compiled:
            page = with_compiled_section(existing, compiled_markdown(
                tally, verdict, data, command=report_command, rebuilt_by=rebuilt_by,
                known_failures_file=args.known_failures))
        else:
            page = with_compiled_section(
                markdown(tally, verdict, data, command=report_command, rebuilt_by=rebuilt_by),
                compiled_section_of(existing))
        args.report.write_text(page)
    if args.update_known_failures:
        known_failures.write(args.known_failures, known_failures.updated(entries, tally.ledger))
    return print_verdict(data, verdict, harness_errors, args.known_failures.name)


def print_verdict(data: dict, verdict: known_failures.Verdict, harness_errors: list[str],
                  known_failures_name: str = "known_failures.txt") -> int:
    """Prints the totals and what makes the run fail; returns the exit code."""
    print()
    for name in settings.ALL_PASSES:
        c = data[name]
        if any(c[s] for s in ("passed", "failed", "xfailed", "skipped")):
            rate = "—" if c["pass_rate"] is None else f"{100 * c['pass_rate']:.2f}%"
            print(f"{name:>14}: {c['passed']} passed, {c['failed']} failed, "
                  f"{c['xfailed']} xfailed, {c['skipped']} skipped ({rate})")
    rate = "—" if data["pass_rate"] is None else f"{100 * data['pass_rate']:.2f}%"
    print(f"pass rate {rate} over {data['ops']} ops/modules in {data['runtime_s']:.0f} s")
    new_by_group: dict[tuple[str, str, str], list] = {}
    for result in verdict.new_failures:
        new_by_group.setdefault((result.op, result.dtype, result.pass_name), []).append(result)
    for (op, dtype, pass_name), results in new_by_group.items():
        samples = known_failures.format_indices({r.index for r in results})
        print(f"NEW FAILURE {op} {dtype} {pass_name} samples {samples}: {results[0].message}")
    for entry, why in verdict.stale:
        print(f"FIXED (remove from {known_failures_name} line {entry.line}): "
              f"{entry.op} {entry.dtype} {entry.pass_name}: {why}")
    for error in harness_errors:
        print(f"HARNESS ERROR {error}")
    if harness_errors:
        return 2
    if data["pass_rate"] is None:
        print("no case ran")
        return 1
    print(f"verdict: {len(verdict.new_failures)} new failures, {len(verdict.stale)} listed "
          f"failures fixed, {verdict.known_failed_cases} listed failing cases")
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
