"""torch.compile(mode="reduce-overhead") on kiln: Inductor's graphs captured
into kiln graphs and replayed (torch_kiln/compiler/inductor/reduce_overhead.py,
Note [Kiln graphs for reduce-overhead]).

Replays run the very kernels the default mode launches, so results are
compared bit for bit with mode="default" (same seed, same inputs). Graphs
are small (g++ compiles each kernel); one Inductor cache directory serves the
whole module, and Dynamo and the counters are reset around each test."""

import copy
import gc
import warnings

import pytest
import torch
import torch.nn as nn
import torch._dynamo
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from torch_kiln.compiler.inductor import reduce_overhead

DEVICES = [0, 1]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("inductor-cache")


@pytest.fixture(autouse=True)
def fresh(cache_dir, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
    torch._dynamo.reset()
    reduce_overhead.reset_stats()
    yield
    torch._dynamo.reset()
    gc.collect()


def stats():
    return reduce_overhead.get_stats()


def same(a, b):
    a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b), (a - b).abs().max()


def close(actual, expected):
    """Against eager kiln: Inductor's fused kernels round differently (sin, exp...)."""
    assert actual.device.type == "kiln"
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=1e-5, atol=1e-6)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)


def train(model, mode, device, steps, stream=None, backend="inductor"):
    """`steps` training steps (forward, backward, SGD step); per-step losses and the parameters."""
    compiled = torch.compile(model, mode=mode, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(8, 16, generator=gen).to(device)
        torch.manual_seed(step)
        loss = compiled(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("device", DEVICES)
def test_training_loop_is_bit_identical_to_default_mode(device):
    dev = f"kiln:{device}"
    torch.manual_seed(0)
    model = MLP().to(dev)
    twin = copy.deepcopy(model)
    with torch.kiln.device(device):
        losses, params = train(model, "reduce-overhead", dev, steps=6)
        graphed = stats()
        reference_losses, reference_params = train(twin, None, dev, steps=6)
    assert losses == reference_losses
    for p, q in zip(params, reference_params):
        same(p, q)
    # Step 0 warms the forward and backward up, step 1 captures both, every
    # later step replays them. The backward's saved forward input (x) has a
    # new address each step: it is captured once more, copied from then on.
    assert graphed["warmup_runs"] == 2
    assert graphed["graphs_captured"] == 3
    assert graphed["graph_replays"] == 2 * 5
    assert graphed["eager_runs"] == 0 and graphed["skips"] == {}
    assert all(p.device == torch.device(dev) for p in model.parameters())


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_inference_replays_give_default_modes_results(grad_mode):
    torch.manual_seed(0)
    model = MLP().to("kiln").eval()
    graphed = torch.compile(model, mode="reduce-overhead")
    default = torch.compile(copy.deepcopy(model))
    with grad_mode():
        for _ in range(4):
            x = torch.randn(8, 16, device="kiln")
            same(graphed(x), default(x))
    assert stats()["warmup_runs"] == 1
    assert stats()["graphs_captured"] == 1
    assert stats()["graph_replays"] == 3


def device_tasks(fn, *args):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        fn(*args)
        torch.kiln.synchronize()
    return [e.name for e in prof.events() if e.device_type == DeviceType.PrivateUse1]


def test_a_replay_launches_one_graph_instead_of_the_kernels():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4)).to("kiln")
    graphed = torch.compile(model, mode="reduce-overhead")
    default = torch.compile(copy.deepcopy(model))
    x = torch.randn(8, 16, device="kiln")
    with torch.no_grad():
        for _ in range(3):
            graphed(x)
            default(x)
        default_tasks = device_tasks(default, x)
        replay_tasks = device_tasks(graphed, x)
    graphs = [n for n in replay_tasks if n.startswith("kiln graph (")]
    # One graph launch, plus the copy of the one non-static input (x) into its placeholder.
    assert len(graphs) == 1, replay_tasks
    assert len(replay_tasks) == 2, replay_tasks
    assert len(default_tasks) >= 5, default_tasks  # three mm and the generated kernels
    nodes = int(graphs[0].split("(")[1].split()[0])
    assert nodes == len(default_tasks)


def test_an_output_overwritten_by_a_later_replay_raises_cudas_error():
    fn = torch.compile(lambda x: (x * 2).sin(), mode="reduce-overhead")
    xs = [torch.randn(64, device="kiln") for _ in range(4)]
    with torch.no_grad():
        fn(xs[0])  # warm-up
        kept = fn(xs[1]).clone()  # captured; cloned outside torch.compile: stays valid
        y2 = fn(xs[2])
        y3 = fn(xs[3])  # a new call starts a new generation: y2's memory is reused
    with pytest.raises(RuntimeError, match="accessing tensor output of kiln graphs that has been "
                                           "overwritten by a subsequent run"):
        y2.cpu()
    with pytest.raises(RuntimeError, match="overwritten by a subsequent run"):
        y2 + 1
    close(y3, (xs[3] * 2).sin())
    close(kept, (xs[1] * 2).sin())


def test_cudagraph_mark_step_begin_marks_the_iterations():
    fn = torch.compile(lambda x: x.cos() + 1, mode="reduce-overhead")
    xs = [torch.randn(32, device="kiln") for _ in range(6)]
    try:
        for x in xs[:2]:
            torch.compiler.cudagraph_mark_step_begin()
            fn(x)  # warm-up, capture
        torch.compiler.cudagraph_mark_step_begin()
        a = fn(xs[2])
        # Same iteration (no mark_step_begin): `a` is still in use, so this
        # call does not overwrite it; it runs without its graph, with a warning.
        with pytest.warns(UserWarning, match="still alive in the same step"):
            b = fn(xs[3])
        close(a, xs[2].cos() + 1)
        close(b, xs[3].cos() + 1)
        torch.compiler.cudagraph_mark_step_begin()
        c = fn(xs[4])  # a new iteration: replays, and `a` is overwritten
        with pytest.raises(RuntimeError, match="overwritten by a subsequent run"):
            a.sum()
        close(c, xs[4].cos() + 1)
        close(b, xs[3].cos() + 1)  # the eager call's output is an ordinary tensor
        assert stats()["eager_runs"] == 1
    finally:
        torch._dynamo.reset()  # clears mark_step_begin's counter


def test_new_static_shapes_record_new_graphs():
    fn = torch.compile(lambda x: x.exp().sum(0), mode="reduce-overhead", dynamic=False)
    with torch.no_grad():
        for shape in [(4, 8), (4, 8), (4, 8), (6, 8), (6, 8), (6, 8), (4, 8)]:
            x = torch.randn(shape, device="kiln")
            close(fn(x), x.exp().sum(0))
    assert stats()["graphs_captured"] == 2
    assert stats()["graph_replays"] == 5


def test_dynamic_shapes_record_one_graph_per_distinct_size():
    fn = torch.compile(lambda x: (x * x).sum(1), mode="reduce-overhead", dynamic=True)
    compiled_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for n in [3, 3, 3, 5, 5, 7, 7]:
            x = torch.randn(n, 4, device="kiln")
            close(fn(x), (x * x).sum(1))
    # One compiled graph, three kiln graphs.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled_before + 1
    assert stats()["graphs_captured"] == 3
    assert stats()["graph_replays"] == 4


def call_three_times(fn, make_args, expected_fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            args = make_args()
            expected = expected_fn(*[a.clone() for a in args])
            close(fn(*args), expected)
    skips = [str(w.message) for w in caught if "mode='reduce-overhead'" in str(w.message)]
    assert len(skips) == 1, skips
    assert stats()["graphs_captured"] == 0
    return skips[0]


def test_cpu_tensor_inputs_run_without_graphs_with_one_warning():
    fn = torch.compile(lambda x, c: x * 2 + c.to("kiln"), mode="reduce-overhead")
    message = call_three_times(
        fn, lambda: (torch.randn(8, device="kiln"), torch.randn(8)), lambda x, c: x * 2 + c.to("kiln"))
    assert "skipping cudagraphs due to cpu device" in message


def test_mutated_inputs_run_without_graphs_with_one_warning():
    def bump(x):
        x.add_(1)
        return x * 2

    fn = torch.compile(bump, mode="reduce-overhead")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(8, device="kiln")
            before = x.clone()
            out = fn(x)
            close(x, before + 1)  # the caller's tensor is mutated, as in eager
            close(out, (before + 1) * 2)
    skips = [str(w.message) for w in caught if "mode='reduce-overhead'" in str(w.message)]
    assert len(skips) == 1, skips
    assert "skipping cudagraphs due to mutated inputs" in skips[0]
    assert stats()["graphs_captured"] == 0


def test_data_dependent_ops_run_without_graphs_with_one_warning():
    def nonzero_rows(x):
        return x.nonzero() * 2

    fn = torch.compile(nonzero_rows, mode="reduce-overhead")
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        message = call_three_times(fn, lambda: (torch.randn(8, 4, device="kiln"),), nonzero_rows)
    assert "disabling cudagraphs due to incompatible op aten.nonzero" in message


def test_an_item_inductor_keeps_on_the_device_is_captured_and_replayed():
    # Inductor fuses x.sum().item() into the kernel that uses it (no host
    # read), so this graph is captured, and each replay reads its new input.
    def scale(x):
        return x * x.sum().item()

    fn = torch.compile(scale, mode="reduce-overhead")
    with torch._dynamo.config.patch(capture_scalar_outputs=True), torch.no_grad():
        for _ in range(4):
            x = torch.randn(8, device="kiln")
            close(fn(x), scale(x))
    assert stats()["graphs_captured"] == 1 and stats()["graph_replays"] == 3


def test_a_synchronization_in_the_graph_runs_without_graphs_with_one_warning():
    def synced(x):
        torch.kiln.synchronize()
        return x * 3

    fn = torch.compile(synced, mode="reduce-overhead")
    message = call_three_times(fn, lambda: (torch.randn(8, device="kiln"),), synced)
    assert "skipping cudagraphs due to a synchronization in the graph" in message


@torch.library.custom_op("kiln_test_reduce_overhead::scale_by_host_max", mutates_args=())
def scale_by_host_max(x: torch.Tensor) -> torch.Tensor:
    return x * float(x.abs().max())  # reads a device value on the host


@scale_by_host_max.register_fake
def _(x):
    return torch.empty_like(x)


def test_work_a_capture_refuses_runs_without_graphs_with_one_warning():
    def fn_(x):
        return scale_by_host_max(x.sin()) + 1

    fn = torch.compile(fn_, mode="reduce-overhead")
    message = call_three_times(fn, lambda: (torch.randn(8, device="kiln"),), fn_)
    assert "skipping cudagraphs due to a kiln graph capture error" in message
    assert "operation not permitted when stream is capturing" in message


def _side_stream_fn(side, w):
    def on_side_stream(x):
        side.wait_stream(torch.kiln.current_stream())
        with torch.kiln.stream(side):
            y = (x @ w).relu() @ w
        torch.kiln.current_stream().wait_stream(side)
        return y + 1
    return on_side_stream


@pytest.mark.parametrize("device", DEVICES)
def test_cross_stream_work_in_the_graph_is_captured_and_replays_match_eager(device):
    # The side stream's work joins the capture: while it is captured, Dynamo's
    # stream registry names the capture stream as the current one (without
    # that, replays from the third call on gave other values). Static input
    # addresses, as on CUDA: Inductor counts the inputs a wait_stream orders
    # as mutated, and graphs mutating non-static inputs are not recorded.
    dev = f"kiln:{device}"
    with torch.kiln.device(device):
        w = torch.randn(128, 128, device=dev)
        x = torch.empty(128, 128, device=dev)
        torch._dynamo.mark_static_address(w)
        torch._dynamo.mark_static_address(x)
        eager = _side_stream_fn(torch.kiln.Stream(), w)
        fn = torch.compile(eager, mode="reduce-overhead")
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(5):
                x.copy_(torch.randn(128, 128))
                same(fn(x), eager(x))
    assert not [w for w in caught if "skipping cudagraphs" in str(w.message)]
    assert stats()["graphs_captured"] == 1 and stats()["graph_replays"] == 4


def test_cross_stream_work_on_fresh_inputs_runs_without_graphs_with_cudas_warning():
    eager = _side_stream_fn(torch.kiln.Stream(), torch.randn(128, 128, device="kiln"))
    fn = torch.compile(eager, mode="reduce-overhead")
    message = call_three_times(fn, lambda: (torch.randn(128, 128, device="kiln"),), eager)
    assert "skipping cudagraphs due to mutated inputs" in message


@pytest.mark.parametrize("device", DEVICES)
def test_replays_on_a_side_stream_are_ordered_there(device):
    dev = f"kiln:{device}"
    with torch.kiln.device(device):
        fn = torch.compile(lambda x, w: (x @ w).relu() + x, mode="reduce-overhead")
        w = torch.randn(64, 64, device=dev)
        s = torch.kiln.Stream()
        outs, inputs = [], []
        with torch.no_grad(), torch.kiln.stream(s):
            for _ in range(4):
                x = torch.randn(64, 64, device=dev)  # written on s, just before the call
                outs.append(fn(x, w).clone())
                inputs.append(x)
        s.synchronize()
    for x, out in zip(inputs, outs):
        assert out.device == torch.device(dev)
        close(out, (x.cpu() @ w.cpu()).relu() + x.cpu())
    assert stats()["graph_replays"] == 3


def test_memory_returns_to_baseline_when_the_function_and_graphs_are_freed():
    torch.kiln.synchronize()
    gc.collect()
    torch.kiln.empty_cache()
    baseline_allocated = torch.kiln.memory_allocated()
    baseline_reserved = torch.kiln.memory_reserved()
    model = MLP().to("kiln")
    losses, _ = train(model, "reduce-overhead", "kiln", steps=4)
    assert stats()["graph_replays"] > 0
    del model
    torch._dynamo.reset()
    gc.collect()
    torch.kiln.synchronize()
    torch.kiln.empty_cache()
    assert torch.kiln.memory_allocated() == baseline_allocated
    assert torch.kiln.memory_reserved() == baseline_reserved


def test_kiln_backend_with_reduce_overhead_matches_its_default_mode():
    torch.manual_seed(0)
    model = MLP().to("kiln")
    twin = copy.deepcopy(model)
    losses, params = train(model, "reduce-overhead", "kiln", steps=4, backend="kiln")
    assert stats()["graph_replays"] == 2 * 3
    reference_losses, reference_params = train(twin, None, "kiln", steps=4, backend="kiln")
    assert losses == reference_losses
    for p, q in zip(params, reference_params):
        same(p, q)


def test_kiln_backend_rejects_an_unknown_mode():
    fn = torch.compile(lambda x: x + 1, backend="kiln", mode="fastest")
    with pytest.raises(Exception, match="fastest"):
        fn(torch.randn(4, device="kiln"))
