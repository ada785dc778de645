"""Bad input for the audit command: a missing script, one that raises or
exits non-zero, one that runs forever (--timeout), one that does not parse;
and the JSON document's shape."""

import os
import textwrap

from audit_helpers import audit_env, found, run_audit, run_audit_json

from torch_kiln.audit.runner import run_script


def write(tmp_path, name, code):
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return os.path.realpath(path)


def test_missing_script_is_a_clear_error_with_status_2(tmp_path):
    missing = str(tmp_path / "nope.py")
    result = run_audit(missing)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"kiln-audit: error: cannot audit {missing!r}: no such file; "
                                     "expected a Python script (python -m torch_kiln.audit "
                                     "[options] script.py [args])")


def test_bad_timeout_is_a_usage_error(tmp_path):
    result = run_audit("--timeout", "-1", "x.py")
    assert result.returncode == 2 and "expected seconds (a number > 0); got '-1'" in result.stderr


def test_script_that_raises_reports_and_keeps_its_status(tmp_path):
    script = write(tmp_path, "raises.py", """\
        import torch
        x = torch.ones(2, device="cuda")
        print("before")
        raise ValueError("boom")
        """)
    result, report = run_audit_json(tmp_path, "--map-cuda", script, "--flag")
    assert result.returncode == 1
    assert result.stdout == "before\n"
    assert found(report["findings"]) == {(script, 2, "device-string"), (script, 4, "run-failure")}
    (failure,) = [f for f in report["findings"] if f["category"] == "run-failure"]
    assert failure["message"] == "the script raised ValueError: boom"
    # not "run with --map-cuda", the category's advice: this run did
    assert failure["replacement"] == "fix the error shown (this run already mapped CUDA to kiln)"
    assert report["argv"] == ["--flag"]


def test_exit_status_of_sys_exit_is_kept(tmp_path):
    script = write(tmp_path, "exits.py", "import sys\nprint(sys.argv[1:])\nsys.exit(3)\n")
    result, report = run_audit_json(tmp_path, script, "a", "b")
    assert result.returncode == 3 and result.stdout == "['a', 'b']\n"
    assert [f["message"] for f in report["findings"]] == ["the script exited with status 3"]


# The timeouts leave the child time to start (import torch and kiln: 5 s
# measured on the 2-core machine at load 7) before the loop begins.
def test_script_that_runs_forever_is_ended_and_still_reports(tmp_path):
    script = write(tmp_path, "forever.py", """\
        import torch
        x = torch.ones(3, device="kiln")
        while True:
            x.sum().item()
        """)
    result, report = run_audit_json(tmp_path, "--timeout", "15", script)
    assert result.returncode == 124
    assert report["run"]["timed_out"] and report["run"]["complete"] is False
    assert found(report["findings"]) == {(script, 4, "sync"), (None, None, "run-failure")}
    (sync,) = [f for f in report["findings"] if f["category"] == "sync"]
    assert sync["count"] > 10  # written by the child on SIGTERM, so counts are exact
    assert "timed out after 15.0 s" in result.stderr


def test_script_that_ignores_sigterm_is_killed(tmp_path, monkeypatch):
    script = write(tmp_path, "stubborn.py", """\
        import signal, time, torch
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        torch.ones(1, device="kiln").item()
        while True:
            time.sleep(0.05)
        """)
    monkeypatch.setenv("PYTHONPATH", audit_env()["PYTHONPATH"])  # the child's imports
    result = run_script(script, [], str(tmp_path), map_cuda=False, timeout=12, grace=0.5)
    assert result["run"]["timed_out"] and result["run"]["exit_status"] == 124
    assert result["final"] is None and not result["run"]["complete"]
    # Killed with SIGKILL: the site was streamed to the parent when first seen.
    assert [(e["kind"], e["line"]) for e in result["events"]] == [("sync", 3)]


def test_syntax_error_still_reports_static_findings_and_does_not_run(tmp_path):
    script = write(tmp_path, "broken.py", """\
        import torch
        model = torch.nn.Linear(2, 2).cuda()
        def oops(:
            pass
        """)
    result, report = run_audit_json(tmp_path, script)
    assert result.returncode == 1
    assert report["run"] is None and "syntax error" in report["not_run_reason"]
    assert found(report["findings"]) == {(script, 3, "syntax-error"), (script, 2, "dot-cuda")}


def test_json_document_shape(tmp_path):
    script = write(tmp_path, "small.py", 'import torch\nprint(torch.cuda.is_available())\n')
    result, report = run_audit_json(tmp_path, "--no-run", "--output", str(tmp_path / "r.txt"),
                                    "--html", str(tmp_path / "r.html"), script)
    assert "torch.accelerator.is_available()" in (tmp_path / "r.html").read_text()
    assert result.returncode == 0 and result.stdout == "" and result.stderr == ""
    text = (tmp_path / "r.txt").read_text()
    assert "torch-cuda: torch.cuda API (1)" in text and "not run (--no-run)" in text
    assert set(report) == {"schema", "target", "argv", "run", "not_run_reason", "files_scanned",
                           "summary", "findings"}
    assert report["schema"] == "kiln-audit/1"
    (f,) = report["findings"]
    assert set(f) == {"category", "file", "line", "message", "replacement", "severity",
                      "on_kiln", "effort", "source", "code", "count", "detail"}
    assert (f["category"], f["on_kiln"], f["replacement"]) == (
        "torch-cuda", "silently different", "torch.accelerator.is_available()")
    assert report["summary"]["by_category"] == {"torch-cuda": 1}


def test_a_killed_audit_takes_its_script_with_it(tmp_path):
    """The script runs in its own process group, so only the audit ends it;
    if the audit itself is killed (a test runner's timeout, SIGKILL), the
    child's parent-death signal ends it too (child._die_with_the_audit)."""
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "started"
    script = write(tmp_path, "forever_alone.py", f"""\
        import pathlib, time
        pathlib.Path({str(marker)!r}).write_text("running")
        while True:
            time.sleep(0.05)
        """)
    audit = subprocess.Popen([sys.executable, "-m", "torch_kiln.audit", script],
                             env=audit_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), "the script never started"
        pids = subprocess.run(["pgrep", "-f", f"audit.child.*{script}"], capture_output=True,
                              text=True).stdout.split()
        assert len(pids) == 1, pids
        audit.kill()
        audit.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pids[0]}"):
            state = open(f"/proc/{pids[0]}/stat").read().split()[2]
            if state == "Z":  # reaped by init shortly
                break
            time.sleep(0.1)
        alive = os.path.exists(f"/proc/{pids[0]}") and \
            open(f"/proc/{pids[0]}/stat").read().split()[2] != "Z"
        if alive:
            os.kill(int(pids[0]), signal.SIGKILL)
        assert not alive, "the script outlived the audit"
    finally:
        if audit.poll() is None:
            audit.kill()
