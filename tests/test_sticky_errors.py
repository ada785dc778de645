"""A kernel that fails on the device leaves a sticky error on its stream:
later work there is skipped, and the next synchronization raises the
kernel's own exception type (IndexError for a bad index, as on CPU) naming
the op and its input shapes; then the stream works again. Reading a result
the failed kernel should have written raises a RuntimeError naming it."""

import pytest
import torch


@pytest.fixture(autouse=True)
def warm_index_select():
    """A valid call first: an op's first call per kind of input runs
    synchronously (Note [Verifying meta kernels]) and would raise the error
    at the call itself; these tests are about the asynchronous case."""
    x = torch.arange(4.0, device="kiln")
    torch.index_select(x, 0, torch.tensor([0], device="kiln"))
    torch.kiln.synchronize()


def test_failing_kernel_raises_at_next_synchronization():
    x = torch.arange(4.0, device="kiln")
    bad = torch.tensor([0, 9], device="kiln")
    y = torch.index_select(x, 0, bad)  # returns at once: the failure is on the device
    z = y + 1  # skipped
    with pytest.raises(IndexError, match=r"index_select.*Float\[4\].*Long\[2\].*index out of range"):
        torch.kiln.synchronize()
    # Raised once; the stream works again.
    torch.kiln.synchronize()
    assert (torch.ones(2, device="kiln") + 1).sum().item() == 4.0
    del z


def test_sticky_error_surfaces_at_item():
    x = torch.arange(4.0, device="kiln")
    y = torch.index_select(x, 0, torch.tensor([7], device="kiln"))
    with pytest.raises(IndexError, match="index_select"):
        y.sum().item()
    assert x.sum().item() == 6.0


def test_error_on_side_stream_stays_on_that_stream():
    s = torch.kiln.Stream()
    x = torch.arange(4.0, device="kiln")
    with torch.kiln.stream(s):
        torch.index_select(x, 0, torch.tensor([5], device="kiln"))
    assert (x * 2).sum().item() == 12.0  # the default stream is unaffected
    with pytest.raises(IndexError, match="index_select"):
        s.synchronize()
    s.synchronize()


def test_results_of_failed_kernels_cannot_be_read():
    x = torch.arange(4.0, device="kiln")
    y = torch.index_select(x, 0, torch.tensor([0, 9], device="kiln"))  # fails on the device
    z = y * 2  # skipped
    with pytest.raises(IndexError, match="index_select"):
        torch.kiln.synchronize()
    for t in (y, z, z + 1):  # never computed: reading them is an error, not garbage
        with pytest.raises(RuntimeError, match="never computed.*index_select"):
            t.sum().item()
    y.zero_()  # overwritten whole: valid again
    assert y.tolist() == [0.0, 0.0]
    assert x.sum().item() == 6.0


def test_event_recorded_behind_a_failure_raises_it():
    x = torch.arange(4.0, device="kiln")
    host = torch.full((2,), -7.0).pin_memory()
    index = torch.tensor([1, 9], device="kiln")  # a blocking copy: before the sleep
    torch.kiln._sleep(50)  # the failure happens after the copy below is queued
    y = torch.index_select(x, 0, index)
    host.copy_(y, non_blocking=True)  # skipped: the values never arrive
    event = torch.kiln.Event()
    event.record()
    with pytest.raises(IndexError, match="index_select"):
        event.synchronize()
    event.synchronize()  # raised once
    torch.kiln.synchronize()  # the event took the stream's error
    y2 = torch.index_select(x, 0, torch.tensor([7], device="kiln"))
    generic = torch.Event(device="kiln")
    generic.record()
    with pytest.raises(IndexError, match="index_select"):
        while not generic.query():
            pass
    del y2


def test_other_stream_reading_a_failed_result_fails_too():
    x = torch.arange(4.0, device="kiln")
    index = torch.tensor([9, 1], device="kiln")  # a blocking copy: before the sleep
    torch.kiln._sleep(50)  # the failure happens after the side stream's kernel is queued
    y = torch.index_select(x, 0, index)
    event = torch.kiln.Event()
    event.record()
    side = torch.kiln.Stream()
    side.wait_event(event)
    with torch.kiln.stream(side):
        doubled = y * 2  # launched before the failure is known, runs after it
    side.synchronize()  # the side stream's kernel did not fail: it had no input
    with pytest.raises(IndexError, match="index_select"):
        torch.kiln.synchronize()
    with pytest.raises(RuntimeError, match="never computed.*index_select"):
        doubled.sum().item()


def test_launch_blocking_keeps_the_error_type():
    from conftest import run_python
    code = (
        "import torch\n"
        "x = torch.arange(4.0, device='kiln')\n"
        "torch.index_select(x, 0, torch.tensor([1], device='kiln'))\n"
        "try:\n"
        "    torch.index_select(x, 0, torch.tensor([9], device='kiln'))\n"
        "except IndexError as e:\n"
        "    print('IndexError', 'out of range' in str(e))\n"
    )
    result = run_python(code, {"KILN_LAUNCH_BLOCKING": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["IndexError", "True"]


def test_unraised_error_is_reported_at_exit():
    from conftest import run_python
    code = (
        "import torch\n"
        "x = torch.arange(4.0, device='kiln')\n"
        "torch.index_select(x, 0, torch.tensor([1], device='kiln'))\n"
        "torch.index_select(x, 0, torch.tensor([9], device='kiln'))\n"
    )
    result = run_python(code)
    assert "error was never raised" in result.stderr and "index_select" in result.stderr


def test_copy_to_another_device_of_a_failed_result_is_marked():
    x = torch.arange(4.0, device="kiln")
    index = torch.tensor([9, 1], device="kiln")  # a blocking copy: before the sleep
    torch.kiln._sleep(50)  # the failure happens after the copy below is queued
    y = torch.index_select(x, 0, index)
    on_other_device = y.to("kiln:1")
    with pytest.raises(IndexError, match="index_select"):
        torch.kiln.synchronize()
    with pytest.raises(RuntimeError, match="never computed.*copy from kiln:0 was skipped"):
        on_other_device.cpu()


# Note [Results of failed kernels]: a kernel that writes all of a storage
# without reading it (an out= argument, a random fill, a fresh output) ends
# its mark once it has run, in stream order.
@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
def test_out_write_after_a_failure_makes_the_buffer_valid_again(device, side_stream):
    index = torch.tensor([0], device=device)
    torch.index_select(torch.arange(4.0, device=device), 0, index)  # first call (layout check)
    stream = torch.kiln.Stream(device) if side_stream else torch.kiln.current_stream(device)
    with torch.kiln.stream(stream):
        x = torch.randn(1000, device=device)
        o = torch.empty(1000, device=device)
        torch.index_select(x, 0, torch.arange(1000, device=device), out=o)  # first call
        torch.index_select(x, 0, torch.full((1000,), 5000, device=device), out=o)  # fails
        with pytest.raises(IndexError, match="index_select"):
            stream.synchronize()
        with pytest.raises(RuntimeError, match="never computed.*index_select"):
            o.cpu()
        torch.index_select(x, 0, torch.arange(1000, device=device), out=o)  # a good retry
        doubled = o * 2  # launched while o is still marked: computed once the retry ran
        assert torch.equal(o.cpu(), x.cpu())
        assert torch.equal(doubled.cpu(), x.cpu() * 2)
        torch.add(x, 1, out=o)
        assert torch.equal(o.cpu(), x.cpu() + 1)


@pytest.mark.parametrize("write", ["add-out", "uniform_", "normal_", "fill_"])
def test_block_reused_while_a_mark_is_pending_holds_the_new_values(write):
    # The kernel reading the failed result marks what it writes when it runs
    # (on the stream, after the sleep); by then its output's block has been
    # freed and handed to z, whose own write, later on the stream, must win.
    from torch_kiln import _C

    x = torch.randn(1000, device="kiln")
    y = torch.index_select(x, 0, torch.full((1000,), 5000, device="kiln"))
    with pytest.raises(IndexError, match="index_select"):
        torch.kiln.synchronize()
    _C._sleep(200.0)
    p = y * 2  # marked when it runs
    block = p.data_ptr()
    del p
    z = torch.empty(1000, device="kiln")
    assert z.data_ptr() == block
    if write == "add-out":
        torch.add(x, 1, out=z)
        assert torch.equal(z.cpu(), x.cpu() + 1)
    elif write == "fill_":
        z.fill_(3.0)
        assert torch.equal(z.cpu(), torch.full((1000,), 3.0))
    else:
        getattr(z, write)()
        values = z.cpu()
        assert values.isfinite().all() and values.std() > 0.1
    with pytest.raises(RuntimeError, match="never computed"):
        y.cpu()  # the failed result itself stays unreadable


def _fail_on_side_stream_then_join(device, join):
    """`w` (on `device`) should be doubled by a side stream, behind a kernel
    that fails there, so it is skipped; the current stream then waits for the
    side stream (by wait_stream or an event). Everything is queued before the
    failure happens, so no launch-time check can see it."""
    x = torch.arange(4.0, device=device)
    torch.index_select(x, 0, torch.tensor([0], device=device))  # warm up on this device
    torch.kiln.synchronize(device)
    index = torch.tensor([0, 9], device=device)
    w = torch.full((4,), 3.0, device=device)
    side = torch.kiln.Stream(device=device)
    side.wait_stream(torch.kiln.current_stream(device))
    with torch.kiln.stream(side):
        torch.kiln._sleep(100)
        torch.index_select(x, 0, index)  # fails on the device
        w.mul_(2)  # skipped: w never gets its values
        event = torch.kiln.Event()
        event.record()
    if join == "wait_stream":
        torch.kiln.current_stream(device).wait_stream(side)
    else:
        torch.kiln.current_stream(device).wait_event(event)
    return w, side


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("join", ["wait_stream", "wait_event"])
@pytest.mark.parametrize("sync", ["stream", "event"])
def test_async_copy_to_host_of_a_result_failed_on_another_stream_raises(device, join, sync):
    # Before, the copy moved the never-computed bytes into `host` and the
    # current stream's synchronization returned: a silently stale batch.
    with torch.kiln.device(device):
        w, side = _fail_on_side_stream_then_join(device, join)
        host = torch.full((4,), -1.0).pin_memory()
        host.copy_(w, non_blocking=True)
        with pytest.raises(RuntimeError, match=r"non_blocking=True were never computed.*index_select"):
            if sync == "stream":
                torch.kiln.current_stream().synchronize()
            else:
                done = torch.kiln.Event()
                done.record()
                done.synchronize()
        assert host.tolist() == [-1.0] * 4  # the copy was not made
        with pytest.raises(IndexError, match="index_select"):
            side.synchronize()
        assert (torch.ones(2, device=device) * 2).tolist() == [2.0, 2.0]  # works again


# Ops that run on the host, synchronously: data-dependent results, and the
# first call per kind of input (Note [Verifying meta kernels]).
HOST_READS = {
    "nonzero": lambda w: w.nonzero(),
    "masked_select": lambda w: w[w > 100],
    "unique": lambda w: torch.unique(w),
    "equal": lambda w: torch.equal(w, torch.zeros_like(w)),
    "repeat_interleave": lambda w: torch.repeat_interleave(w.long().clamp(0, 3)),
    "kthvalue": lambda w: torch.kthvalue(w.view(2, 2), 1, dim=1, keepdim=True).values,
    "median": lambda w: torch.median(w.view(2, 2), dim=0).values,
}


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("join", ["wait_stream", "wait_event"])
@pytest.mark.parametrize("read", sorted(HOST_READS))
def test_host_side_op_on_a_result_failed_on_another_stream_raises(device, join, read):
    """A synchronous op reads its inputs on the host: a failed result raises
    there (the failure itself while unraised, then "never computed"), as
    .cpu() does, instead of reading memory no kernel wrote."""
    w, side = _fail_on_side_stream_then_join(device, join)
    with pytest.raises((IndexError, RuntimeError), match="index_select"):
        result = HOST_READS[read](w)
        if isinstance(result, torch.Tensor):
            result.cpu()
    with pytest.raises(RuntimeError, match="never computed.*index_select"):
        HOST_READS[read](w)  # after the failure was raised
    torch.kiln.synchronize()


def test_host_side_op_on_a_result_failed_on_another_device_raises():
    """A peer copy passes the mark on, so a read on kiln:0 of a result that
    failed on kiln:1 raises (before, nonzero and max read zeros); kiln:1's
    synchronization raises the failure itself."""
    x = torch.arange(12.0, device="kiln:1").reshape(3, 4)
    moved = x[torch.tensor([0, 9], device="kiln:1")].to("kiln:0")
    for read in (lambda: moved.nonzero(), lambda: moved.max().cpu()):
        with pytest.raises(RuntimeError, match="never computed.*copy from kiln:1 was skipped"):
            read()
    with pytest.raises(IndexError, match="index 9 is out of bounds"):
        torch.kiln.synchronize("kiln:1")


@pytest.mark.parametrize("source, target", [("kiln:0", "kiln:1"), ("kiln:1", "kiln:0")])
@pytest.mark.parametrize("layout", ["contiguous", "transposed-source", "strided-target"])
def test_peer_copy_of_a_result_failed_on_another_stream_is_marked(source, target, layout):
    # Before, the peer copy ran with the never-computed bytes and the copy on
    # the other device read back as valid values.
    with torch.kiln.device(source):
        w, side = _fail_on_side_stream_then_join(source, "wait_stream")
    if layout == "transposed-source":
        w = w.view(2, 2).t()
        out = w.to(target)
    elif layout == "strided-target":
        out = torch.zeros(4, 2, device=target)[:, 0]
        out.copy_(w)
    else:
        out = w.to(target)
    with pytest.raises(RuntimeError, match="never computed.*index_select"):
        out.cpu()
    with pytest.raises(IndexError, match="index_select"):
        side.synchronize()


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
@pytest.mark.parametrize("source", ["pinned-non-blocking", "pinned-blocking", "pageable-non-blocking",
                                    "pageable-blocking"])
@pytest.mark.parametrize("target", ["existing", "strided", "fresh"])
def test_copy_from_host_skipped_behind_a_failure_is_marked(device, side_stream, source, target):
    # Before, the skipped copy left the old bytes (or, for a fresh tensor,
    # whatever the allocator's block held) to be read as the new values once
    # the program had caught the error.
    stream = torch.kiln.Stream(device=device) if side_stream else None
    with torch.kiln.device(device), torch.kiln.stream(stream):
        x = torch.arange(4.0, device=device)
        torch.index_select(x, 0, torch.tensor([0], device=device))  # warm up on this device
        torch.kiln.current_stream().synchronize()
        old = torch.zeros(4, 2, device=device)
        dst = old if target == "existing" else old[:, 0]
        host = torch.full(tuple(dst.shape) if target != "fresh" else (4, 2), 7.0)
        if source.startswith("pinned"):
            host = host.pin_memory()
        non_blocking = source.endswith("non-blocking")
        index = torch.tensor([0, 9], device=device)
        torch.kiln._sleep(50)
        torch.index_select(x, 0, index)  # fails on the device, after the copy is queued
        if target == "fresh" and not non_blocking:
            with pytest.raises(IndexError, match="index_select"):
                host.to(device)  # waits, so raises: the program never holds the tensor
            return
        with pytest.raises(IndexError, match="index_select"):
            if target == "fresh":
                dst = host.to(device, non_blocking=True)
            else:
                dst.copy_(host, non_blocking=non_blocking)
            torch.kiln.current_stream().synchronize()
        with pytest.raises(RuntimeError, match="never computed.*index_select"):
            dst.cpu()
        # A copy that overwrites the storage whole makes it valid again.
        whole = dst if target == "fresh" else old
        whole.copy_(torch.full(tuple(whole.shape), 7.0))
        assert dst.cpu().tolist() == host.tolist()
