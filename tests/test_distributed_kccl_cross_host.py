"""kccl across hosts on one machine (issue 12): ranks given different
KCCL_HOST_ID values take the cross-host path (shared memory inside each
"host", Gloo between hosts; Note [kccl across hosts] in
torch_kiln/csrc/distributed/CrossHost.h).

Every scenario of tests/kccl_worker.py checks its results inside each rank
against the same computation done with torch on the CPU in rank order, bit
for bit where the math is the same -- the numbers the one-host path gives
(tests/test_distributed_kccl.py runs the same scenarios there). DDP is
compared with one process training on the global batch. Layouts:
  * 2 hosts x 2 ranks  (hosts [[0, 1], [2, 3]]),
  * 2 hosts x 1 rank   ([[0], [1]]: everything through Gloo),
  * 3 ranks on 2 hosts, interleaved ([[0, 2], [1]]: uneven hosts, a
    host whose ranks are not consecutive).
Hard timeouts per command (kccl_pool.COMMAND_TIMEOUT); /dev/shm is checked
after every test. The real two-host test (two network namespaces, torchrun)
is tests/test_distributed_kccl_two_hosts.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from kccl_pool import RankPool, check_no_segments, serve

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)

LAYOUTS = {
    "2x2": ["host-a", "host-a", "host-b", "host-b"],
    "2x1": ["host-a", "host-b"],
    "interleaved": ["host-a", "host-b", "host-a"],
}
EXPECTED_HOSTS = {
    "2x2": [[0, 1], [2, 3]],
    "2x1": [[0], [1]],
    "interleaved": [[0, 2], [1]],
}


def make_pool(layout: str) -> RankPool:
    ids = LAYOUTS[layout]
    # A small slot makes the larger tensors below run in many pieces.
    # init_process_group(device_id=kiln:RANK): kccl from the device type
    # (and a bound device, which split_group needs).
    return RankPool(len(ids), env={"KCCL_SHM_SLOT_BYTES": str(64 * 1024), "KCCL_TEST_DEVICE_ID": "1"},
                    rank_env=lambda rank: {"KCCL_HOST_ID": ids[rank]})


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def pool(request):
    pool = make_pool(request.param)
    pool.layout = request.param
    yield from serve(pool)


@pytest.fixture(autouse=True)
def no_leftover_segments(request):
    yield
    check_no_segments(request, ("pool",))


def test_ranks_are_grouped_by_host_id(pool):
    infos = pool.run("backend_info")
    assert [i["backend"] for i in infos] == ["kccl"] * pool.world
    assert [i["hosts"] for i in infos] == [EXPECTED_HOSTS[pool.layout]] * pool.world
    assert [i["device"] for i in infos] == [f"kiln:{r}" for r in range(pool.world)]


def test_all_reduce_every_op_and_dtype(pool):
    counts = pool.run("all_reduce_ops")
    assert len(set(counts)) == 1 and counts[0] > 50


def test_collectives(pool):
    # broadcast and reduce from every root, all_gather(_into_tensor),
    # reduce_scatter(_tensor) with several ops, 6 dtypes, then barrier.
    assert pool.run("collectives") == [6] * pool.world


# Scenarios whose checks are all inside the ranks (each raises on a wrong
# value): (scenario, arguments).
SCENARIOS = [
    # 40_000 elements are several 64 KiB pieces inside and between hosts.
    ("chunked", {"numel": 40_000}),
    ("noncontiguous", {}),
    # async_op on the default and a side stream: the host does not block, the
    # stream waits; the allocator keeps a freed input.
    ("async", {}),
    # blocking, batch_isend_irecv rings, ungrouped isend before irecv.
    ("p2p", {}),
    ("p2p", {"numel": 20_000}),
    ("coalesced", {}),
    ("dtensor_fsdp", {}),
    # DDP against one process on the global batch.
    ("ddp", {}),
    ("ddp", {"no_sync": True, "steps": 6}),
    ("ddp", {"hook": "fp16", "rtol": 1e-2}),
]


SCENARIO_IDS = [name + "".join(f"-{k}={v}" for k, v in args.items()) for name, args in SCENARIOS]


@pytest.mark.parametrize("scenario,args", SCENARIOS, ids=SCENARIO_IDS)
def test_scenario(pool, scenario, args):
    # pool.run fails the test with the rank's traceback if a check fails.
    assert len(pool.run(scenario, **args)) == pool.world


def test_other_device(pool):
    assert pool.run("other_device", device=1) == ["kiln:1"] * pool.world
    assert pool.run("other_device", device=0) == ["kiln:0"] * pool.world


def test_gather_scatter_all_to_all(pool):
    texts = pool.run("gather_scatter_alltoall")
    assert all("rank 0 sends 4 elements to rank 0, which expects 2" in t for t in texts)
    pool.run("gather_scatter_alltoall", rows=3000)


def test_groups(pool):
    out = pool.run("groups")
    assert out[0] == {"kccl": "kccl", "cpu:gloo,kiln:kccl": "cpu:gloo,kiln:kccl"}


def test_mismatched_sizes_raise(pool):
    texts = pool.run("mismatch", seconds=5)
    assert all("mismatched collectives" in t for t in texts), texts


# (the rank that waits, what its error names): a non-leader waits for its
# leader in shared memory, which names the missing group rank; a leader
# waits in Gloo between hosts.
TIMEOUT_CASES = {
    "2x2": (3, "ranks [2] did not arrive"),
    "interleaved": (2, "ranks [0] did not arrive"),
    "2x1": (0, "between hosts"),
}


def test_rank_that_never_arrives_times_out(pool):
    waiter, names = TIMEOUT_CASES[pool.layout]
    start = time.monotonic()
    fragments = ["all_reduce", "sequence number 1", "Float[8]", "timed out", names]
    out = pool.run("timeout", seconds=3, rank=waiter, fragments=fragments)
    assert time.monotonic() - start < 60
    assert 2.5 < out[waiter]["seconds"] < 30, out[waiter]
