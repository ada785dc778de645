"""A pool of kccl worker ranks for the distributed tests (tests/kccl_worker.py,
one process per rank on kiln:RANK, each with an initialised default process
group), driven by scenarios sent over stdin.

Every command has a hard timeout (COMMAND_TIMEOUT seconds): on expiry the
pool is killed (SIGKILL to each rank's session) and the test fails with each
rank's stderr. `kccl_segments()` lists kccl's shared-memory segments in
/dev/shm (the tests check that none is left).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kccl_worker.py")
COMMAND_TIMEOUT = 120.0  # seconds, per scenario


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kccl_segments(pids=None) -> list[str]:
    names = [n for n in os.listdir("/dev/shm") if n.startswith("kccl-")]
    if pids is not None:
        names = [n for n in names if int(n.split("-")[1]) in pids]
    return names


class RankPool:
    """`world` worker processes with an initialised default process group."""

    def __init__(self, world: int, backend: str | None = None, env: dict | None = None,
                 rank_env=None):
        """`rank_env(rank)` gives extra environment variables of one rank."""
        self.world = world
        port = free_port()
        self.procs = []
        self.logs = []
        for rank in range(world):
            log = tempfile.TemporaryFile(mode="w+")
            e = dict(os.environ)
            e.update(
                RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                KILN_DEVICE_COUNT=str(max(2, world)), KCCL_TEST_BACKEND=backend or "",
                OMP_NUM_THREADS="1",
            )
            e.update(env or {})
            e.update(rank_env(rank) if rank_env else {})
            proc = subprocess.Popen(
                [sys.executable, "-u", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=log, env=e, text=True, start_new_session=True,
            )
            self.procs.append(proc)
            self.logs.append(log)
        self.pids = {p.pid for p in self.procs}
        self._collect("start-up")

    def _stderr(self) -> str:
        out = []
        for rank, log in enumerate(self.logs):
            log.seek(0)
            out.append(f"--- rank {rank} stderr ---\n{log.read()[-4000:]}")
        return "\n".join(out)

    def _collect(self, what: str) -> list:
        deadline = time.monotonic() + COMMAND_TIMEOUT
        replies: dict[int, dict] = {}
        sel = selectors.DefaultSelector()
        for rank, p in enumerate(self.procs):
            sel.register(p.stdout, selectors.EVENT_READ, rank)
        try:
            while len(replies) < self.world:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.kill()
                    pytest.fail(f"{what}: no answer within {COMMAND_TIMEOUT} s; pool killed\n{self._stderr()}")
                for key, _ in sel.select(timeout=min(left, 1.0)):
                    rank = key.data
                    line = key.fileobj.readline()
                    if line == "":
                        self.kill()
                        pytest.fail(f"{what}: rank {rank} exited (code {self.procs[rank].poll()})\n{self._stderr()}")
                    if line.startswith("KCCL-RESULT "):
                        replies[rank] = json.loads(line[len("KCCL-RESULT "):])
                        sel.unregister(key.fileobj)
        finally:
            sel.close()
        failures = [f"rank {r}:\n{rep['error']}" for r, rep in sorted(replies.items()) if not rep["ok"]]
        if failures:
            pytest.fail(f"{what} failed\n" + "\n".join(failures))
        return [replies[r]["result"] for r in range(self.world)]

    def run(self, scenario: str, **args) -> list:
        """Runs `scenario` on every rank; returns the ranks' results."""
        for p in self.procs:
            p.stdin.write(json.dumps({"scenario": scenario, "args": args}) + "\n")
            p.stdin.flush()
        return self._collect(scenario)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.wait()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.stdin.write(json.dumps({"scenario": "exit"}) + "\n")
                    p.stdin.flush()
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + 30
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        for log in self.logs:
            log.close()


def serve(pool: RankPool):
    """The body of a pool fixture (`yield from serve(RankPool(...))`): yields
    the pool, then closes it and checks that it left no kccl segment."""
    yield pool
    pool.close()
    assert kccl_segments(pool.pids) == [], "kccl segments left in /dev/shm"


def check_no_segments(request, fixture_names) -> None:
    """After a test: the pools among `fixture_names` that the test used hold no
    kccl segment in /dev/shm (segments are unlinked once all ranks mapped them)."""
    for name in fixture_names:
        if name in request.fixturenames:
            pool = request.getfixturevalue(name)
            assert kccl_segments(pool.pids) == [], "kccl segments left in /dev/shm"
