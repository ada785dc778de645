"""The audit's two entry points: :func:`audit_script` (what the command
runs) and :func:`audit` (a Python callable, in this process)."""

from __future__ import annotations

import inspect
import os
import time
import traceback
from typing import Any, Callable

from torch_kiln.audit import catalog
from torch_kiln.audit.findings import Finding, Report
from torch_kiln.audit.static import scan_program

__all__ = ["audit", "audit_script", "AuditError"]


class AuditError(Exception):
    """The audit could not start (e.g. the script does not exist)."""


def _run_failure(message: str, file: str | None = None, line: int | None = None) -> Finding:
    cat = catalog.category("run-failure")
    return Finding(category="run-failure", file=file, line=line, message=message,
                   replacement=cat.replacement, severity=cat.severity, on_kiln=cat.on_kiln,
                   effort=cat.effort, source="runtime")


def audit_script(script: str, args: list[str] | None = None, *, map_cuda: bool = False,
                 timeout: float | None = None, run: bool = True,
                 root: str | None = None) -> Report:
    """Audits ``python script args``: static findings for the script and the
    modules it imports from ``root`` (default: the script's directory), then,
    if ``run``, run-time findings from running it on kiln in a child process
    (``map_cuda``: CUDA devices and calls resolve to kiln; ``timeout``:
    seconds before the run is ended, ``None`` for no limit).

    The run's outcome is ``report.run``; a script that raised, exited with
    a non-zero status, died of a signal or timed out also yields a
    ``run-failure`` finding. A script that does not parse is not run.
    Raises :class:`AuditError` if ``script`` is not a file.
    """
    args = list(args or [])
    if not os.path.isfile(script):
        what = "a directory" if os.path.isdir(script) else "no such file"
        raise AuditError(f"cannot audit {script!r}: {what}; expected a Python script "
                         "(python -m torch_kiln.audit [options] script.py [args])")
    if timeout is not None and timeout <= 0:
        raise AuditError(f"timeout must be a positive number of seconds; got {timeout}")
    script_path = os.path.realpath(script)
    root = os.path.realpath(root or os.path.dirname(script_path))
    findings, scanned = scan_program(script_path, root)
    report = Report(target=script_path, argv=args, findings=findings, files_scanned=scanned)
    unparsable = any(f.category == "syntax-error" and f.file == script_path for f in findings)
    if not run:
        report.not_run_reason = "--no-run"
        return report
    if unparsable:
        report.not_run_reason = "the script has a syntax error"
        report.run = None
        return report

    from torch_kiln.audit.runner import run_script
    from torch_kiln.audit.tracer import events_to_findings

    result = run_script(script_path, args, root, map_cuda, timeout)
    report.run = result["run"]
    report.findings.extend(events_to_findings(result["events"]))
    run_info = report.run
    raised = any(f.category == "run-failure" for f in report.findings)
    if run_info["timed_out"]:
        report.findings.append(_run_failure(
            f"the run did not finish within --timeout {timeout} s and was ended"
            + ("" if run_info["complete"] else "; counts are lower bounds")))
    elif run_info["signal"]:
        report.findings.append(_run_failure(f"the interpreter died of {run_info['signal']}"))
    elif run_info["exit_status"] not in (0, None) and not raised:
        report.findings.append(_run_failure(
            f"the script exited with status {run_info['exit_status']}"))
    return report


def audit(fn: Callable, *args: Any, map_cuda: bool = False, root: str | None = None,
          **kwargs: Any) -> Report:
    """Audits ``fn(*args, **kwargs)`` in this process: static findings for the
    file defining ``fn`` and the modules it imports from ``root`` (default:
    that file's directory), and run-time findings from the call. The call's
    return value is ``report.result``; an exception it raises is recorded as
    a ``run-failure`` finding (and in ``report.error``), not re-raised.

    No timeout and no process isolation: use :func:`audit_script` (the
    command) for programs that may hang or crash. Raises ``TypeError`` if
    ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"audit() needs a callable; got {type(fn).__name__}")
    from torch_kiln.audit.tracer import RunTracer, events_to_findings

    try:
        source = inspect.getsourcefile(inspect.unwrap(fn))
    except TypeError:
        source = None
    source = os.path.realpath(source) if source else None
    root = os.path.realpath(root or (os.path.dirname(source) if source else os.getcwd()))
    findings, scanned = scan_program(source, root) if source else ([], [])
    report = Report(target=source or repr(fn), argv=[], findings=findings, files_scanned=scanned)
    tracer = RunTracer(root, map_cuda=map_cuda)
    start = time.monotonic()
    with tracer:
        try:
            report.result = fn(*args, **kwargs)
        except Exception as error:  # recorded, not re-raised (docstring)
            report.error = error
            file = line = None
            for frame, lineno in traceback.walk_tb(error.__traceback__):
                if tracer._is_user_file(frame.f_code.co_filename):
                    file, line = os.path.realpath(frame.f_code.co_filename), lineno
            report.findings.append(_run_failure(
                f"the call raised {type(error).__name__}: {str(error).strip()[:300]}", file, line))
    report.findings.extend(events_to_findings(tracer.events()))
    report.run = {"exit_status": None if report.error else 0, "timed_out": False,
                  "signal": None, "seconds": round(time.monotonic() - start, 3),
                  "map_cuda": map_cuda, "complete": True, "in_process": True}
    return report
