"""Runs a command (a torchrun job, or one script) for the multi-process
tests: in its own session, with a hard timeout after which the whole process
group is killed and the test fails with the output's tail. `--standalone`
torchrun jobs pick a free port themselves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest


def torchrun_command(ranks: int, script: str, *args: str) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node=ranks script args``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={ranks}", script, *args]


def run_job(command: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    """(exit status, stdout and stderr together) of ``command``; fails the
    test if it runs longer than ``timeout`` seconds (its group is killed)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(command)} did not finish within {timeout} s\n{out[-4000:]}")
    return proc.returncode, out


def leftover_kccl_segments() -> list[str]:
    """kccl shared-memory segments in /dev/shm whose creating process is gone."""
    return [n for n in os.listdir("/dev/shm")
            if n.startswith("kccl-") and not os.path.exists(f"/proc/{n.split('-')[1]}")]
