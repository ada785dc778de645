"""The audit's child process: runs the user's script under the tracer.

Started by :mod:`torch_kiln.audit.runner` as ``python -m
torch_kiln.audit.child --events PATH --root DIR [--map-cuda] -- script.py
[args]``; not a public interface.

Note [Audit child protocol]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The user's script runs in its own process so that a hang, a crash or
``os._exit`` cannot take the audit down. The script sees what ``python
script.py args`` would give it: ``sys.argv``, ``sys.path[0]`` = the
script's directory, ``__name__ == "__main__"``, the parent's stdin, stdout
and stderr (its output passes through unchanged and unbuffered by the
audit), and its exit status (``sys.exit(n)``, 1 for an uncaught exception,
as Python reports them) is the child's.

Results travel in one file, ``--events PATH``, of JSON lines, each flushed
when written: one event the first time a site is seen (so a child killed
with SIGKILL still reports where it synchronized or failed), and a last line
``{"kind": "final", ...}`` with every site and its count, the exit status,
kiln's sync-op totals and the compile metrics. On SIGTERM (the parent's
timeout) the child writes that final line, marked ``"terminated": true``,
and exits with status 143 at once, without running the script's cleanup.
Processes the script forks inherit the tracer but write nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import signal
import sys
import traceback


def _exit_status(code) -> int:
    """Python's own mapping of ``SystemExit.code`` to a process status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _print_user_traceback(error: BaseException, script: str) -> None:
    """The traceback Python would print: from the script's first frame on,
    without the audit's own frames (its TorchFunctionMode sits between the
    program and torch), chained exceptions included."""
    audit_dir = os.path.dirname(os.path.realpath(__file__))
    tb = error.__traceback__
    while tb is not None and os.path.realpath(tb.tb_frame.f_code.co_filename) != script:
        tb = tb.tb_next
    report = traceback.TracebackException(type(error), error, tb or error.__traceback__)
    seen = set()
    pending = [report]
    while pending:
        exc = pending.pop()
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        exc.stack = traceback.StackSummary.from_list(
            [f for f in exc.stack if not os.path.realpath(f.filename).startswith(audit_dir)])
        pending += [e for e in (exc.__cause__, exc.__context__) if e is not None]
    sys.stderr.write("".join(report.format()))


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_the_audit(audit_pid: int) -> None:
    """The child runs in its own process group so the audit can end it and
    everything it started; if the audit itself is killed (SIGKILL, a test
    runner's timeout) nobody would, and a script that runs forever would
    run on. Linux's parent-death signal kills the child when the audit
    dies; a child whose audit is already gone exits at once."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != audit_pid:
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    _die_with_the_audit(int(os.environ.get("KILN_AUDIT_PARENT_PID", os.getppid())))
    parser = argparse.ArgumentParser(prog="torch_kiln.audit.child")
    parser.add_argument("--events", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--map-cuda", action="store_true")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args(argv)
    script = os.path.realpath(opts.script)

    events = open(opts.events, "a", buffering=1, encoding="utf-8")
    pid = os.getpid()

    def emit(event: dict) -> None:
        if os.getpid() != pid:
            return  # a process the script forked (DataLoader workers): not the run's results
        events.write(json.dumps(event, default=str) + "\n")
        events.flush()

    import torch  # noqa: F401  (loads kiln through the torch.backends entry point)
    import torch_kiln  # noqa: F401  (and with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
    from torch_kiln.audit.tracer import RunTracer

    tracer = RunTracer(opts.root, map_cuda=opts.map_cuda, on_event=emit)

    def final(status: int | None, **extra) -> None:
        from torch_kiln.compiler.metrics import get_metrics

        emit({"kind": "final", "exit_status": status, "events": tracer.events(),
              "unattributed_syncs": tracer.unattributed_syncs(),
              "sync_ops": torch.kiln.get_sync_ops(), "compile": get_metrics(), **extra})

    def on_sigterm(signum, frame) -> None:
        if os.getpid() != pid:  # a forked process of the script: die as it would have
            os._exit(128 + signal.SIGTERM)
        try:
            final(None, terminated=True)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)

    sys.argv = [opts.script, *opts.args]
    sys.path[0] = os.path.dirname(script)
    status = 0
    with tracer:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as error:
            status = _exit_status(error.code)
        except BaseException as error:  # the script's uncaught exception, KeyboardInterrupt too
            _print_user_traceback(error, script)
            status = 130 if isinstance(error, KeyboardInterrupt) else 1
            file = line = None
            for frame, lineno in traceback.walk_tb(error.__traceback__):
                if tracer._is_user_file(frame.f_code.co_filename):
                    file, line = os.path.realpath(frame.f_code.co_filename), lineno
            text = str(error).strip().splitlines()
            message = f"{type(error).__name__}: {text[0] if text else ''}".strip().rstrip(":")
            failure = {"kind": "run-failure", "file": file, "line": line,
                       "key": type(error).__name__,
                       "message": f"the script raised {message[:300]}"}
            if opts.map_cuda:  # the category's advice is to run with --map-cuda
                failure["replacement"] = "fix the error shown (this run already mapped CUDA to kiln)"
            tracer.record_event(failure)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    final(status)
    events.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
