"""A conformance worker: runs a share of the tests and streams the results.

Started by the driver (driver.py) as
    python worker.py SPEC.json EVENT_FD
where SPEC names the ops and modules to select (by key or name), this
worker's shard, the passes, quick mode, and tests to leave out (those a
previous worker already started). Events are JSON lines written to the file
descriptor EVENT_FD (stdout and stderr stay free for whatever torch prints):

    {"e": "plan", "tests": [...]}                      every test, in order
    {"e": "test", "method": ...}                       a test starts
    {"e": "begin", "op", "dtype", "pass", "i"}         a case starts
    {"e": "case", ...}                                 a CaseResult
    {"e": "done"}

SIGUSR1 dumps every thread's Python stack to stderr (the driver sends it to
a worker that stopped reporting, before killing it).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import warnings

import settings


def select(items, patterns: list[str] | None, key) -> list:
    """Items whose key, or name before the variant, is in patterns (all if None)."""
    if patterns is None:
        return list(items)
    wanted = set(patterns)
    return [item for item in items if key(item) in wanted or item.name in wanted]


def main() -> None:
    spec_path, event_fd = sys.argv[1], int(sys.argv[2])
    with open(spec_path) as f:
        spec = json.load(f)
    events = os.fdopen(event_fd, "w", buffering=1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    warnings.simplefilter("ignore")

    def send(event: dict) -> None:
        events.write(json.dumps(event) + "\n")

    import torch  # noqa: F401 - autoloads kiln
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.testing._internal.common_modules import module_db

    from samples import op_key
    from suites import TestRun, plan_tests, run_tests

    shard, shards = spec["shard"], spec["shards"]
    op_list = select(op_db, spec["ops"], op_key)[shard::shards]
    module_list = select(module_db, spec["modules"], lambda m: m.name)[shard::shards]
    run = TestRun(
        op_passes=tuple(p for p in spec["passes"]
                        if p in settings.OP_PASSES + settings.EXTRA_OP_PASSES),
        run_modules="modules" in spec["passes"],
        quick=spec["quick"],
        emit=lambda result: send({"e": "case", **result.to_json()}),
        begin=lambda op, dtype, pass_name, i: send(
            {"e": "begin", "op": op, "dtype": dtype, "pass": pass_name, "i": i}),
    )
    planned = plan_tests(op_list, module_list, run)
    leave_out = set(spec.get("leave_out", []))
    planned = [t for t in planned if t.method not in leave_out]
    send({"e": "plan", "tests": [t.method for t in planned]})
    run_tests(planned, run, started=lambda t: send(
        {"e": "test", "method": t.method, "key": t.key, "dtype": t.dtype_name}))
    send({"e": "done"})
    events.close()


if __name__ == "__main__":
    main()
