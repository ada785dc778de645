"""Kiln tensors between processes (torch.multiprocessing), as CUDA's IPC.

Each test starts one `spawn` child with a hard timeout and kills it on any
failure. See Note [Sharing kiln tensors between processes].
"""

import contextlib
import pickle

import pytest
import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler

from conftest import assert_same

TIMEOUT = 90  # seconds, per queue read and per join


@contextlib.contextmanager
def child_process(target, *args, method="spawn"):
    """Starts ``target(to_child, to_parent, *args)`` in a child process and
    yields the two queues; at the end the child must have exited with 0."""
    ctx = mp.get_context(method)
    queues = (ctx.Queue(), ctx.Queue())
    process = ctx.Process(target=target, args=(*queues, *args), daemon=True)
    process.start()
    try:
        yield queues
        process.join(TIMEOUT)
        assert process.exitcode == 0, f"child exit code {process.exitcode}"
    finally:
        if process.is_alive():
            process.kill()
            process.join(10)


def _views_and_writes_child(to_child, to_parent):
    base, view, param = to_child.get(timeout=TIMEOUT)
    to_parent.put((str(base.device), base.cpu(), view.cpu(),
                   view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(),
                   type(param).__name__, param.requires_grad))
    base.mul_(2)  # seen by the parent
    torch.kiln.synchronize(base.device)
    to_parent.put(torch.arange(5.0, device="kiln:1") * 3)  # a tensor of the child's own
    to_parent.put(view)  # one of the parent's, sent back
    to_child.get(timeout=TIMEOUT)  # hold everything until the parent has looked


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_views_share_memory_both_ways(device):
    host = torch.arange(12.0).reshape(3, 4) + 1
    base = host.to(device)
    base.add_(0.5)  # queued work the child must see
    param = torch.nn.Parameter(torch.ones(3, device=device))
    with child_process(_views_and_writes_child) as (to_child, to_parent):
        to_child.put((base, base[1:, 1::2], param))
        seen_device, seen_base, seen_view, shares_storage, param_type, param_grad = \
            to_parent.get(timeout=TIMEOUT)
        assert seen_device == device
        assert_same(seen_base, host + 0.5)
        assert_same(seen_view, (host + 0.5)[1:, 1::2])
        assert shares_storage  # both views arrived on one storage
        assert (param_type, param_grad) == ("Parameter", True)
        fresh = to_parent.get(timeout=TIMEOUT)
        assert fresh.device == torch.device("kiln:1")
        assert_same(fresh, torch.arange(5.0) * 3)
        back = to_parent.get(timeout=TIMEOUT)
        assert_same(base, (host + 0.5) * 2)  # the child's in-place write
        assert_same(back, ((host + 0.5) * 2)[1:, 1::2])
        back.zero_()  # our write through the child's re-share reaches base
        assert_same(base[1, 1], torch.tensor(0.0))
        del back, fresh
        to_child.put(None)
    assert torch.kiln.ipc_collect() == 0  # the child exited: nothing is held for it


def _argument_child(to_child, to_parent, t, model):
    to_parent.put((str(t.device), t.cpu(), model.weight.detach().cpu()))
    with torch.no_grad():
        model.weight.add_(1)  # Hogwild: the parent's parameter
    torch.kiln.synchronize(t.device)
    to_parent.put("written")


@pytest.mark.parametrize("method,device", [("spawn", "kiln:0"), ("forkserver", "kiln:1")])
def test_tensors_as_process_arguments(method, device):
    """Kiln tensors (and a shared model) passed as Process arguments, which
    are pickled while the child starts: multiprocessing's DupFd then only
    records descriptors for the child to inherit, and kiln closed them
    before the launch ("bad value(s) in fds_to_keep" under spawn, "fd ...
    holds 0 bytes" in a forkserver child). Found by a fresh-user sweep."""
    t = torch.arange(6.0, device=device) * 2
    model = torch.nn.Linear(3, 2, bias=False).to(device)
    expected = model.weight.detach().cpu()
    with child_process(_argument_child, t, model, method=method) as (_, to_parent):
        seen_device, seen, weight = to_parent.get(timeout=TIMEOUT)
        assert seen_device == device
        assert_same(seen, torch.arange(6.0) * 2)
        assert_same(weight, expected)
        assert to_parent.get(timeout=TIMEOUT) == "written"
        assert_same(model.weight.detach().cpu(), expected + 1)
    # the child's Process is gone: its Popen closed the descriptors kept for the launch
    assert torch.kiln.ipc_collect() == 0


def _read_later_child(to_child, to_parent):
    t = to_child.get(timeout=TIMEOUT)
    to_parent.put("received")
    to_child.get(timeout=TIMEOUT)  # the parent freed its tensor and reused memory
    to_parent.put(t.cpu())
    to_child.get(timeout=TIMEOUT)  # a sender must live until its message was read


def test_sender_keeps_memory_until_the_receiver_releases_it():
    host = torch.randn(1 << 16)
    with child_process(_read_later_child) as (to_child, to_parent):
        t = host.to("kiln")
        to_child.put(t)
        assert to_parent.get(timeout=TIMEOUT) == "received"
        del t
        assert torch.kiln.ipc_collect() == 1  # held for the child
        # Without that hold, the caching allocator would hand t's block to
        # these same-size tensors, and the child would read -1s.
        clobber = [torch.full((1 << 16,), -1.0, device="kiln") for _ in range(4)]
        torch.kiln.synchronize()
        to_child.put(None)
        assert_same(to_parent.get(timeout=TIMEOUT), host)
        to_child.put(None)
        del clobber
    assert torch.kiln.ipc_collect() == 0


def _sparse_child(to_child, to_parent):
    coo, csr = to_child.get(timeout=TIMEOUT)
    to_parent.put((coo.layout, str(coo.device), coo.is_coalesced(), coo.to_dense().cpu(),
                   csr.layout, str(csr.device), csr.to_dense().cpu()))
    coo._values().mul_(2)  # members share memory: seen by the parent
    torch.kiln.synchronize(coo.device)
    to_parent.put("written")
    to_child.get(timeout=TIMEOUT)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_sparse_tensors_share_their_members(device):
    dense = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 3.0]])
    coo, csr = dense.to_sparse().to(device), dense.to_sparse_csr().to(device)
    with child_process(_sparse_child) as (to_child, to_parent):
        to_child.put((coo, csr))
        seen = to_parent.get(timeout=TIMEOUT)
        assert seen[:3] == (torch.sparse_coo, device, True)
        assert_same(seen[3], dense)
        assert seen[4:6] == (torch.sparse_csr, device)
        assert_same(seen[6], dense)
        assert to_parent.get(timeout=TIMEOUT) == "written"
        assert_same(coo.to_dense(), dense * 2)
        to_child.put(None)


def _send_and_exit_child(to_child, to_parent):
    to_parent.put(torch.ones(4, device="kiln"))  # then exits before the parent reads


def test_receiving_after_the_sender_exited_says_so():
    with child_process(_send_and_exit_child) as (_, to_parent):
        pass  # waits for the child to exit
    with pytest.raises(RuntimeError, match="the process that sent it exited before"):
        to_parent.get(timeout=TIMEOUT)
    assert_same(torch.ones(2, device="kiln") * 2, torch.full((2,), 2.0))  # kiln still works


def test_tensors_that_cannot_be_shared_raise_when_pickled():
    x = torch.ones(3, device="kiln", requires_grad=True)
    with pytest.raises(RuntimeError, match="non-leaf tensor which requires_grad"):
        ForkingPickler.dumps(x * 2)
    q = mp.get_context("spawn").SimpleQueue()
    with pytest.raises(RuntimeError, match="non-leaf"):
        q.put(x * 2)  # SimpleQueue pickles in put()
    # Plain pickling (torch.save's path) is untouched by the sharing reducers.
    assert_same(pickle.loads(pickle.dumps(torch.ones(3, device="kiln"))), torch.ones(3))
    assert torch.kiln.ipc_collect() >= 0
