"""PyTorch's distributed APIs above the process group, on kiln with kccl,
under torchrun (issue 12): torch.distributed.checkpoint of an FSDP2 model
saved by 2 ranks and loaded by 4 and by 1 (another world size), and
functional collectives eagerly and inside torch.compile. The ranks' code is
tests/distributed_apis_worker.py.

Each torchrun job has its own session and a hard timeout (killed as a group
when it overruns); --standalone picks a free port; no kccl shared-memory
segment of an exited process may remain.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed_apis_worker.py")
TIMEOUT = 300  # seconds per torchrun job


def _torchrun(ranks: int, scenario: str, directory, env=None) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}", WORKER, scenario, str(directory)]
    env = dict(os.environ if env is None else env, KILN_DEVICE_COUNT=str(max(ranks, 2)))
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun {scenario} did not finish within {TIMEOUT} s\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    # Ranks share the pipe: look for the markers anywhere in it.
    ok = sorted(int(r) for r in re.findall(rf"APIS-OK {scenario} (\d+) {ranks}", out))
    assert ok == list(range(ranks)), out[-6000:]
    leftovers = [n for n in os.listdir("/dev/shm")
                 if n.startswith("kccl-") and not os.path.exists(f"/proc/{n.split('-')[1]}")]
    assert leftovers == []
    return out


def test_checkpoint_saved_by_2_ranks_loads_on_4_and_on_1(tmp_path):
    _torchrun(2, "dcp-save", tmp_path)
    assert os.path.exists(tmp_path / "checkpoint" / ".metadata")
    _torchrun(4, "dcp-load", tmp_path)
    _torchrun(1, "dcp-load", tmp_path)


def test_functional_collectives_eager_and_compiled(tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"))
    _torchrun(2, "funcol", tmp_path, env)


@pytest.mark.parametrize("ranks", [2, 4])
def test_fsdp2_options_and_clipping(tmp_path, ranks):
    _torchrun(ranks, "fsdp-options", tmp_path)


def test_sequence_parallel(tmp_path):
    _torchrun(2, "sequence-parallel", tmp_path)


def test_reading_a_failed_collectives_output_raises_its_error(tmp_path):
    _torchrun(2, "failed-read", tmp_path)
