"""Processes: a child forked after kiln was initialised gets a clear error
on first kiln use (as CUDA does); the spawn start method works."""

import torch
import torch.multiprocessing as mp

from conftest import run_python


def test_forked_child_is_told_to_use_spawn():
    code = (
        "import os, torch\n"
        "x = torch.ones(3, device='kiln') * 2\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    try:\n"
        "        torch.ones(3, device='kiln')\n"
        "        os._exit(3)\n"
        "    except RuntimeError as e:\n"
        "        os._exit(0 if 'spawn' in str(e) and 'forked' in str(e) else 4)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(status), x.sum().item())\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "6.0"]


def _child_sum(rank, out):
    out[rank] = torch.arange(4.0, device="kiln").sum().item()


def test_spawn_start_method_works():
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    out = manager.dict()
    mp.spawn(_child_sum, args=(out,), nprocs=2, join=True)
    assert dict(out) == {0: 6.0, 1: 6.0}
