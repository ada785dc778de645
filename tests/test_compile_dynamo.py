"""torch.compile on kiln with Dynamo's stock backends (issue 11, Dynamo half).

backend="eager" runs Dynamo's FX graph op by op and backend="aot_eager"
AOTAutograd's forward and backward graphs: both run kiln's eager kernels, so
every result is compared with eager kiln *bit for bit* (assert_same), or,
for models with recurrent cells, with the same compiled model on the CPU
(see compiled_on_cpu). What
makes this work: kiln's own kernels trace under FakeTensorMode with symbolic
sizes (Note [Kiln kernels under FakeTensorMode]), kiln's DeviceInterface is
registered with Dynamo (Note [Registering with Dynamo lazily]), and
torch.kiln's stream and device calls trace like torch.cuda's (Note
[torch.kiln under torch.compile]).
"""

import copy
import multiprocessing
import sys
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend, EagerAndRecordGraphs
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from conftest import assert_same, run_python
from quick_shard import rotate

BACKENDS = ("eager", "aot_eager")
aten = torch.ops.aten


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def assert_same_tree(actual, expected, strides=True):
    """assert_same over tensors nested in tuples/lists (kiln against kiln),
    and the same devices and (unless strides=False) strides."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor)
        assert actual.device == expected.device, (actual.device, expected.device)
        if strides and actual.numel() > 1:
            assert actual.stride() == expected.stride(), (actual.stride(), expected.stride())
        assert_same(actual, expected.cpu())
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same_tree(a, e, strides)
    elif expected is None:
        assert actual is None
    else:
        assert actual == expected


def on(device, tree):
    """`tree` (tensors nested in tuples/lists) moved to `device`."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, (tuple, list)):
        return type(tree)(on(device, t) for t in tree)
    return tree


def compiled_on_cpu(run):
    """`run("cpu")` after a Dynamo reset: the reference for compiled kiln
    where eager is not one. Kiln composes recurrent cells as the CPU does
    (RecurrentLayers.cc), with in-place ops on strided chunks of the gates;
    aot_eager functionalizes those into out-of-place ops, whose kernels
    round otherwise (compiled CPU differs from eager CPU there by ~4e-9
    too), so compiled kiln is compared with compiled CPU."""
    torch._dynamo.reset()
    try:
        return run("cpu")
    finally:
        torch._dynamo.reset()


class Zoo(nn.Module):
    """Every kind of kernel kiln registers itself, in one model: convolution
    (convolution_overrideable and its backward), batch norm, dropout (kiln's
    autograd kernel), SDPA (kiln's fused-kernel choice), a GRU cell and an
    LSTM cell (kiln's compositions of them, RecurrentLayers.cc)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 4 * 4, 16)
        self.qkv = nn.Linear(16, 48)
        self.gru = nn.GRUCell(16, 16)
        self.lstm = nn.LSTMCell(16, 16)

    def forward(self, img):
        h = F.max_pool2d(F.relu(self.bn(self.conv(img))), 2)
        h = F.dropout(self.fc(h.flatten(1)), 0.25, self.training)
        q, k, v = self.qkv(h).view(h.shape[0], 3, 2, 8).unbind(1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).flatten(1)
        g = self.gru(a, h)
        return self.lstm(g, (h, g))[0]


def training_step(model, opt, img, target):
    opt.zero_grad()
    loss = F.mse_loss(model(img), target)
    loss.backward()
    opt.step()
    return loss.detach()


def run_training(model, compile_kwargs, device, steps, batch_sizes=(4,)):
    """Losses and final parameters of `steps` SGD steps per batch size, with
    the same seed and data whether or not `model` is compiled."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fwd = torch.compile(model, **compile_kwargs) if compile_kwargs is not None else model
    losses = []
    for n in batch_sizes:
        for step in range(steps):
            g = torch.Generator().manual_seed(step + 100 * n)
            img = torch.randn(n, 3, 8, 8, generator=g).to(device)
            target = torch.randn(n, 16, generator=g).to(device)
            torch.manual_seed(step)  # dropout masks
            losses.append(training_step(fwd, opt, img, target))
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("backend,dynamic,device", rotate(
    [(backend, dynamic) for backend in BACKENDS for dynamic in (False, True)], ["kiln:0", "kiln:1"]))
def test_training_steps_match_compiled_cpu(backend, dynamic, device):
    torch.manual_seed(0)
    model = Zoo()
    cpu_model = copy.deepcopy(model)
    kwargs = dict(backend=backend, dynamic=dynamic)
    losses, params = run_training(model.to(device), kwargs, device, steps=2)
    ref_losses, ref_params = compiled_on_cpu(
        lambda cpu: run_training(cpu_model, kwargs, cpu, steps=2))
    assert_same_tree(losses, on(device, ref_losses))
    assert_same_tree(params, on(device, ref_params))
    assert all(p.device == torch.device(device) for p in params)


@pytest.mark.parametrize("backend", BACKENDS)
def test_recurrent_layers_forward_backward(backend):
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True).to("kiln")
    gru = nn.GRU(16, 8, batch_first=True).to("kiln")

    def f(x):
        return gru(lstm(x)[0])[0].sum()

    x = torch.randn(3, 5, 8, device="kiln", requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    ref = f(x_ref)
    ref.backward()
    ref_grads = [p.grad.clone() for p in [*lstm.parameters(), *gru.parameters()]] + [x_ref.grad]
    for p in [*lstm.parameters(), *gru.parameters()]:
        p.grad = None
    out = torch.compile(f, backend=backend, dynamic=True)(x)
    out.backward()
    assert_same(out, ref.cpu())
    assert_same_tree([p.grad for p in [*lstm.parameters(), *gru.parameters()]] + [x.grad],
                     ref_grads)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_inference(backend, mode):
    torch.manual_seed(0)
    model = Zoo().to("kiln").eval()
    img = torch.randn(2, 3, 8, 8, device="kiln")
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    cpu_model = copy.deepcopy(model).cpu()
    with context():
        out = torch.compile(model, backend=backend, fullgraph=True)(img)

    def on_cpu(cpu):
        with context():
            return torch.compile(cpu_model, backend=backend, fullgraph=True)(img.to(cpu))

    assert not out.requires_grad
    assert_same(out, compiled_on_cpu(on_cpu))


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_break_runs_each_piece_compiled(backend):
    counter = CompileCounterWithBackend(backend)

    def f(x, w):
        y = F.scaled_dot_product_attention(x, x, x) @ w
        torch._dynamo.graph_break()
        return F.dropout(y.relu(), 0.5).sum(-1)

    x = torch.randn(2, 4, 8, device="kiln", requires_grad=True)
    w = torch.randn(8, 8, device="kiln", requires_grad=True)
    torch.manual_seed(3)
    ref = f(x, w)
    ref.sum().backward()
    ref_grads = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    torch.manual_seed(3)
    out = torch.compile(f, backend=counter)(x, w)
    out.sum().backward()
    assert counter.frame_count == 2
    assert_same(out, ref.detach().cpu())
    assert_same_tree((x.grad, w.grad), ref_grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_recompiles_on_new_static_shape_and_not_when_dynamic(backend):
    def f(x):
        return F.conv2d(x, torch.ones(2, 3, 3, 3, device=x.device)).relu()

    static = CompileCounterWithBackend(backend)
    g = torch.compile(f, backend=static, dynamic=False)
    dynamic = CompileCounterWithBackend(backend)
    h = torch.compile(f, backend=dynamic, dynamic=True)
    for n in (2, 3, 5):
        x = torch.randn(n, 3, 6, 6, device="kiln")
        assert_same(g(x), f(x).cpu())
        assert_same(h(x), f(x).cpu())
    assert static.frame_count == 3
    assert dynamic.frame_count == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_automatic_dynamic_shapes(backend):
    """dynamic=None (the default): the second shape recompiles once with
    symbolic sizes, later shapes reuse that graph."""
    torch.manual_seed(0)
    model = Zoo()
    cpu_model = copy.deepcopy(model)
    counter = CompileCounterWithBackend(backend)

    def outputs(compiled, device):
        results = []
        for n in (2, 3, 5, 7):
            img = torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(n))
            torch.manual_seed(n)
            results.append(compiled(img.to(device)).detach().cpu())
        return results

    kiln = outputs(torch.compile(model.to("kiln"), backend=counter), "kiln")
    assert counter.frame_count == 2
    cpu = compiled_on_cpu(lambda d: outputs(torch.compile(cpu_model, backend=backend), d))
    for k, c in zip(kiln, cpu):
        assert_same(k, c)


def copies(x, host):
    """Host<->device and device<->device copies, in both directions."""
    a = (x * 2).cpu() + host               # kiln -> host
    b = host.to(x.device) * x              # host -> kiln
    c = x.to("kiln:1").mul(3).to(x.device)  # kiln:0 -> kiln:1 -> kiln:0
    d = x.to("kiln:1", non_blocking=True).sum()
    return a, b, c, d


def storage_ops(x):
    """resize_, set_, record_stream and the view kernels kiln registers."""
    y = x.new_empty(0)
    y.resize_(4, 2)
    y.fill_(1.5)
    z = torch.empty(0, device=x.device)
    z.set_(x)
    x.record_stream(torch.kiln.current_stream())
    v = x.view(-1).as_strided((2, 2), (1, 2), 1) + x.reshape(x.numel())[:4].view(2, 2)
    return y + x.sum(), z * 2, v


def per_output_grads(outputs, inputs):
    """Gradients of each output's sum separately: one sum over outputs on two
    devices accumulates in an order that varies from run to run in eager
    (the autograd engine has a thread per device), not bit-reproducible.
    Unused inputs get zeros (AOTAutograd's backward returns zeros for them,
    eager autograd None)."""
    return [torch.autograd.grad(t.sum(), inputs, retain_graph=True, materialize_grads=True)
            for t in outputs]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_copies_and_storage_kernels(backend, dynamic):
    x = torch.randn(4, 6, device="kiln", requires_grad=True)
    host = torch.randn(4, 6, requires_grad=True)
    ref = copies(x, host)
    ref_grads = per_output_grads(ref, (x, host))
    out = torch.compile(copies, backend=backend, dynamic=dynamic, fullgraph=True)(x, host)
    grads = per_output_grads(out, (x, host))
    assert [t.device for t in out] == [t.device for t in ref]
    assert_same_tree(out, ref)
    # AOTAutograd returns a sum's gradient materialised, eager an expanded view.
    assert_same_tree(grads, ref_grads, strides=False)
    y = torch.randn(3, 8, device="kiln")
    assert_same_tree(torch.compile(storage_ops, backend=backend, dynamic=dynamic)(y.clone()),
                     storage_ops(y.clone()))


# --- Kiln's own kernels under FakeTensorMode ----------------------------------

def symbolic_inputs(mode, *shapes):
    """Fake kiln tensors with a fresh symbol for every size."""
    result = []
    for i, shape in enumerate(shapes):
        with unset_fake_temporarily():
            real = torch.randn(shape, device="kiln")
        context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * len(shape))
        result.append(mode.from_tensor(real, symbolic_context=context,
                                       source=torch._dynamo.source.ConstantSource(f"x{i}")))
    return result


# Each case: input shapes, the call, and the same call on real kiln tensors
# gives the expected shapes. These operators have no Meta kernel in PyTorch
# (or are reached with FakeTensors themselves, SDPA's choice and dropout).
FAKE_CASES = {
    "gru_cell": ([(3, 48), (3, 48), (3, 16), (48,), (48,)],
                 lambda a, b, h, bi, bh: aten._thnn_fused_gru_cell(a, b, h, bi, bh)),
    "gru_cell_backward": ([(3, 16), (3, 80)],
                          lambda g, ws: aten._thnn_fused_gru_cell_backward(g, ws, True)),
    "convolution_overrideable": ([(2, 3, 8, 8), (4, 3, 3, 3), (4,)],
                                 lambda x, w, b: aten.convolution_overrideable(
                                     x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)),
    "convolution_backward_overrideable": ([(2, 4, 6, 6), (2, 3, 8, 8), (4, 3, 3, 3)],
                                          lambda g, x, w: aten.convolution_backward_overrideable(
                                              g, x, w, [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                              [True, True, True])),
    "conv_transpose_backward_overrideable": ([(2, 4, 10, 10), (2, 6, 8, 8), (6, 2, 3, 3)],
                                             lambda g, x, w: aten.convolution_backward_overrideable(
                                                 g, x, w, [1, 1], [0, 0], [1, 1], True, [0, 0], 2,
                                                 [True, True, True])),
    "_copy_from": ([(3, 4), (3, 4)], lambda a, b: aten._copy_from(a, b)),
    "_copy_from_and_resize": ([(3, 4), (0,)], lambda a, b: aten._copy_from_and_resize(a, b)),
    "record_stream": ([(5,)], lambda a: (aten.record_stream(a, torch.kiln.current_stream()), a)[1]),
    "native_dropout": ([(3, 4)], lambda a: aten.native_dropout(a, 0.5, True)),
    "dropout": ([(3, 4)], lambda a: F.dropout(a, 0.5)),
    "sdpa": ([(2, 2, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16), (8, 8)],
             lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)),
    "mish_backward": ([(3, 4), (3, 4)], lambda g, a: aten.mish_backward(g, a)),
    "native_channel_shuffle": ([(2, 6, 3)], lambda a: aten.native_channel_shuffle(a, 3)),
}


def flat_tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in flat_tensors(v)] if isinstance(value, (tuple, list)) else []


@pytest.mark.parametrize("name", sorted(FAKE_CASES))
def test_kiln_kernels_trace_with_symbolic_sizes(name):
    shapes, call = FAKE_CASES[name]
    with unset_fake_temporarily():
        torch.manual_seed(0)
        expected = flat_tensors(call(*[torch.randn(s, device="kiln") for s in shapes]))
    mode = FakeTensorMode(shape_env=ShapeEnv())
    inputs = symbolic_inputs(mode, *shapes)
    torch.kiln.synchronize()
    torch.kiln.clear_op_tracking()
    with mode:
        result = flat_tensors(call(*inputs))
    # FakeTensorMode ran no kiln kernel (no silent fallback to the device).
    assert torch.kiln.get_executed_ops() == {}
    assert len(result) == len(expected)
    for fake, real in zip(result, expected):
        assert fake.device == real.device and fake.dtype == real.dtype
        def hint(sizes):
            return [mode.shape_env.size_hint(s.node.expr) if isinstance(s, torch.SymInt) else s
                    for s in sizes]

        assert hint(fake.shape) == list(real.shape), (hint(fake.shape), real.shape)
        if real.numel() > 1:
            assert hint(fake.stride()) == list(real.stride()), (hint(fake.stride()), real.stride())
    if name not in ("record_stream", "native_channel_shuffle"):
        assert any(isinstance(s, torch.SymInt) and s.node.expr.free_symbols
                   for t in result for s in t.shape), "sizes were specialised"


# Operators kiln registers that have no fake path in PyTorch on any device:
# _nested_tensor_from_mask (nn.TransformerEncoder's fast path, Note
# [nn.TransformerEncoder's nested fast path on kiln]) makes a nested tensor
# whose sizes come from the mask's values; CPU and CUDA have no Meta kernel
# for it either, so tracing it fails the same way on every device.
NO_FAKE_PATH_IN_PYTORCH = ("aten::_nested_tensor_from_mask",)


def test_every_kiln_kernel_has_a_fake_path():
    """Every aten operator kiln registers a PrivateUse1 kernel for has a Meta
    kernel, a composite kernel that serves Meta, or a decomposition
    FakeTensorMode uses (_has_compatible_shallow_copy_type's is kiln's own
    kernel, which also serves AutogradPrivateUse1 and reads metadata only:
    checked on FakeTensors below)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    ops = [op for op in torch._C._dispatch_get_registrations_for_dispatch_key("PrivateUse1")
           if op.startswith("aten::")]
    assert len(ops) > 20
    missing = [op for op in ops if op not in NO_FAKE_PATH_IN_PYTORCH and not any(
        has(op, key) for key in ("Meta", "CompositeExplicitAutograd", "CompositeImplicitAutograd"))]
    assert missing == []
    for op in NO_FAKE_PATH_IN_PYTORCH:  # still true of PyTorch, else drop it from the list
        assert not any(has(op, key) for key in ("Meta", "CompositeExplicitAutograd",
                                                "CompositeImplicitAutograd")), op
    mode = FakeTensorMode(shape_env=ShapeEnv())
    a, b = symbolic_inputs(mode, (3, 4), (2,))
    with mode:
        assert torch._has_compatible_shallow_copy_type(a, b)


# --- Streams, events, synchronize inside compiled code --------------------------

def stream_program(x, side):
    """Every stream/event/device call a CUDA program makes, on kiln."""
    cur = torch.kiln.current_stream()
    side.wait_stream(cur)
    with torch.kiln.stream(side):
        y = x * 2
    cur.wait_stream(side)
    start = torch.kiln.Event()
    start.record()
    z = y + torch.kiln.current_device()
    side.wait_event(start)
    done = side.record_event()
    cur.wait_event(done)
    torch.kiln.default_stream(x.device).wait_stream(side)
    torch.kiln.synchronize()
    torch.kiln.synchronize(x.device)
    torch.accelerator.synchronize()
    return z.relu()


@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_calls_trace_without_graph_break(backend):
    side = torch.kiln.Stream()
    x = torch.randn(64, device="kiln")
    ref = stream_program(x, side)
    counter = CompileCounterWithBackend(backend)
    out = torch.compile(stream_program, backend=counter, fullgraph=True)(x, side)
    assert counter.frame_count == 1
    assert_same(out, ref.cpu())


def test_stream_calls_become_stream_ops_in_the_graph():
    recorder = EagerAndRecordGraphs()
    side = torch.kiln.Stream(device="kiln:1")
    x = torch.randn(8, device="kiln:1")
    with torch.kiln.device(1):
        torch.compile(stream_program, backend=recorder, fullgraph=True)(x, side)
    code = recorder.graphs[0].code
    # As for CUDA: side-effecting streams:: ops, the device index explicit.
    assert "torch.ops.streams.synchronize_device('kiln', 1)" in code
    assert "torch.ops.streams.wait_stream" in code
    assert "torch.ops.streams.record_event" in code
    assert "torch.ops.streams.wait_event" in code
    assert "torch_kiln" not in code  # nothing calls kiln's Python API at run time


def test_stream_ops_survive_aot_autograd():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def forward_compiler(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    side = torch.kiln.Stream()
    x = torch.randn(8, device="kiln")
    out = torch.compile(stream_program, backend=aot_autograd(fw_compiler=forward_compiler),
                        fullgraph=True)(x, side)
    assert_same(out, stream_program(x, side).cpu())
    (code,) = graphs
    assert "torch.ops.streams.synchronize_device.default('kiln', 0)" in code
    assert "subgraph_wait_stream" in code and "torch.ops.streams.record_event" in code


def test_stream_created_in_compiled_code_and_set_stream():
    def f(x):
        s = torch.kiln.Stream()
        prev = torch.kiln.current_stream()
        s.wait_stream(prev)
        torch.kiln.set_stream(s)
        y = x + 1
        torch.kiln.set_stream(prev)
        prev.wait_stream(s)
        return y

    x = torch.randn(16, device="kiln")
    out = torch.compile(f, backend="eager", fullgraph=True)(x)
    assert_same(out, (x + 1).cpu())
    assert torch.kiln.current_stream() == torch.kiln.default_stream()


def test_current_device_guard_recompiles_per_device():
    counter = CompileCounterWithBackend("eager")

    def f(x):
        return x + torch.kiln.current_device()

    g = torch.compile(f, backend=counter, fullgraph=True)
    x = torch.zeros(2, device="kiln")
    assert g(x).cpu().tolist() == [0.0, 0.0]
    with torch.kiln.device(1):
        assert g(x).cpu().tolist() == [1.0, 1.0]
    assert counter.frame_count == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_context_in_compiled_code_breaks_the_graph_and_is_correct(backend):
    """`with torch.kiln.device(i):` is not traced (Note [Registering with
    Dynamo lazily] says why): Dynamo falls back to running the frame
    eagerly, so factories inside the block land on kiln:i as in eager."""
    counter = CompileCounterWithBackend(backend)

    def f(x):
        y = x + 1
        with torch.kiln.device(1):
            z = torch.ones(2, device="kiln")
            index = torch.kiln.current_device()
        return y * 2, z, index

    x = torch.zeros(2, device="kiln")
    y, z, index = torch.compile(f, backend=counter)(x)
    assert (y.device, z.device, index) == (torch.device("kiln:0"), torch.device("kiln:1"), 1)
    assert torch.kiln.current_device() == 0
    assert_same(y, torch.full((2,), 2.0))


def test_bad_stream_arguments_in_compiled_code_raise_like_eager():
    def f(x):
        with torch.kiln.stream("not a stream"):
            return x + 1

    with pytest.raises(TypeError, match="expected a torch.kiln.Stream"):
        f(torch.ones(1, device="kiln"))
    with pytest.raises(TypeError, match="expected a torch.kiln.Stream"):
        torch.compile(f, backend="eager")(torch.ones(1, device="kiln"))


# --- The DeviceInterface --------------------------------------------------------

def test_device_interface_is_registered_for_kiln():
    from torch._dynamo.device_interface import DeviceGuard, get_interface_for_device
    from torch_kiln.compiler.device_interface import KilnInterface

    for name in ("kiln", "kiln:0", "kiln:1", torch.device("kiln:1")):
        assert get_interface_for_device(name) is KilnInterface
    di = KilnInterface
    assert di.is_available() and di.device_count() == torch.kiln.device_count() == 2
    assert di.current_device() == 0
    with DeviceGuard(di, 1):
        assert di.current_device() == 1 == torch.kiln.current_device()
        assert di.current_stream() == torch.kiln.current_stream(1)
    assert di.current_device() == 0
    assert di.get_compute_capability() == 10
    assert di.get_device_properties(1).total_memory == torch.kiln.get_device_properties(1).total_memory
    assert di.get_raw_stream(0) == torch.kiln.current_stream(0).kiln_stream != 0
    assert di.is_bf16_supported() and di.is_dtype_supported(torch.bfloat16)
    assert not di.is_triton_capable()
    assert issubclass(di.Stream, torch.Stream) and issubclass(di.Event, torch.Event)
    # streams.py's traced default_stream() names the device type by number.
    assert torch.kiln.default_stream().device_type == torch.kiln.streams._KILN_DEVICE_TYPE
    side = torch.kiln.Stream()
    with di.stream(side):
        assert torch.kiln.current_stream() == side
    di._set_stream_by_id(side.stream_id, side.device_index, side.device_type)
    assert torch.kiln.current_stream() == side
    di.set_stream(torch.kiln.default_stream())
    x = torch.ones(1024, device="kiln")
    assert di.memory_allocated(0) == torch.kiln.memory_allocated(0) >= x.nbytes
    di.synchronize()
    with pytest.raises(ValueError, match="Expected a kiln device"):
        di.Worker.get_device_properties("cpu")
    with pytest.raises(RuntimeError, match="Invalid device kiln:7"):
        di.Worker.get_device_properties(7)


def _worker_in_forked_child(queue):
    from torch_kiln.compiler.device_interface import KilnInterface
    try:
        props = KilnInterface.Worker.get_device_properties("kiln:1")
        queue.put(("ok", props.name, KilnInterface.Worker.current_device()))
        try:
            torch.kiln.synchronize()
            queue.put(("kiln usable in child",))
        except RuntimeError as e:
            queue.put(("kiln refused", str(e)))
    except BaseException as e:  # report, do not hang the parent
        queue.put(("error", repr(e)))


def test_worker_answers_in_a_forked_child_without_starting_kiln():
    from torch_kiln.compiler.device_interface import KilnInterface
    torch.ones(1, device="kiln").cpu()  # kiln running in the parent
    # What Inductor's async compile does before forking its workers.
    expected = KilnInterface.Worker.get_device_properties("kiln:1").name
    KilnInterface.Worker.set_device(1)
    try:
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_worker_in_forked_child, args=(queue,))
        child.start()
        first, second = queue.get(timeout=60), queue.get(timeout=60)
        child.join(timeout=60)
    finally:
        from torch._dynamo.device_interface import caching_worker_current_devices
        caching_worker_current_devices.pop("kiln", None)
    assert first == ("ok", expected, 1)
    assert second[0] == "kiln refused" and "forked after it was initialised" in second[1]


def test_import_torch_does_not_import_dynamo_and_registers_lazily():
    result = run_python(
        "import sys, torch\n"
        "assert 'torch._dynamo' not in sys.modules, 'import torch imported Dynamo'\n"
        "from torch._dynamo.device_interface import get_interface_for_device\n"
        "print(get_interface_for_device('kiln:1').__name__)\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "KilnInterface"


def test_registers_at_once_when_dynamo_was_imported_first():
    result = run_python(
        "import torch._dynamo.device_interface as di\n"
        "assert 'kiln' not in di.device_interfaces\n"
        "import torch_kiln\n"
        "print(di.get_interface_for_device('kiln').__name__)\n",
        env_overrides={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "KilnInterface"


# --- Inputs that must not break it ------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_devices_raise_the_eager_device_error(backend):
    def f(x, y):
        return x + y

    x = torch.ones(3, device="kiln")
    for other in (torch.ones(3), torch.ones(3, device="kiln:1")):
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            f(x, other)
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            torch.compile(f, backend=backend)(x, other)
    # 0-dim CPU tensors are scalars, as in eager.
    scalar = torch.tensor(2.5)
    assert_same(torch.compile(f, backend=backend)(x, scalar), f(x, scalar).cpu())


def layouts():
    base = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    yield "non-contiguous", base.transpose(1, 3)
    yield "channels-last", base.contiguous(memory_format=torch.channels_last)
    yield "zero-size", torch.empty(2, 0, 4, 5)
    yield "expanded", torch.arange(5.).expand(2, 3, 4, 5)
    yield "storage-offset", base.reshape(-1)[7:7 + 60].view(3, 4, 5)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_input_layouts(backend, dynamic):
    def f(x):
        return (x * 2 + 1).sum(-1), x.relu().transpose(0, -1), torch.cat([x, x], 0)

    g = torch.compile(f, backend=backend, dynamic=dynamic)
    for name, host in layouts():
        x = host.to("kiln")
        if name == "expanded":
            x = torch.arange(5., device="kiln").expand(2, 3, 4, 5)
        elif name == "storage-offset":
            x = host._base.to("kiln").reshape(-1)[7:7 + 60].view(3, 4, 5)
        assert (x.stride(), x.storage_offset()) == (host.stride(), host.storage_offset()), name
        assert_same_tree(g(x), f(x))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float16, torch.bfloat16,
                                   torch.float64])
def test_dtypes(dtype):
    def f(x, y):
        return (x * y).sum(0), torch.where(x > 0, x, y), x.to(torch.float32).mean()

    host = torch.randn(4, 6) * 3
    x, y = host.to(dtype).to("kiln"), host.flip(0).to(dtype).to("kiln")
    for backend in BACKENDS:
        torch._dynamo.reset()
        assert_same_tree(torch.compile(f, backend=backend)(x, y), f(x, y))


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place_on_inputs_and_views_is_visible_to_the_caller(backend):
    def f(x, y):
        x.add_(1)
        y[1:].mul_(2)
        y.t()[0].zero_()
        return x.view(-1), y  # outputs aliasing the inputs

    host_x, host_y = torch.randn(3, 4), torch.randn(5, 6)
    ex, ey = host_x.to("kiln"), host_y.to("kiln")
    ref = f(ex, ey)
    cx, cy = host_x.to("kiln"), host_y.to("kiln")
    out = torch.compile(f, backend=backend)(cx, cy)
    assert_same(cx, ex.cpu())
    assert_same(cy, ey.cpu())
    assert_same_tree(out, ref)
    out[0][0] = 100.0  # the output aliases the caller's input
    assert cx[0, 0].item() == 100.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_under_autocast(backend, dtype):
    """Bit for bit as eager kiln under autocast, forward and backward, except
    SDPA's gradient with aot_eager: AOTAutograd traces SDPA's backward apart
    from the autocast region and it differs from eager in the last bits on
    the CPU as well (measured with PyTorch 2.13.0 on device="cpu"), so that
    one is compared to rounding."""
    def mlp(x, w):
        return (x @ w).relu().sum()

    def attention(x, w):
        return F.scaled_dot_product_attention(x @ w, x, x).relu().sum()

    def run(fn):
        torch.manual_seed(0)
        x = torch.randn(2, 8, 8, device="kiln")
        w = torch.randn(8, 8, device="kiln", requires_grad=True)
        with torch.autocast("kiln", dtype=dtype):
            out = fn(x, w)
        return out, torch.autograd.grad(out, w)[0]

    for fn in (mlp, attention):
        torch._dynamo.reset()
        out, grad = run(torch.compile(fn, backend=backend))
        ref_out, ref_grad = run(fn)
        assert out.dtype == ref_out.dtype == torch.float32  # sum runs in float32
        assert_same(out, ref_out.cpu())
        if fn is attention and backend == "aot_eager":
            torch.testing.assert_close(grad, ref_grad, rtol=0.02, atol=0.02)
        else:
            assert_same(grad, ref_grad.cpu())


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_ops_same_seed_same_results(backend):
    def f(x):
        return F.dropout(x, 0.5) + torch.rand_like(x) + torch.randn(3, device=x.device).sum()

    g = torch.compile(f, backend=backend)
    x = torch.randn(8, 8, device="kiln")
    runs = []
    for fn in (g, g, f):
        torch.manual_seed(7)
        runs.append(fn(x))
    assert_same(runs[0], runs[1].cpu())
    assert_same(runs[0], runs[2].cpu())  # and the same numbers as eager kiln


@pytest.mark.parametrize("backend", [*BACKENDS, "kiln"])
def test_rng_state_functions_run_outside_the_graph(backend):
    # As torch.cuda's: Dynamo graph-breaks at them and runs them eagerly
    # (OpInfo's seeded wrappers call them under no_dispatch()).
    from torch.testing._internal.common_utils import freeze_rng_state

    def f(x):
        with freeze_rng_state():
            torch.manual_seed(42)
            state = torch.kiln.get_rng_state()
            y = F.dropout(x, 0.5)
            torch.kiln.set_rng_state(state)
            return y + F.dropout(x, 0.5)  # the same mask again

    x = torch.ones(64, device="kiln")
    torch._dynamo.reset()
    assert_same(torch.compile(f, backend=backend)(x), f(x).cpu())


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_failure_in_compiled_code_surfaces_like_eager(backend):
    def f(x, i):
        return x[i] * 2

    g = torch.compile(f, backend=backend)
    x = torch.randn(8, 4, device="kiln")
    for _ in range(2):  # the first call may run synchronously (layout check)
        with pytest.raises(IndexError, match="aten::index.*out of bounds"):
            g(x, torch.tensor([0, 100], device="kiln"))
            torch.kiln.synchronize()
    i = torch.tensor([1, 3], device="kiln")
    assert_same(g(x, i), f(x, i).cpu())  # later work runs


def test_compiling_while_another_thread_runs_eager_kiln_work():
    stop = threading.Event()
    errors = []

    def eager_work():
        try:
            a = torch.randn(64, 64, device="kiln:1")
            expected = (a @ a).relu().sum(0).cpu()
            while not stop.is_set():
                assert_same((a @ a).relu().sum(0), expected)
        except BaseException as e:  # reported below
            errors.append(e)

    worker = threading.Thread(target=eager_work)
    worker.start()
    try:
        torch.manual_seed(0)
        model = Zoo()
        cpu_model = copy.deepcopy(model)
        losses, params = run_training(model.to("kiln"), dict(backend="aot_eager"), "kiln", steps=2)
    finally:
        stop.set()
        worker.join(timeout=60)
    assert not errors, errors
    reference = compiled_on_cpu(
        lambda cpu: run_training(cpu_model, dict(backend="aot_eager"), cpu, steps=2))
    assert_same_tree((losses, params), on("kiln", reference))


def test_out_of_memory_in_compiled_code_then_it_works():
    result = run_python(
        "import torch\n"
        "f = torch.compile(lambda x, n: x.new_ones(n, n) @ x.new_ones(n, n), backend='aot_eager')\n"
        "x = torch.ones(4, device='kiln')\n"
        "try:\n"
        "    f(x, 8192)\n"
        "    print('no error')\n"
        "except torch.OutOfMemoryError as e:\n"
        "    print('OOM', 'kiln:0' in str(e))\n"
        "print(f(x, 16).sum().item())\n",
        env_overrides={"KILN_DEVICE_MEMORY": "64MiB"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["OOM", "True", "4096.0"], result.stdout


def test_no_synchronizations_in_compiled_training_steps():
    """A compiled training step adds no synchronization. The first step of
    the process shows eager kiln's one-time layout checks (each op's first
    call per kind of input, see README); later steps show nothing."""
    torch.manual_seed(0)
    model = Zoo().to("kiln")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    img = torch.randn(4, 3, 8, 8, device="kiln")
    target = torch.randn(4, 16, device="kiln")
    for backend in BACKENDS:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        for step in range(3):
            torch.kiln.synchronize()
            torch.kiln.clear_op_tracking()
            training_step(compiled, opt, img, target)
            syncs = torch.kiln.get_sync_ops()
            assert all(op.endswith("(layout check)") for op in syncs), (backend, step, syncs)
            if step > 0:
                assert syncs == {}, (backend, step, syncs)


def test_kiln_devices_keep_their_index_through_compiled_code():
    def f(x):
        return x.new_zeros(3) + x.sum(), torch.ones(2, device=x.device)

    x = torch.randn(4, device="kiln:1")
    for backend in BACKENDS:
        torch._dynamo.reset()
        out = torch.compile(f, backend=backend, dynamic=True)(x)
        assert [t.device for t in out] == [torch.device("kiln:1")] * 2
        assert_same_tree(out, f(x))



@pytest.mark.parametrize("backend", ["aot_eager", "kiln"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
def test_compiled_dropout_draws_eagers_mask_in_every_layout(backend, layout, tmp_path, monkeypatch):
    """Kiln's dropout drew its noise with an in-place bernoulli_ on an
    empty_like of the input; functionalization turns that into bernoulli.p,
    whose result is contiguous, so for a channels-last input the compiled
    mask differed from eager's (Dropout.cc). Eager kiln also matches CPU."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.randn(4, 3, 6, 6)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":
        x = x.transpose(1, 3)
    kx = x.to("kiln")
    torch.manual_seed(5)
    expected = F.dropout(x, 0.3)
    torch.manual_seed(5)
    eager = F.dropout(kx, 0.3)
    torch._dynamo.reset()
    torch.manual_seed(5)
    compiled = torch.compile(lambda t: F.dropout(t, 0.3), backend=backend)(kx)
    torch._dynamo.reset()
    assert_same(eager, expected)
    assert_same(compiled, expected)


def _layout(x, layout):
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    return x.transpose(1, 3) if layout == "transposed" else x


@pytest.mark.parametrize("backend,layout,p", rotate(
    ["inductor", "aot_eager", "kiln"], ["contiguous", "channels_last", "transposed"], [0.1, 0.123]))
def test_compiled_dropout_is_compiled_cpus(backend, layout, p, fresh_compile):
    """Traced, kiln's dropout takes CPU's native_dropout decomposition
    (Note [Tracing kiln's eager compositions]). Before, Inductor's default
    drew the same numbers on both devices but kept `draw < 1 - p` on kiln
    and `draw > p` on the CPU: complementary masks, and a compiled GPT-2 at
    its default dropout trained to other losses than on the CPU. p=0.123 is
    a rate where native_dropout's `x * mask * (1 / (1 - p))` and eager's
    `x * (mask / (1 - p))` round differently (on both devices)."""
    x = _layout(torch.randn(4, 3, 6, 6), layout)
    results = {}
    for device in ("cpu", "kiln"):
        torch._dynamo.reset()
        leaf = x.clone().to(device).requires_grad_()
        compiled = torch.compile(lambda t: F.dropout(t, p) * 3, backend=backend)
        torch.manual_seed(5)
        out = compiled(leaf)
        out.backward(torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).to(device))
        results[device] = out, leaf.grad
    (cpu_out, cpu_grad), (kiln_out, kiln_grad) = results["cpu"], results["kiln"]
    assert_same(kiln_out, cpu_out)
    assert kiln_out.stride() == cpu_out.stride()
    assert_same(kiln_grad, cpu_grad)
    dropped = (cpu_out == 0).float().mean().item()
    assert 0 < dropped < 0.3, dropped


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
