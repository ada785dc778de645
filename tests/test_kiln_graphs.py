"""Kiln graphs (torch.kiln.KilnGraph / torch.kiln.graph): capture and replay
with CUDA Graphs' semantics, checked by values against eager kiln and CPU.

Every capture is preceded by a warm-up run of the same code, as CUDA's docs
require (kiln's first call of an op in a layout class checks its meta kernel
synchronously, which a capture refuses)."""

import copy
import textwrap

import pytest
import torch
import torch.nn.functional as F

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from conftest import assert_same, run_python

DEVICES = [0, 1]


def warm_up(fn, *args):
    """Runs fn once on a side stream, as CUDA's graph recipe does, and waits."""
    s = torch.kiln.Stream()
    s.wait_stream(torch.kiln.current_stream())
    with torch.kiln.stream(s):
        fn(*args)
    torch.kiln.current_stream().wait_stream(s)
    torch.kiln.synchronize()


def elementwise_and_matmul(x, w):
    return ((x @ w).relu() * 2 + x).sigmoid()


@pytest.mark.parametrize("device", DEVICES)
def test_capture_does_not_run_and_replays_match_eager_with_new_inputs(device):
    with torch.kiln.device(device):
        dev = f"kiln:{device}"
        x_cpu, w_cpu = torch.randn(32, 32), torch.randn(32, 32)
        x, w = x_cpu.to(dev), w_cpu.to(dev)
        warm_up(elementwise_and_matmul, x, w)
        g = torch.kiln.KilnGraph()
        with torch.kiln.graph(g):
            assert torch.kiln.is_current_stream_capturing()
            out = elementwise_and_matmul(x, w)
        assert not torch.kiln.is_current_stream_capturing()
        assert out.device == torch.device(dev)
        assert g.num_nodes() >= 4
        # Capture did not run the work: a fresh pool block holds no result yet.
        # (Its contents are undefined, so only check replay's values.)
        for _ in range(3):
            x_cpu = torch.randn(32, 32)
            x.copy_(x_cpu)  # static input, refilled in place
            g.replay()
            assert_same(out, elementwise_and_matmul(x_cpu, w_cpu))
            assert_same(out, elementwise_and_matmul(x, w).cpu())  # eager kiln too


def test_capture_records_instead_of_running():
    x = torch.zeros(16, device="kiln")
    warm_up(lambda t: t.add_(1), x)
    x.zero_()
    g = torch.kiln.KilnGraph()
    with torch.kiln.graph(g):
        x.add_(1)
    assert_same(x, torch.zeros(16))  # captured, not run
    g.replay()
    g.replay()
    assert_same(x, torch.full((16,), 2.0))


def test_replay_on_default_and_side_streams_is_ordered_there():
    x = torch.randn(64, device="kiln")
    warm_up(lambda t: t * 3 + 1, x)
    g = torch.kiln.KilnGraph()
    with torch.kiln.graph(g):
        y = x * 3 + 1
    # Default stream: ordered after the copy_ launched before it.
    x.copy_(torch.arange(64.0))
    g.replay()
    assert_same(y, torch.arange(64.0) * 3 + 1)
    # A side stream: ordered after that stream's own earlier work.
    s = torch.kiln.Stream()
    s.wait_stream(torch.kiln.current_stream())
    with torch.kiln.stream(s):
        x.fill_(2.0)
        g.replay()
        result = y.clone()
    torch.kiln.current_stream().wait_stream(s)
    assert_same(result, torch.full((64,), 7.0))


@pytest.mark.parametrize("device", DEVICES)
def test_mlp_forward_graph_matches_eager_and_cpu(device):
    torch.manual_seed(0)
    model_cpu = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                    torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 8))
    with torch.kiln.device(device):
        dev = f"kiln:{device}"
        model = copy.deepcopy(model_cpu).to(dev)
        static_x = torch.randn(4, 16, device=dev)
        with torch.no_grad():
            warm_up(model, static_x)
            g = torch.kiln.KilnGraph()
            with torch.kiln.graph(g):
                static_out = model(static_x)
            for _ in range(3):
                data = torch.randn(4, 16)
                static_x.copy_(data)
                g.replay()
                assert_same(static_out, model_cpu(data))
                assert_same(static_out, model(data.to(dev)).cpu())


def make_training(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


def eager_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("device", DEVICES)
def test_training_step_graph_matches_eager_bit_for_bit(device):
    with torch.kiln.device(device):
        dev = f"kiln:{device}"
        model, opt = make_training(dev)
        ref_model, ref_opt = make_training(dev)
        batches = [(torch.randn(16, 8), torch.randn(16, 2)) for _ in range(6)]
        static_x = torch.empty(16, 8, device=dev)
        static_y = torch.empty(16, 2, device=dev)
        # Warm-up (3 steps, on a side stream for the graphed model; the
        # reference takes the same steps eagerly).
        s = torch.kiln.Stream()
        s.wait_stream(torch.kiln.current_stream())
        with torch.kiln.stream(s):
            for xb, yb in batches[:3]:
                static_x.copy_(xb)
                static_y.copy_(yb)
                eager_step(model, opt, static_x, static_y)
        torch.kiln.current_stream().wait_stream(s)
        for xb, yb in batches[:3]:
            eager_step(ref_model, ref_opt, xb.to(dev), yb.to(dev))

        g = torch.kiln.KilnGraph()
        opt.zero_grad(set_to_none=True)
        with torch.kiln.graph(g):
            static_loss = F.mse_loss(model(static_x), static_y)
            static_loss.backward()
            opt.step()
        for xb, yb in batches[3:]:
            static_x.copy_(xb)
            static_y.copy_(yb)
            g.replay()
            ref_loss = eager_step(ref_model, ref_opt, xb.to(dev), yb.to(dev))
            assert_same(static_loss, ref_loss.cpu())
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert_same(p, q.detach().cpu())
            assert_same(p.grad, q.grad.cpu())


def test_random_ops_draw_anew_per_replay_as_eager_would():
    x = torch.ones(1000, device="kiln")

    def body(t):
        return F.dropout(t, 0.5) + torch.randn(1000, device="kiln")

    warm_up(body, x)  # on another stream: the capture's first draw waits for it on the host
    g = torch.kiln.KilnGraph()
    with torch.kiln.graph(g):
        out = body(x)
        # Eager random work on another stream during the capture still works.
        with torch.kiln.stream(torch.kiln.default_stream()):
            eager_during_capture = torch.rand(4, device="kiln")
    assert eager_during_capture.cpu().shape == (4,)
    torch.kiln.manual_seed(123)
    g.replay()
    first = out.cpu()
    g.replay()
    second = out.cpu()
    assert not torch.equal(first, second)
    # The same generator state, the same ops eagerly: the same draws.
    torch.kiln.manual_seed(123)
    assert_same(body(x).cpu(), first)
    assert_same(body(x).cpu(), second)
    # Deterministic given the seed.
    torch.kiln.manual_seed(123)
    g.replay()
    assert_same(out, first)


def test_item_during_capture_raises_names_the_op_and_invalidates():
    x = torch.ones(8, device="kiln")
    warm_up(lambda t: (t + 1).sum(), x)
    g = torch.kiln.KilnGraph()
    with pytest.raises(RuntimeError, match=r"aten::_local_scalar_dense: operation not permitted "
                                           r"when stream is capturing"):
        with torch.kiln.graph(g):
            (x + 1).sum().item()
    assert not torch.kiln.is_current_stream_capturing()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()
    # The capture stream and the graph object work again.
    with torch.kiln.graph(g):
        y = x + 1
    g.replay()
    assert_same(y, torch.full((8,), 2.0))


@pytest.mark.parametrize("sync", ["device", "stream", "uncaptured_wait", "host_copy"])
def test_waits_and_cross_stream_work_during_capture_invalidate(sync):
    x = torch.ones(8, device="kiln")
    warm_up(lambda t: t * 2, x)
    s = torch.kiln.Stream()
    other = next(t for t in (torch.kiln.Stream() for _ in range(8)) if t != s)
    if sync == "uncaptured_wait":
        with torch.kiln.stream(other):
            torch.kiln._sleep(200)  # uncaptured work, pending during the capture
    g = torch.kiln.KilnGraph()
    with torch.kiln.stream(s):
        g.capture_begin()
        y = x * 2
        with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
            if sync == "device":
                torch.kiln.synchronize()
            elif sync == "stream":
                s.synchronize()
            elif sync == "uncaptured_wait":
                s.wait_stream(other)  # a graph cannot wait for uncaptured work
            else:
                x.copy_(torch.zeros(8))
        with pytest.raises(RuntimeError, match="invalidated"):
            g.capture_end()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()
    # Other streams, and the stream itself, work normally afterwards.
    with torch.kiln.stream(s):
        z = x * 2
    s.synchronize()
    assert_same(z, torch.full((8,), 2.0))
    del y


def test_capture_on_default_stream_and_bad_modes_are_refused():
    g = torch.kiln.KilnGraph()
    with pytest.raises(RuntimeError, match="must be captured on a non-default stream"):
        g.capture_begin()
    with pytest.raises(RuntimeError, match="capture_error_mode"):
        with torch.kiln.graph(g, capture_error_mode="sloppy"):
            pass
    assert not torch.kiln.is_current_stream_capturing()


def test_replay_of_an_empty_or_reset_graph():
    g = torch.kiln.KilnGraph()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.pool()
    with pytest.warns(UserWarning, match="kiln graph is empty"):
        with torch.kiln.graph(g):
            pass
    g.replay()  # an empty graph replays as a no-op
    g.reset()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()
    x = torch.ones(4, device="kiln")
    warm_up(lambda t: t + 1, x)
    with torch.kiln.graph(g):
        y = x + 1
    with pytest.raises(RuntimeError, match="already owns a captured graph"):
        with torch.kiln.graph(g):
            pass
    g.replay()
    assert_same(y, torch.full((4,), 2.0))


def test_nested_capture_is_refused():
    outer, inner = torch.kiln.KilnGraph(), torch.kiln.KilnGraph()
    # torch.kiln.graph synchronizes the device on entry (as torch.cuda.graph
    # does), which a capture underway refuses.
    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
        with torch.kiln.graph(outer):
            with torch.kiln.graph(inner):
                pass
    assert not torch.kiln.is_current_stream_capturing()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        outer.replay()
    # capture_begin on a stream that is already capturing.
    s = torch.kiln.Stream()
    with torch.kiln.stream(s):
        outer.capture_begin()
        with pytest.raises(RuntimeError, match="already capturing"):
            inner.capture_begin()
        with pytest.warns(UserWarning, match="empty"):
            outer.capture_end()
    outer.replay()


def test_graphs_share_a_memory_pool():
    x = torch.randn(256, device="kiln")
    warm_up(lambda t: (t + 1) * 3, x)
    pool = torch.kiln.graph_pool_handle()
    g1, g2 = torch.kiln.KilnGraph(), torch.kiln.KilnGraph()
    with torch.kiln.graph(g1, pool=pool):
        y1 = x + 1
    with torch.kiln.graph(g2, pool=g1.pool()):
        y2 = y1 * 3
    assert g1.pool() == g2.pool() == pool
    for _ in range(2):
        data = torch.randn(256)
        x.copy_(data)
        g1.replay()
        g2.replay()
        assert_same(y2, (data + 1) * 3)


@pytest.mark.parametrize("release", ["reset", "del"])
def test_memory_of_a_graph_is_freed_by_reset_or_del(release):
    x = torch.randn(1 << 16, device="kiln")
    warm_up(lambda t: (t * 2).exp() + 1, x)
    torch.kiln.synchronize()
    torch.kiln.empty_cache()
    base_allocated = torch.kiln.memory_allocated()
    base_reserved = torch.kiln.memory_reserved()
    g = torch.kiln.KilnGraph()
    with torch.kiln.graph(g):
        out = (x * 2).exp() + 1
    g.replay()
    assert torch.kiln.memory_allocated() > base_allocated
    torch.kiln.empty_cache()  # the pool stays while the graph holds it
    g.replay()
    assert_same(out, (x.cpu() * 2).exp() + 1)
    del out
    if release == "reset":
        g.reset()
    else:
        del g
    torch.kiln.synchronize()
    assert torch.kiln.memory_allocated() == base_allocated
    torch.kiln.empty_cache()
    assert torch.kiln.memory_reserved() == base_reserved


def test_kernel_error_inside_a_replay_surfaces_at_synchronize():
    src = torch.randn(10, 3, device="kiln")
    idx = torch.zeros(2, dtype=torch.long, device="kiln")
    warm_up(lambda a, b: a.index_select(0, b), src, idx)
    g = torch.kiln.KilnGraph()
    with torch.kiln.graph(g):
        out = src.index_select(0, idx)
    idx.fill_(100)
    g.replay()
    with pytest.raises((IndexError, RuntimeError), match="index"):
        torch.kiln.synchronize()
    idx.fill_(1)
    g.replay()
    assert_same(out, src.cpu()[[1, 1]])


def test_first_call_layout_check_during_capture_asks_for_a_warm_up():
    # roll checks its meta kernel synchronously on its first call with each
    # layout class (here int16, rank 3, unseen so far in this process).
    x = torch.ones(2, 3, 4, dtype=torch.int16, device="kiln")
    g = torch.kiln.KilnGraph()
    with pytest.raises(RuntimeError, match=r"aten::roll: operation not permitted when stream is "
                                           r"capturing: .*warm-up"):
        with torch.kiln.graph(g):
            torch.roll(x, 1, 0)
    warm_up(lambda t: torch.roll(t, 1, 0), x)
    with torch.kiln.graph(g):
        y = torch.roll(x, 1, 0)
    g.replay()
    assert_same(y, torch.roll(x.cpu(), 1, 0))


def test_capture_and_replay_with_launch_blocking():
    code = textwrap.dedent("""
        import torch, torch_kiln
        x = torch.arange(8.0, device="kiln")
        y = x * 2 + 1                      # warm-up
        g = torch.kiln.KilnGraph()
        with torch.kiln.graph(g):
            y = x * 2 + 1
        x.fill_(1.0)
        g.replay()
        assert torch.equal(y.cpu(), torch.full((8,), 3.0)), y.cpu()
        print("ok")
    """)
    result = run_python(code, {"KILN_LAUNCH_BLOCKING": "1"}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_replay_is_one_device_task_in_the_profiler():
    x = torch.ones(64, device="kiln")
    warm_up(lambda t: (t + 1) * 2, x)
    g = torch.kiln.KilnGraph()
    with torch.kiln.graph(g):
        y = (x + 1) * 2
    nodes = g.num_nodes()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        g.replay()
        torch.kiln.synchronize()
    names = [e.name for e in prof.events() if e.device_type == DeviceType.PrivateUse1]
    assert names.count(f"kiln graph ({nodes} nodes)") == 1, names
    assert_same(y, torch.full((64,), 4.0))


def test_a_compiled_function_captured_in_a_graph_replays_its_kernels(fresh_compile):
    fn = torch.compile(lambda a, b: (a.sin() * b + 1).relu().sum(1))
    a = torch.randn(32, 16, device="kiln")
    b = torch.randn(32, 16, device="kiln")
    fn(a, b)  # compiles, and warms up
    g = torch.kiln.KilnGraph()
    with torch.kiln.graph(g):
        out = fn(a, b)
    assert g.num_nodes() >= 1
    for _ in range(2):
        a.copy_(torch.randn(32, 16))
        g.replay()
        assert_same(out, fn(a, b).cpu())  # the compiled kernels, called directly


def test_torch_accelerator_graph_is_a_kiln_graph():
    x = torch.ones(8, device="kiln")
    warm_up(lambda t: t * 2 + 1, x)
    g = torch.accelerator.Graph()
    with pytest.raises(RuntimeError, match="must be captured on a non-default stream"):
        g.capture_begin()
    s = torch.kiln.Stream()
    with torch.kiln.stream(s):
        with g:  # captures on the current stream
            y = x * 2 + 1
        x.fill_(2.0)
        g.replay()
        result = y.clone()
    s.synchronize()
    assert_same(result, torch.full((8,), 5.0))
    assert isinstance(g.pool(), tuple)


@pytest.mark.parametrize("device", DEVICES)
def test_make_graphed_callables_forward_and_backward_match_eager(device):
    with torch.kiln.device(device):
        dev = f"kiln:{device}"
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                     torch.nn.Linear(16, 4)).to(dev)
        reference = copy.deepcopy(module)

        def fn(a, b):
            return (a * b).tanh(), a - b

        sample = torch.randn(5, 8, device=dev, requires_grad=True)
        fn_samples = (torch.randn(3, device=dev, requires_grad=True),
                      torch.randn(3, device=dev, requires_grad=True))
        graphed_module, graphed_fn = torch.kiln.make_graphed_callables(
            (module, fn), ((sample,), fn_samples))
        assert graphed_module is module
        for _ in range(3):
            data = torch.randn(5, 8)
            x, rx = data.to(dev).requires_grad_(), data.to(dev).requires_grad_()
            out = graphed_module(x)
            out.square().sum().backward()
            ref = reference(rx)
            ref.square().sum().backward()
            assert_same(out, ref.detach().cpu())
            assert_same(x.grad, rx.grad.cpu())
            for p, q in zip(module.parameters(), reference.parameters()):
                assert_same(p.grad, q.grad.cpu())
                p.grad = q.grad = None
            a, b = torch.randn(3), torch.randn(3)
            ga, gb = a.to(dev).requires_grad_(), b.to(dev).requires_grad_()
            t, d = graphed_fn(ga, gb)
            (t.sum() + d.sum()).backward()
            ra, rb = a.clone().requires_grad_(), b.clone().requires_grad_()
            rt, rd = fn(ra, rb)
            (rt.sum() + rd.sum()).backward()
            assert_same(t, rt.detach())
            assert_same(d, rd.detach())
            assert_same(ga.grad, ra.grad)
            assert_same(gb.grad, rb.grad)
        # In eval mode (not the mode at capture) the module runs eagerly.
        module.eval()
        reference.eval()
        data = torch.randn(2, 8).to(dev)  # another batch size: only eager can run it
        assert_same(module(data).detach(), reference(data).detach().cpu())


def test_make_graphed_callables_rejects_non_tensor_args_and_hooked_modules():
    with pytest.raises(TypeError, match="only contain tensors"):
        torch.kiln.make_graphed_callables(lambda a, n: a * n, (torch.ones(2, device="kiln"), 3))
    module = torch.nn.Linear(2, 2).to("kiln")
    module.register_forward_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match="must not have hooks"):
        torch.kiln.make_graphed_callables(module, (torch.ones(1, 2, device="kiln"),))


# ---------------------------------------------------------------- found by a fresh user

SEED_IN_CAPTURE = "set_current_seed can be called during stream capture only if new seed is " \
                  "the same as the original seed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["torch.kiln.manual_seed", "torch.manual_seed",
                                  "generator.manual_seed"])
def test_a_new_seed_during_capture_raises_as_on_cuda(device, form):
    # A capture records kernels, not host calls: a reseed inside it used to
    # take effect once, at capture, and never at replay.
    from torch_kiln.kiln.random import _default_generator

    gen = _default_generator(device)
    own = torch.Generator(device=f"kiln:{device}").manual_seed(123)  # a user's generator
    seed = {"torch.kiln.manual_seed": torch.kiln.manual_seed, "torch.manual_seed": torch.manual_seed,
            "generator.manual_seed": own.manual_seed}[form]
    with torch.kiln.device(device):
        warm_up(lambda: torch.randn(4, device="kiln"))
        torch.kiln.manual_seed(123)
        g = torch.kiln.KilnGraph()
        with pytest.raises(RuntimeError, match=SEED_IN_CAPTURE):
            with torch.kiln.graph(g):
                seed(0)
        assert not torch.kiln.is_current_stream_capturing()
        assert gen.initial_seed() == 123 and own.initial_seed() == 123
        # The current seed again is a no-op, allowed (as CUDA).
        with torch.kiln.graph(g):
            seed(123)
            y = torch.randn(4, device="kiln")
        torch.kiln.manual_seed(123)
        g.replay()
        first = y.cpu()
        torch.kiln.manual_seed(123)
        assert_same(torch.randn(4, device="kiln"), first)


@pytest.mark.parametrize("form", ["torch.kiln.set_rng_state", "generator.set_state",
                                  "torch.kiln.seed"])
def test_setting_the_generator_state_during_capture_raises(form):
    from torch_kiln.kiln.random import _default_generator

    gen = _default_generator(0)
    state = gen.get_state()
    call = {"torch.kiln.set_rng_state": lambda: torch.kiln.set_rng_state(state),
            "generator.set_state": lambda: gen.set_state(state),
            "torch.kiln.seed": torch.kiln.seed}[form]
    g = torch.kiln.KilnGraph()
    with pytest.raises(RuntimeError, match="Cannot call KilnGeneratorImpl::(set_state|seed) "
                                           "during kiln graph capture"):
        with torch.kiln.graph(g):
            call()
    assert not torch.kiln.is_current_stream_capturing()
    call()  # outside a capture it works


def test_graphed_callable_arguments_must_match_the_sample_args():
    module = torch.nn.Linear(8, 4).to("kiln")
    x = torch.randn(5, 8, device="kiln")
    graphed = torch.kiln.make_graphed_callables(module, (x,))
    expected = r"argument 0 must be a torch.float32 tensor of shape \(5, 8\) on kiln:0, like its " \
               r"sample arg .*, got a torch."
    for bad, given in [(torch.randn(3, 8, device="kiln"), r"float32 tensor of shape \(3, 8\) on kiln:0"),
                       (torch.randn(1, 8, device="kiln"),  # used to broadcast silently
                        r"float32 tensor of shape \(1, 8\) on kiln:0"),
                       (torch.randn(5, 8, device="kiln", dtype=torch.float64),
                        r"float64 tensor of shape \(5, 8\) on kiln:0"),
                       (torch.randn(5, 8), r"float32 tensor of shape \(5, 8\) on cpu"),
                       (torch.randn(5, 8, device="kiln:1"),
                        r"float32 tensor of shape \(5, 8\) on kiln:1")]:
        with pytest.raises(ValueError, match=expected + given):
            graphed(bad)
    with pytest.raises(TypeError, match=r"takes 1 tensor argument\(s\), like its sample_args, "
                                        r"got 2"):
        graphed(x, x)
    f = torch.kiln.make_graphed_callables(lambda a, b: a * b,
                                          (torch.ones(4, device="kiln", requires_grad=True),
                                           torch.ones(4, device="kiln", requires_grad=True)))
    with pytest.raises(TypeError, match=r"takes 2 tensor argument\(s\), like its sample_args, "
                                        r"got 1"):
        f(torch.ones(4, device="kiln"))
    # The right arguments still work.
    x2 = torch.randn(5, 8, device="kiln")
    assert_same(graphed(x2).detach(), F.linear(x2, module.weight, module.bias).detach().cpu())
    a, b = torch.randn(4, device="kiln"), torch.randn(4, device="kiln")
    assert_same(f(a, b).detach(), (a * b).cpu())


def test_graphing_non_kiln_sample_args_raises():
    # Nothing on the CPU is captured: the graphed callable used to warn and
    # return the capture-time output for every input.
    with pytest.raises(RuntimeError, match="sample_args must be kiln tensors .*got tensors on "
                                           "cpu"):
        torch.kiln.make_graphed_callables(torch.nn.Linear(4, 2), (torch.zeros(3, 4),))


@pytest.mark.parametrize("pool", [5, "pool", (1,), (1, 2.0)])
def test_a_bad_pool_raises_a_type_error_naming_what_pool_must_be(pool):
    g = torch.kiln.KilnGraph()
    with pytest.raises(TypeError, match=r"pool must be None or a pool token \(a tuple of two ints "
                                        r"from torch.kiln.graph_pool_handle\(\)"):
        with torch.kiln.graph(g, pool=pool):
            pass
    assert not torch.kiln.is_current_stream_capturing()
    assert torch.kiln.current_stream() == torch.kiln.default_stream()


@pytest.mark.parametrize("device", [0, 1])
@pytest.mark.parametrize("pool", [(123456789, 0), (0, 987654321), (7, 7)])
def test_a_made_up_pool_token_raises_naming_where_tokens_come_from(pool, device):
    with torch.kiln.device(device):
        g = torch.kiln.KilnGraph()
        with pytest.raises(ValueError, match=r"pool \(\d+, \d+\) is not a memory pool kiln made. "
                                             r"Pass None .*graph_pool_handle\(\), another graph's "
                                             r"pool\(\) or a torch.kiln.MemPool's id"):
            with torch.kiln.graph(g, pool=pool):
                pass
        assert not torch.kiln.is_current_stream_capturing()
        assert torch.kiln.current_stream() == torch.kiln.default_stream()
        # The graph is still usable with a real token.
        x = torch.ones(16, device="kiln")
        warm_up(lambda t: t * 2, x)
        handle = torch.kiln.graph_pool_handle()
        with torch.kiln.graph(g, pool=handle):
            y = x * 2
        g.replay()
        assert g.pool() == handle
        assert_same(y, torch.full((16,), 2.0))


def test_a_made_up_pool_token_is_refused_by_capture_begin_and_accelerator_graph_too():
    side = torch.kiln.Stream()
    with torch.kiln.stream(side):
        with pytest.raises(ValueError, match="is not a memory pool kiln made"):
            torch.kiln.KilnGraph().capture_begin(pool=(424242, 0))
        with pytest.raises(ValueError, match="is not a memory pool kiln made"):
            torch.accelerator.Graph(pool=(424242, 0)).capture_begin()
        assert not torch.kiln.is_current_stream_capturing()


def test_pool_tokens_are_numbered_as_cudas():
    handle = torch.kiln.graph_pool_handle()
    assert handle[0] > 0 and handle[1] == 0  # graph pools: (n, 0)
    x = torch.ones(16, device="kiln")
    warm_up(lambda t: t + 1, x)
    g = torch.kiln.KilnGraph()
    with torch.kiln.graph(g):
        x + 1
    own = g.pool()
    assert own[0] > handle[0] and own[1] == 0
    pool = torch.kiln.MemPool()
    assert pool.id[0] == 0 and pool.id[1] > 0  # user pools: (0, n)


def test_an_error_in_the_body_does_not_also_warn_the_graph_is_empty():
    import warnings

    torch.kiln.set_per_process_memory_fraction(0.001)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(torch.OutOfMemoryError, match="Kiln out of memory"):
                with torch.kiln.graph(torch.kiln.KilnGraph()):
                    torch.empty(64 * 1024 * 1024, device="kiln")
    finally:
        torch.kiln.set_per_process_memory_fraction(1.0)
    assert not [w for w in caught if "graph is empty" in str(w.message)]
    assert not torch.kiln.is_current_stream_capturing()


@pytest.mark.parametrize("device", DEVICES)
def test_pinned_host_copies_are_captured_and_each_replay_copies_anew(device):
    """Note [Host copies in a capture]: non_blocking copies with pinned host
    memory are recorded; each replay reads the pinned input and writes the
    pinned output anew (a float64 output converts on the device)."""
    with torch.kiln.device(device):
        dev = f"kiln:{device}"
        w_cpu = torch.randn(16, 16)
        w = w_cpu.to(dev)
        host_in = torch.randn(16, 16).pin_memory()
        host_out = torch.empty(16, 16).pin_memory()
        host_out64 = torch.empty(16, 16, dtype=torch.float64).pin_memory()
        x = torch.empty(16, 16, device=dev)

        def step():
            x.copy_(host_in, non_blocking=True)
            y = elementwise_and_matmul(x, w)
            host_out.copy_(y, non_blocking=True)
            host_out64.copy_(y, non_blocking=True)

        warm_up(step)
        g = torch.kiln.KilnGraph()
        with torch.kiln.graph(g):
            step()
        assert g.num_nodes() >= 6
        for _ in range(3):
            new = torch.randn(16, 16)
            host_in.copy_(new)  # the device is idle: the pinned input may change
            g.replay()
            torch.kiln.synchronize()
            expected = elementwise_and_matmul(new, w_cpu)
            assert_same(host_out, expected)
            assert_same(host_out64, expected.double())


@pytest.mark.parametrize("copy", ["pageable_to_kiln", "pageable_from_kiln", "blocking_pinned",
                                  "converting_pinned_source"])
def test_host_copies_a_capture_cannot_record_raise_naming_pinned_memory(copy):
    x = torch.ones(8, device="kiln")
    warm_up(lambda t: t * 2, x)
    pinned = torch.ones(8).pin_memory()
    s = torch.kiln.Stream()
    g = torch.kiln.KilnGraph()
    with torch.kiln.stream(s):
        g.capture_begin()
        y = x * 2
        with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"
                                               ".*pin_memory"):
            if copy == "pageable_to_kiln":
                x.copy_(torch.zeros(8), non_blocking=True)
            elif copy == "pageable_from_kiln":
                torch.empty(8).copy_(x, non_blocking=True)
            elif copy == "blocking_pinned":
                x.copy_(pinned)
            else:
                # float64 to float32 would be converted on the host, once
                x.copy_(pinned.double().pin_memory(), non_blocking=True)
        with pytest.raises(RuntimeError, match="invalidated"):
            g.capture_end()
    del y
