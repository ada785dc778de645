"""Side streams inside a kiln graph capture (CUDA's fork and join; Note
[Cross-stream capture] in runtime/src/graph.cc): `side.wait_stream(capturing)`
brings `side` into the capture, its work is recorded into the same graph and
allocates from the graph's pool, and the capture must wait for it again before
it ends. Replays are checked bit for bit against the same code run eagerly,
on kiln:0 and kiln:1; the errors are CUDA's."""

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_same

DEVICES = [0, 1]


def other_stream(*avoid):
    """A pooled kiln stream of the current device that is none of `avoid`
    (torch.kiln.Stream() hands out a small pool round robin, as CUDA does)."""
    for _ in range(16):
        s = torch.kiln.Stream()
        if all(s != a for a in avoid):
            return s
    raise AssertionError("the stream pool handed out no other stream")


def warmed_ones(fn):
    """Eight kiln ones after one eager call of fn on them (first calls check
    layouts, which a capture refuses), the device idle."""
    x = torch.ones(8, device="kiln")
    fn(x)
    torch.kiln.synchronize()
    return x


def fork_join_step(x, w, side):
    """Work split over the current stream and `side`, joined back: a matmul
    and a dropout on the side stream, elementwise work on the current one."""
    current = torch.kiln.current_stream()
    side.wait_stream(current)
    with torch.kiln.stream(side):
        a = F.dropout((x @ w).relu(), 0.5)
        scratch = a * 3  # a temporary of the side stream, freed inside the capture
        a = a + scratch.tanh()
        del scratch
    b = x.sin() * 2
    current.wait_stream(side)
    return a + b


def capture(fn, *args, stream):
    g = torch.kiln.KilnGraph()
    with torch.kiln.graph(g, stream=stream):
        out = fn(*args)
    return g, out


@pytest.mark.parametrize("device", DEVICES)
def test_side_stream_work_is_captured_and_replays_match_eager(device):
    with torch.kiln.device(device):
        dev = f"kiln:{device}"
        cap = torch.kiln.Stream()
        side = other_stream(cap)
        x, w = torch.randn(64, 64, device=dev), torch.randn(64, 64, device=dev)
        with torch.kiln.stream(cap):
            fork_join_step(x, w, side)  # warm-up: first calls check layouts
        torch.kiln.synchronize()
        g, out = capture(fork_join_step, x, w, side, stream=cap)
        assert g.num_nodes() >= 8
        for seed in (3, 4, 5):
            x.copy_(torch.randn(64, 64))  # new static input
            torch.kiln.manual_seed(seed)
            g.replay()
            replayed = out.cpu()
            torch.kiln.manual_seed(seed)
            assert_same(fork_join_step(x, w, side), replayed)


def test_side_stream_allocations_come_from_the_graph_pool():
    """A side stream's tensors made during the capture must stay the graph's:
    work after the capture that reuses ordinary memory must not see replays
    write into it (nor the replays see that work)."""
    cap = torch.kiln.Stream()
    side = other_stream(cap)
    x, w = torch.randn(64, 64, device="kiln"), torch.randn(64, 64, device="kiln")
    with torch.kiln.stream(cap):
        fork_join_step(x, w, side)
    torch.kiln.synchronize()
    torch.kiln.manual_seed(0)
    g, out = capture(fork_join_step, x, w, side, stream=cap)
    pool_ranges = [(s["address"], s["address"] + s["total_size"])
                   for s in torch.kiln.memory_snapshot() if tuple(s["segment_pool_id"]) == g.pool()]
    assert pool_ranges, "the capture allocated from its pool"
    # Ordinary tensors made now on the side stream and the default stream.
    with torch.kiln.stream(side):
        mine_side = [torch.full((64, 64), float(i), device="kiln") for i in range(6)]
    mine = [torch.full((64, 64), -float(i), device="kiln") for i in range(6)]
    torch.kiln.synchronize()
    for t in mine_side + mine:
        assert not any(lo <= t.data_ptr() < hi for lo, hi in pool_ranges)
    torch.kiln.manual_seed(1)
    g.replay()
    replayed = out.cpu()
    for i, t in enumerate(mine_side):
        assert_same(t, torch.full((64, 64), float(i)))
    for i, t in enumerate(mine):
        assert_same(t, torch.full((64, 64), -float(i)))
    torch.kiln.manual_seed(1)
    assert_same(fork_join_step(x, w, side), replayed)


def test_a_side_stream_not_joined_back_fails_the_capture_and_works_afterwards():
    cap = torch.kiln.Stream()
    side = other_stream(cap)
    x = warmed_ones(lambda t: t * 3)
    g = torch.kiln.KilnGraph()
    with pytest.raises(RuntimeError, match="capturing stream has unjoined work|does not wait for"):
        with torch.kiln.graph(g, stream=cap):
            side.wait_stream(cap)
            with torch.kiln.stream(side):
                y = x * 3
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()
    assert not torch.kiln.is_current_stream_capturing()
    with torch.kiln.stream(side):
        assert not torch.kiln.is_current_stream_capturing()
        z = x * 3
    side.synchronize()
    assert_same(z, torch.full((8,), 3.0))
    del y


def test_a_joined_stream_reports_capturing_and_refuses_synchronize():
    cap = torch.kiln.Stream()
    side = other_stream(cap)
    x = warmed_ones(lambda t: t + 1)
    g = torch.kiln.KilnGraph()
    with torch.kiln.stream(cap):
        g.capture_begin()
        side.wait_stream(cap)
        with torch.kiln.stream(side):
            assert torch.kiln.is_current_stream_capturing()
            with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
                side.synchronize()
        with pytest.raises(RuntimeError, match="invalidated"):
            cap.wait_stream(side)  # the capture is invalidated: joining back fails too
        with pytest.raises(RuntimeError, match="invalidated"):
            g.capture_end()


@pytest.mark.parametrize("call", ["query", "synchronize", "elapsed_time"])
def test_an_event_recorded_during_capture_cannot_be_queried_or_timed(call):
    cap = torch.kiln.Stream()
    start = torch.kiln.Event(enable_timing=True)
    start.record()
    start.synchronize()
    x = warmed_ones(lambda t: t + 1)
    g = torch.kiln.KilnGraph()
    with torch.kiln.graph(g, stream=cap):
        e = torch.kiln.Event(enable_timing=True)
        e.record()
        with pytest.raises(RuntimeError, match="last recorded on a capturing stream"):
            if call == "query":
                e.query()
            elif call == "synchronize":
                e.synchronize()
            else:
                start.elapsed_time(e)
        y = x + 1
    g.replay()
    assert_same(y, torch.full((8,), 2.0))
    # A record outside the capture makes the event usable again.
    e.record()
    e.synchronize()
    assert e.query()


def test_the_default_stream_cannot_join_a_capture():
    cap = torch.kiln.Stream()
    x = warmed_ones(lambda t: t + 1)
    g = torch.kiln.KilnGraph()
    with torch.kiln.stream(cap):
        g.capture_begin()
        y = x + 1
        with pytest.raises(RuntimeError, match="default stream"):
            torch.kiln.default_stream().wait_stream(cap)
        with pytest.raises(RuntimeError, match="invalidated"):
            g.capture_end()
    z = x + 1  # the default stream works on
    assert_same(z, torch.full((8,), 2.0))
    del y


def test_a_tensor_freed_in_a_capture_after_record_stream_is_reused_safely():
    """record_stream on a capturing stream, then the tensor is freed inside
    the capture: the allocator must not record (and later query) an event
    on the capturing stream; it waits until the capture ended."""
    cap = torch.kiln.Stream()
    x = torch.ones(1024, device="kiln")
    (x * 2).sum()
    torch.kiln.synchronize()
    kept = torch.full((1024,), 7.0, device="kiln")  # made on the default stream
    g = torch.kiln.KilnGraph()
    with torch.kiln.graph(g, stream=cap):
        kept.record_stream(cap)
        y = x * 2
        del kept
    g.replay()
    assert_same(y, torch.full((1024,), 2.0))
    # Later allocations (which process the deferred free) work and are right.
    fresh = [torch.full((1024,), float(i), device="kiln") for i in range(4)]
    torch.kiln.synchronize()
    for i, t in enumerate(fresh):
        assert_same(t, torch.full((1024,), float(i)))


def test_a_block_freed_after_record_stream_in_a_capture_is_not_merged_or_reused():
    """The allocator defers a free with stream uses while a capture is
    underway; the held block must not count as free (a helper's reproducer:
    freeing its neighbour merged it away, and a later capture sharing the
    pool was given a live graph output's memory)."""
    cap = torch.kiln.Stream()
    side = other_stream(cap)
    warmed_ones(lambda t: (t.add_(1), t * 3))
    g = torch.kiln.KilnGraph()
    with torch.kiln.graph(g, stream=cap):
        a = torch.ones(256, device="kiln")
        b = torch.ones(256, device="kiln")  # a's neighbour in the pool's segment
        side.wait_stream(cap)
        with torch.kiln.stream(side):
            a.add_(1)
        a.record_stream(side)
        cap.wait_stream(side)
        del a  # deferred until the capture ends
        del b
        c = torch.ones(512, device="kiln") * 3  # a graph output, kept alive
    torch.zeros(256, device="kiln")  # an allocation after the capture
    g2 = torch.kiln.KilnGraph()
    with torch.kiln.graph(g2, stream=cap, pool=g.pool()):
        d = [torch.full((256,), 7.0, device="kiln") for _ in range(4)]
    lo, hi = c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()
    assert not any(lo <= t.data_ptr() < hi for t in d)
    g.replay()
    g2.replay()
    assert_same(c, torch.full((512,), 3.0))
    for t in d:
        assert_same(t, torch.full((256,), 7.0))


def test_record_stream_still_protects_eager_memory_while_a_capture_is_underway():
    cap = torch.kiln.Stream()
    s2 = other_stream(cap)
    s3 = other_stream(cap, s2)
    big = torch.randn(768, 768, device="kiln")
    warmed_ones(lambda t: (t.add_(1), t * 1, big @ big))

    def late_read():
        with torch.kiln.stream(s2):
            a = torch.full((256,), 1.0, device="kiln")
            b = torch.full((256,), 2.0, device="kiln")  # a's neighbour
        s3.wait_stream(s2)
        with torch.kiln.stream(s3):
            for _ in range(4):
                big @ big  # keeps s3 busy
            out = a * 1  # reads a, late
        a.record_stream(s3)  # a must not be reused before s3 is done
        del a, b
        with torch.kiln.stream(s2):
            torch.full((512,), 9.0, device="kiln")  # must not get a's memory yet
        s3.synchronize()
        s2.synchronize()
        with torch.kiln.stream(s3):  # not on the capturing stream
            return out.cpu()

    assert_same(late_read(), torch.ones(256))
    g = torch.kiln.KilnGraph()
    with torch.kiln.graph(g, stream=cap):
        torch.ones(4, device="kiln").add_(1)  # something captured
        during = late_read()  # eager work on other streams meanwhile
    assert_same(during, torch.ones(256))


def test_make_graphed_callables_with_a_side_stream_in_the_forward():
    side = other_stream()

    class SideStreamBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 16)
            self.b = torch.nn.Linear(16, 16)

        def forward(self, x):
            current = torch.kiln.current_stream()
            side.wait_stream(current)
            with torch.kiln.stream(side):
                h = self.a(x).relu()
            current.wait_stream(side)
            return self.b(x) * h

    torch.manual_seed(0)
    eager = SideStreamBlock().to("kiln")
    graphed_module = SideStreamBlock().to("kiln")
    graphed_module.load_state_dict(eager.state_dict())
    graphed = torch.kiln.make_graphed_callables(graphed_module, (torch.randn(8, 16, device="kiln"),))
    for _ in range(3):
        x = torch.randn(8, 16, device="kiln")
        for module in (eager, graphed):
            module.zero_grad(set_to_none=True)
        y_eager, y_graphed = eager(x), graphed(x)
        (y_eager * y_eager).sum().backward()
        (y_graphed * y_graphed).sum().backward()
        assert_same(y_graphed, y_eager.cpu())
        for p_eager, p_graphed in zip(eager.parameters(), graphed_module.parameters()):
            assert_same(p_graphed.grad, p_eager.grad.cpu())
    torch.randn(64, device="kiln")  # the allocator is sound afterwards
    torch.kiln.synchronize()
