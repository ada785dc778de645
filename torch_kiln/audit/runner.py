"""The audit's parent side of a run: start the user's script in a child
process, enforce the timeout, collect the child's events.

See Note [Audit child protocol] in :mod:`torch_kiln.audit.child`. The child
gets its own process group, so a timeout (or the audit's own interruption)
ends the script and everything it started — DataLoader workers, shells —
and nothing else: SIGTERM to the group first (the child then writes its
final results), SIGKILL after :data:`GRACE_SECONDS` if it is still there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["run_script", "GRACE_SECONDS", "TIMEOUT_STATUS"]

GRACE_SECONDS = 5.0
# The audit's exit status after a timeout, as timeout(1) reports one.
TIMEOUT_STATUS = 124


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _end(proc: subprocess.Popen, first: int = signal.SIGTERM,
         grace: float = GRACE_SECONDS) -> None:
    """Ends the child's process group: ``first``, then SIGKILL after ``grace`` s."""
    _signal_group(proc, first)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
    # Whatever the child started and left behind in its group goes too.
    _signal_group(proc, signal.SIGKILL)


def _read_events(path: str) -> tuple[list[dict], dict | None]:
    events: list[dict] = []
    final = None
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by SIGKILL
                if event.get("kind") == "final":
                    final = event
                else:
                    events.append(event)
    except FileNotFoundError:
        pass
    return events, final


def run_script(script: str, args: list[str], root: str, map_cuda: bool,
               timeout: float | None = None,
               grace: float = GRACE_SECONDS) -> dict[str, Any]:
    """Runs ``script args`` in a child process under the tracer.

    Returns ``{"run": {...}, "events": [...], "final": {...} | None}``:
    ``run`` is the report's run record (``exit_status``, ``timed_out``,
    ``signal``, ``seconds``, ``map_cuda``, and ``complete``: whether the
    child wrote its final results); ``events`` the run-time sites, with
    exact counts if ``complete``, else each site once. ``timeout`` is in
    seconds (``None``: no limit); after it the child's process group is sent
    SIGTERM, then SIGKILL ``grace`` seconds later, and ``exit_status`` is
    :data:`TIMEOUT_STATUS`.
    """
    fd, events_path = tempfile.mkstemp(prefix="kiln-audit-", suffix=".jsonl")
    os.close(fd)
    command = [sys.executable, "-m", "torch_kiln.audit.child", "--events", events_path,
               "--root", root]
    if map_cuda:
        command.append("--map-cuda")
    command += ["--", script, *args]
    timed_out = False
    interrupted = False
    start = time.monotonic()
    # The child dies with this process too (child._die_with_the_audit).
    env = dict(os.environ, KILN_AUDIT_PARENT_PID=str(os.getpid()))
    proc = subprocess.Popen(command, start_new_session=True, env=env)
    try:
        try:
            status = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _end(proc, signal.SIGTERM, grace)
            status = proc.returncode
        except KeyboardInterrupt:
            interrupted = True
            _end(proc, signal.SIGINT, grace)
            status = proc.returncode
        seconds = time.monotonic() - start
        events, final = _read_events(events_path)
    finally:
        if proc.poll() is None:
            _end(proc, signal.SIGKILL)
        os.unlink(events_path)
    died_of = None
    if status is not None and status < 0:
        died_of = signal.Signals(-status).name
    if timed_out:
        exit_status = TIMEOUT_STATUS
    elif final is not None and final.get("exit_status") is not None:
        exit_status = final["exit_status"]
    elif status is not None and status < 0:
        exit_status = 128 - status
    else:
        exit_status = status
    run = {"exit_status": exit_status, "timed_out": timed_out, "timeout": timeout,
           "interrupted": interrupted, "signal": None if timed_out else died_of,
           "seconds": round(seconds, 3), "map_cuda": map_cuda,
           "complete": final is not None and not final.get("terminated", False)}
    if final is not None:
        events = final["events"]
        run["sync_ops"] = final.get("sync_ops", {})
        run["unattributed_syncs"] = final.get("unattributed_syncs", 0)
        run["compile"] = final.get("compile", {})
    return {"run": run, "events": events, "final": final}
