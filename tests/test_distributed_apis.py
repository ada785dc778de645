"""PyTorch's distributed APIs above the process group, on kiln with kccl,
under torchrun (issue 12): torch.distributed.checkpoint of an FSDP2 model
saved by 2 ranks and loaded by 1 (another world size; `make test-full` also
loads it on 4), and functional collectives eagerly and inside
torch.compile. The ranks' code is tests/distributed_apis_worker.py.

Each torchrun job has its own session and a hard timeout (killed as a group
when it overruns); --standalone picks a free port; no kccl shared-memory
segment of an exited process may remain.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from torchrun_job import leftover_kccl_segments, run_job, torchrun_command

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed_apis_worker.py")
TIMEOUT = 300  # seconds per torchrun job


def _torchrun(ranks: int, scenario: str, directory, env=None) -> str:
    env = dict(os.environ if env is None else env, KILN_DEVICE_COUNT=str(max(ranks, 2)))
    code, out = run_job(torchrun_command(ranks, WORKER, scenario, str(directory)), TIMEOUT, env)
    assert code == 0, out[-6000:]
    # Ranks share the pipe: look for the markers anywhere in it.
    ok = sorted(int(r) for r in re.findall(rf"APIS-OK {scenario} (\d+) {ranks}", out))
    assert ok == list(range(ranks)), out[-6000:]
    assert leftover_kccl_segments() == []
    return out


def test_checkpoint_saved_by_2_ranks_loads_on_1(tmp_path):
    _torchrun(2, "dcp-save", tmp_path)
    assert os.path.exists(tmp_path / "checkpoint" / ".metadata")
    _torchrun(1, "dcp-load", tmp_path)


# `make test-full` only (marker `slow`): resharding onto more ranks than
# saved it; the test above already loads on another world size (1).
@pytest.mark.slow
def test_checkpoint_saved_by_2_ranks_loads_on_4(tmp_path):
    _torchrun(2, "dcp-save", tmp_path)
    assert os.path.exists(tmp_path / "checkpoint" / ".metadata")
    _torchrun(4, "dcp-load", tmp_path)


def test_functional_collectives_eager_and_compiled(tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"))
    _torchrun(2, "funcol", tmp_path, env)


# The 4-rank run is in `make test-full` only (marker `slow`); 2 ranks check
# every option, reshard_after_forward=world included.
@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_fsdp2_options_and_clipping(tmp_path, ranks):
    _torchrun(ranks, "fsdp-options", tmp_path)


def test_sequence_parallel(tmp_path):
    _torchrun(2, "sequence-parallel", tmp_path)


def test_reading_a_failed_collectives_output_raises_its_error(tmp_path):
    _torchrun(2, "failed-read", tmp_path)


def test_segments_of_a_killed_creator_are_removed_by_the_next_group(tmp_path):
    # Note [Abandoned kccl segments]: a creator killed before its peers mapped
    # its segment leaves the name behind; the next group made on the host
    # removes it, unless its creator still holds its lock (it is alive).
    import time

    abandoned = "/dev/shm/kccl-999999999-abandonedtest-r0"  # no such process
    with open(abandoned, "wb") as f:
        f.truncate(4096)
    holder = subprocess.Popen(  # a live creator: makes its segment and holds a shared lock
        [sys.executable, "-c", "import fcntl, os, sys\n"
         "path = f'/dev/shm/kccl-{os.getpid()}-alivetest-r0'\n"
         "f = open(path, 'wb'); f.truncate(4096); fcntl.flock(f, fcntl.LOCK_SH)\n"
         "print(path, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    alive = None
    try:
        alive = holder.stdout.readline().strip()
        old = time.time() - 60  # older than the 10 s grace of a segment being made
        for path in (abandoned, alive):
            os.utime(path, (old, old))
        _torchrun(2, "init", tmp_path)
        assert not os.path.exists(abandoned)
        assert os.path.exists(alive)
    finally:
        holder.kill()
        holder.wait()
        for path in (abandoned, alive):
            if path and os.path.exists(path):
                os.unlink(path)
