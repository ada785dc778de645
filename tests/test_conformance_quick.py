"""The quick conformance shard (issue 6), part of `make test`.

Every OpInfo op of PyTorch's op_db in float32 and int64 (or its first
supported dtype), the first few samples, forward and backward, run on kiln
and compared bit for bit with the CPU by tests/conformance/run.py --quick.
Fails on a failing case that tests/conformance/known_failures.txt does not
list, and on a listed case that now passes (remove it from the list).
`make conformance` runs everything.

It runs with two worker processes (--jobs 2, as `make conformance` does): a
worker is mostly one Python thread, so one worker leaves a core of the
2-core machine idle; the cases and their verdicts do not depend on the
worker count (each worker takes every other op).
"""

import json
import pathlib
import subprocess
import sys

RUNNER = pathlib.Path(__file__).resolve().parent / "conformance" / "run.py"


def test_quick_conformance_shard(tmp_path):
    summary_path = tmp_path / "conformance.json"
    command = [sys.executable, str(RUNNER), "--quick", "--jobs", "2", "--quiet", "--json", str(summary_path),
               "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    output = "\n".join(proc.stdout.splitlines()[-80:]) + "\n" + proc.stderr[-3000:]
    assert proc.returncode == 0, f"{' '.join(command)} failed:\n{output}"
    summary = json.loads(summary_path.read_text())
    assert summary["ops"] > 600, summary
    assert summary["forward"]["passed"] > 0 and summary["backward"]["passed"] > 0, summary
