"""Runs conformance workers in subprocesses, surviving their crashes and hangs.

A kiln bug can crash the interpreter (a segfault, an abort) or hang it (a
task that never completes), which in-process timeouts cannot handle. So
tests run in worker processes (worker.py), each taking every jobs-th op and
module, streaming one event per case. The driver watches them:

- a worker that exits before saying "done" crashed: the case it was running
  fails with the exit status, and a new worker takes over the shard, leaving
  out every test already started;
- a worker silent for `case_timeout` seconds hung: its Python stacks are
  dumped to its log (SIGUSR1), it is killed, the case fails, and the shard
  goes on in a new worker;
- a worker that dies before planning (e.g. the extension being rebuilt
  under it: no torch_kiln._C) is retried after a pause.

Progress goes to stdout: one line per test started, and a line per minute
for a case still running, so a slow or stuck case is visible.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import settings
from outcomes import FAILED, CaseResult

WORKER = settings.HERE / "worker.py"
STARTUP_RETRIES = 5
STARTUP_RETRY_PAUSE_S = 30.0
# Importing torch and instantiating the tests takes a while on a busy machine;
# until a worker has sent its plan it gets at least this long.
STARTUP_TIMEOUT_S = 600.0
HEARTBEAT_S = 60.0


@dataclass
class RunSpec:
    """What to run; shared by all workers (each takes its shard)."""

    ops: list[str] | None          # op keys or names; None: all
    modules: list[str] | None      # module names; None: all; []: none
    passes: list[str]
    quick: bool


@dataclass
class Worker:
    """One worker process and what it has reported."""

    shard: int
    shards: int
    process: subprocess.Popen
    events_fd: int
    log_path: str
    attempt: int
    startup_failures: int = 0
    planned: list[str] = field(default_factory=list)
    started_tests: list[str] = field(default_factory=list)
    current_test: dict = field(default_factory=dict)
    current_case: dict | None = None
    buffer: bytes = b""
    last_event: float = field(default_factory=time.monotonic)
    last_heartbeat: float = field(default_factory=time.monotonic)
    done: bool = False


class Driver:
    """Starts the workers and turns their events into CaseResults."""

    def __init__(self, spec: RunSpec, *, jobs: int, case_timeout: float, log_dir: str,
                 on_result: Callable[[CaseResult], None], echo: Callable[[str], None] = print):
        self.spec, self.jobs, self.case_timeout = spec, jobs, case_timeout
        self.log_dir = log_dir
        self.on_result, self.echo = on_result, echo
        self.selector = selectors.DefaultSelector()
        self.left_out: dict[int, list[str]] = {i: [] for i in range(jobs)}
        self.plan_sizes: dict[int, int] = {}
        self.tests_started = 0
        self.start = time.monotonic()
        self.harness_errors: list[str] = []

    # ------------------------------------------------------------ processes

    def _spawn(self, shard: int, attempt: int, startup_failures: int = 0) -> Worker:
        spec = {"ops": self.spec.ops, "modules": self.spec.modules, "passes": self.spec.passes,
                "quick": self.spec.quick, "shard": shard, "shards": self.jobs,
                "leave_out": self.left_out[shard]}
        spec_file = tempfile.NamedTemporaryFile("w", suffix=".json", dir=self.log_dir,
                                                prefix=f"spec-{shard}-", delete=False)
        with spec_file:
            json.dump(spec, spec_file)
        read_fd, write_fd = os.pipe()
        log_path = os.path.join(self.log_dir, f"worker-{shard}-{attempt}.log")
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                [sys.executable, str(WORKER), spec_file.name, str(write_fd)],
                pass_fds=(write_fd,), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=str(settings.HERE))
        os.close(write_fd)
        os.set_blocking(read_fd, False)
        worker = Worker(shard, self.jobs, process, read_fd, log_path, attempt, startup_failures)
        self.selector.register(read_fd, selectors.EVENT_READ, worker)
        return worker

    def _retire(self, worker: Worker) -> None:
        self.selector.unregister(worker.events_fd)
        os.close(worker.events_fd)
        if worker.process.poll() is None:
            worker.process.kill()
        worker.process.wait()

    # ------------------------------------------------------------ events

    def _handle(self, worker: Worker, event: dict) -> None:
        worker.last_event = worker.last_heartbeat = time.monotonic()
        kind = event.pop("e")
        if kind == "plan":
            worker.planned = event["tests"]
            self.plan_sizes[worker.shard] = (len(self.left_out[worker.shard])
                                             + len(worker.planned))
        elif kind == "test":
            worker.started_tests.append(event["method"])
            self.left_out[worker.shard].append(event["method"])
            worker.current_test, worker.current_case = event, None
            self.tests_started += 1
            total = sum(self.plan_sizes.values())
            self.echo(f"[{time.monotonic() - self.start:8.1f}s] {self.tests_started}/{total} "
                      f"w{worker.shard} {event['key']} {event['dtype']}")
        elif kind == "begin":
            worker.current_case = event
        elif kind == "case":
            worker.current_case = None
            self.on_result(CaseResult.from_json(event))
        elif kind == "done":
            worker.done = True

    def _read(self, worker: Worker) -> bool:
        """Reads what the worker sent; False at end of stream."""
        try:
            chunk = os.read(worker.events_fd, 1 << 16)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        worker.buffer += chunk
        *lines, worker.buffer = worker.buffer.split(b"\n")
        for line in lines:
            if line.strip():
                self._handle(worker, json.loads(line))
        return True

    def _fail_current(self, worker: Worker, why: str) -> None:
        case, test = worker.current_case, worker.current_test
        if case:
            result = CaseResult(case["op"], case["dtype"], case["pass"], case["i"], FAILED, why)
        elif test:
            result = CaseResult(test["key"], test["dtype"], "forward", -1, FAILED,
                                f"{why} (between cases)")
        else:
            self.harness_errors.append(f"shard {worker.shard}: {why} before any test")
            return
        self.echo(f"  w{worker.shard} {result.op} {result.dtype} {result.pass_name} "
                  f"#{result.index}: {why}")
        self.on_result(result)

    # ------------------------------------------------------------ main loop

    def run(self) -> None:
        """Runs every shard to completion."""
        os.makedirs(self.log_dir, exist_ok=True)
        live = {shard: self._spawn(shard, 0) for shard in range(self.jobs)}
        while live:
            for key, _ in self.selector.select(timeout=1.0):
                worker: Worker = key.data
                if not self._read(worker):
                    self._finish(worker, live)
            now = time.monotonic()
            for worker in list(live.values()):
                self._watch(worker, now, live)

    def _watch(self, worker: Worker, now: float, live: dict[int, Worker]) -> None:
        silent = now - worker.last_event
        timeout = self.case_timeout if worker.planned else max(self.case_timeout,
                                                                STARTUP_TIMEOUT_S)
        if silent > timeout:
            self.echo(f"  w{worker.shard} silent for {silent:.0f} s: dumping its stacks to "
                      f"{worker.log_path} and killing it")
            worker.process.send_signal(signal.SIGUSR1)
            time.sleep(2.0)
            self._fail_current(worker, f"hung: no progress for {timeout:.0f} s "
                                       f"(stacks in the worker log)")
            self._retire(worker)
            self._restart(worker, live)
        elif now - worker.last_heartbeat > HEARTBEAT_S:
            worker.last_heartbeat = now
            where = worker.current_case or worker.current_test
            self.echo(f"  w{worker.shard} still running {json.dumps(where)} ({silent:.0f} s)")

    def _finish(self, worker: Worker, live: dict[int, Worker]) -> None:
        self._retire(worker)
        if worker.done:
            del live[worker.shard]
            return
        code = worker.process.returncode
        why = (f"worker killed by signal {-code} ({signal.Signals(-code).name})" if code < 0
               else f"worker exited with status {code}")
        if not worker.planned:
            worker.startup_failures += 1
            if worker.startup_failures >= STARTUP_RETRIES:
                self.harness_errors.append(f"shard {worker.shard}: {why} before planning, "
                                           f"{STARTUP_RETRIES} times; see {worker.log_path}")
                del live[worker.shard]
                return
            self.echo(f"  w{worker.shard} {why} while starting (see {worker.log_path}); "
                      f"retrying in {STARTUP_RETRY_PAUSE_S:.0f} s")
            time.sleep(STARTUP_RETRY_PAUSE_S)
        else:
            self._fail_current(worker, f"{why} in this case (see {worker.log_path})")
        self._restart(worker, live)

    def _restart(self, worker: Worker, live: dict[int, Worker]) -> None:
        remaining = [t for t in worker.planned if t not in set(worker.started_tests)]
        if worker.planned and not remaining:
            del live[worker.shard]
            return
        startup_failures = 0 if worker.planned else worker.startup_failures
        live[worker.shard] = self._spawn(worker.shard, worker.attempt + 1, startup_failures)
