"""torch.distributed on kiln: the kccl backend (issue 12, first increment).

Each test module run starts one pool of worker ranks per world size
(tests/kccl_worker.py, one process per rank on kiln:RANK) and sends them
scenarios; every scenario checks its results against the same computation
on the CPU inside each rank. Every command has a hard timeout: on expiry the
pool is killed and the test fails with each rank's stderr. After every test,
/dev/shm must hold no kccl segment of a worker (segments are unlinked as soon
as all ranks have mapped them), and none may be left when the pool is gone.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch

from kccl_pool import COMMAND_TIMEOUT, RankPool, check_no_segments, kccl_segments, serve
from torchrun_job import leftover_kccl_segments, run_job, torchrun_command

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)


@pytest.fixture(scope="module")
def pool2():
    # A small slot makes the larger tensors below run in many steps.
    yield from serve(RankPool(2, env={"KCCL_SHM_SLOT_BYTES": str(64 * 1024)}))


@pytest.fixture(scope="module")
def pool3():
    yield from serve(RankPool(3, backend="cpu:gloo,kiln:kccl"))


@pytest.fixture(autouse=True)
def no_leftover_segments(request):
    yield
    check_no_segments(request, ("pool2", "pool3"))


def test_backend_selection(pool2):
    infos = pool2.run("backend_info")
    for rank, info in enumerate(infos):
        # init_process_group() without backend: PyTorch names the group's
        # backend "undefined" and makes the accelerator's default, kccl.
        assert info["backend"] == "undefined"
        assert info["default_for_kiln"] == "kccl"
        assert info["rank"] == rank and info["world"] == 2
        assert info["device"] == f"kiln:{rank}"


def test_segments_unlinked_after_setup(pool2):
    assert pool2.run("shm_names") == [[], []]


def test_all_reduce_every_op_and_dtype(pool2):
    counts = pool2.run("all_reduce_ops")
    assert counts[0] == counts[1] > 50


def test_collectives(pool2):
    pool2.run("collectives")


def test_chunked_large_tensors(pool2):
    # 64 KiB slots: 40_000 float32 elements are 3 steps, 160 KB.
    pool2.run("chunked", numel=40_000)


def test_noncontiguous_and_empty(pool2):
    pool2.run("noncontiguous")


def test_async_op_streams_and_record_stream(pool2):
    pool2.run("async")


def test_other_device(pool2):
    # rank 0 on kiln:1 and rank 1 on kiln:0, with the same process group.
    assert pool2.run("other_device", device=1) == ["kiln:1", "kiln:1"]
    assert pool2.run("other_device", device=0) == ["kiln:0", "kiln:0"]


def test_bad_arguments(pool2):
    pool2.run("errors")


def test_other_backend_strings_and_groups(pool2):
    out = pool2.run("groups")
    assert out[0] == {"kccl": "kccl", "cpu:gloo,kiln:kccl": "cpu:gloo,kiln:kccl"}


def test_destroy_process_group_shuts_the_backend_down(pool2):
    messages = pool2.run("shutdown")
    assert all("was shut down" in m for m in messages), messages


def test_rank_that_never_arrives_times_out(pool2):
    start = time.monotonic()
    out = pool2.run("timeout", seconds=3)
    assert time.monotonic() - start < 60
    assert 2.5 < out[0]["seconds"] < 30, out[0]


def test_rank_that_never_creates_the_group_times_out_at_the_groups_timeout(tmp_path):
    """kccl's host-identity exchange read the Store with a plain get, which
    waits for the Store's own timeout (5 minutes for a FileStore) whatever
    the group's: a rank whose peer never called init_process_group waited
    that long (found by a fresh user; Gloo fails at the group's timeout)."""
    from conftest import run_python

    code = f"""
import datetime, time, torch, torch_kiln, torch.distributed as dist
start = time.monotonic()
try:
    dist.init_process_group("kccl", store=dist.FileStore({str(tmp_path / "store")!r}, 2), rank=0,
                            world_size=2, timeout=datetime.timedelta(seconds=2))
except dist.DistBackendError as error:
    print(round(time.monotonic() - start), error)
"""
    result = run_python(code, {"KILN_DEVICE_COUNT": "2"}, timeout=90)
    assert result.returncode == 0, result.stderr
    seconds, message = result.stdout.split(" ", 1)
    assert 1 <= int(seconds) < 30, result.stdout
    assert "ranks [1] did not join within 2000 ms (the process group's timeout)" in message


def test_different_slot_sizes_fail_clearly_on_every_rank(tmp_path):
    """Ranks with different KCCL_SHM_SLOT_BYTES: each raises an error naming
    both sizes and the variable. Before, the rank that found the mismatch
    unlinked its segment and its peer failed with "shm_open ... No such file
    or directory"."""
    from concurrent.futures import ThreadPoolExecutor

    from conftest import run_python

    code = """
import datetime, torch, torch_kiln, torch.distributed as dist
try:
    dist.init_process_group("kccl", store=dist.FileStore({store!r}, 2), rank={rank}, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
except dist.DistBackendError as error:
    print(error)
"""
    slots = ("65536", "131072")

    def rank(r):
        return run_python(code.format(store=str(tmp_path / "store"), rank=r),
                          {"KILN_DEVICE_COUNT": "2", "KCCL_SHM_SLOT_BYTES": slots[r]}, timeout=120)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(rank, (0, 1)))
    for r, result in enumerate(results):
        assert result.returncode == 0, result.stderr[-3000:]
        assert (f"kccl: rank {1 - r} uses shared-memory slots of {slots[1 - r]} bytes and rank {r} "
                f"of {slots[r]} bytes: set KCCL_SHM_SLOT_BYTES to the same value on every rank"
                in result.stdout), result.stdout
    assert not leftover_kccl_segments()


def test_rank_arriving_after_a_peer_timed_out_fails_too(pool2):
    messages = pool2.run("late_rank", seconds=2)
    assert "did not arrive" in messages[0], messages
    assert "rank 0 gave up on this process group" in messages[1], messages


def test_input_from_a_failed_kernel(pool2):
    texts = pool2.run("failed_input", seconds=3)
    assert "index out of range" in texts[0], texts[0]


def test_mismatched_sizes_raise(pool2):
    texts = pool2.run("mismatch", seconds=5)
    assert all("mismatched collectives" in t for t in texts)


def test_gather_scatter_all_to_all(pool2):
    texts = pool2.run("gather_scatter_alltoall")
    assert all("rank 0 sends 4 elements to rank 0, which expects 2" in t for t in texts)
    # 64 KiB slots: pieces of 3_000 x 2 float32 need several steps.
    pool2.run("gather_scatter_alltoall", rows=3000)


def test_send_recv(pool2):
    pool2.run("p2p")
    # 64 KiB slots give 32 KiB per pair: 20_000 float32 elements are 3 chunks.
    pool2.run("p2p", numel=20_000)


def test_send_recv_errors(pool2):
    out = pool2.run("p2p_errors", seconds=3)
    assert "mismatch" in out[1] and "timeout" in out[1]


def test_coalesced_collectives(pool2):
    pool2.run("coalesced")


def test_dtensor_and_fsdp2(pool2):
    pool2.run("dtensor_fsdp")


def test_ddp_matches_one_process(pool2):
    # Several gradient buckets; parameters compared with one process training
    # on the global batch (DDP averages as grad / world then sums).
    pool2.run("ddp")
    pool2.run("ddp", no_sync=True, steps=6)
    pool2.run("ddp", hook="fp16", rtol=1e-2)


def test_three_ranks(pool3):
    infos = pool3.run("backend_info")
    assert [i["device"] for i in infos] == ["kiln:0", "kiln:1", "kiln:2"]
    pool3.run("all_reduce_ops", dtypes=["float32", "bfloat16", "float16", "int64", "bool"])
    pool3.run("collectives")
    pool3.run("groups")
    pool3.run("ddp")
    pool3.run("p2p")
    pool3.run("gather_scatter_alltoall")
    pool3.run("coalesced")
    pool3.run("dtensor_fsdp")


@pytest.mark.parametrize("pool", ["pool2", "pool3"])
def test_monitored_barrier_names_the_ranks_that_did_not_arrive(request, pool):
    # pool2: kccl alone; pool3: "cpu:gloo,kiln:kccl" (kccl's barrier too).
    results = request.getfixturevalue(pool).run("monitored_barrier")
    assert "failed to pass monitoredBarrier" in results[0][0], results[0]


def test_device_id_split_group_and_killed_ranks_leak_nothing():
    # init_process_group(device_id=kiln:RANK) picks kccl from the device type.
    pool = RankPool(3, env={"KCCL_TEST_DEVICE_ID": "1"})
    try:
        infos = pool.run("backend_info")
        assert [i["backend"] for i in infos] == ["kccl"] * 3
        pool.run("other_device", device=0)
        # split_group and DeviceMesh on the bound default group.
        for texts in pool.run("split_group"):
            assert "duplicate" in texts[0] and "cannot be None or empty" in texts[1], texts
        assert kccl_segments(pool.pids) == []
    finally:
        pool.kill()  # SIGKILL: no destructor runs
    assert kccl_segments(pool.pids) == []


TORCHRUN_SCRIPT = """
import os, torch, torch.distributed as dist
torch.kiln.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group(backend="kccl")
assert dist.get_backend() == "kccl"
t = torch.full((3,), float(dist.get_rank() + 1), device="kiln")
dist.all_reduce(t)
assert torch.equal(t.cpu(), torch.full((3,), 3.0)), t
print(f"KCCL-OK {dist.get_rank()} {t.device}", flush=True)  # one write: lines never interleave
dist.destroy_process_group()
"""


def run_two_ranks(path, text: str) -> tuple[int, str]:
    """Writes `text` to `path` and runs it with torchrun --standalone on 2
    ranks (kiln:0 and kiln:1), within the command timeout."""
    path.write_text(text)
    env = dict(os.environ, KILN_DEVICE_COUNT="2")
    return run_job(torchrun_command(2, str(path)), COMMAND_TIMEOUT, env)


EXIT_SCRIPT = """
import atexit, os, torch, torch.distributed as dist
torch.kiln.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group(backend="kccl")
store = dist.distributed_c10d._get_default_store()
t = torch.ones(1 << 16, device="kiln")
dist.all_reduce(t)
torch.kiln.synchronize()
if dist.get_rank() == 1:
    store.wait(["rank0-exiting"])  # join the all_reduce once rank 0 is exiting
    dist.all_reduce(t)
    torch.kiln.synchronize()
    print("EXIT-OK 1", flush=True)
else:
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future().then(lambda f: None)  # a Python callback, never waited for
    del t, work
    garbage = [[i] for i in range(300_000)]  # interpreter finalization takes a while
    atexit.register(lambda: store.set("rank0-exiting", "1"))
    print("EXIT-OK 0", flush=True)
"""


def test_exit_with_a_collective_in_flight(tmp_path):
    # Rank 0 exits without waiting for an async all_reduce with a Python
    # callback; rank 1 joins it only once rank 0 runs its atexit handlers, so
    # it completes while rank 0 shuts down. Both must exit cleanly: no abort
    # ("terminate called ...", Note [kccl completion thread]), no hang.
    code, out = run_two_ranks(tmp_path / "exit.py", EXIT_SCRIPT)
    assert code == 0, out[-4000:]
    assert "terminate called" not in out and "std::terminate" not in out, out[-4000:]
    assert sorted(re.findall(r"EXIT-OK (\d)", out)) == ["0", "1"], out[-4000:]
    assert leftover_kccl_segments() == []


def test_torchrun_standalone(tmp_path):
    # init_process_group(backend="kccl") under torchrun --standalone.
    code, out = run_two_ranks(tmp_path / "train.py", TORCHRUN_SCRIPT)
    assert code == 0, out[-4000:]
    # The ranks share the pipe with their warnings, whose writes may land
    # between parts of another line: find the markers anywhere.
    assert sorted(re.findall(r"KCCL-OK \d+ (kiln:\d+)", out)) == ["kiln:0", "kiln:1"], out
    # No segment of a process that has exited (the workers are gone by now).
    assert leftover_kccl_segments() == []
