"""torch.compile with Inductor on kiln (torch_kiln/compiler/inductor/).

Compiled results are compared with eager kiln (and, for the MLP, with
Inductor on CPU) within 1e-5 relative: Inductor fuses and reorders float
arithmetic, so compiled code is not bit-exact with eager. Inductor compiles
C++ with g++, which takes seconds per graph on a 2-core machine, so the
graphs here are few and small, and compiled functions are shared through
module-scoped fixtures; the order tests reuse one warmed-up function so that
no compilation runs while a stream is kept busy.

See Note [Compiled code runs in stream order] in
torch_kiln/compiler/inductor/__init__.py for what the order tests check.
"""

import copy
import importlib.util
import os
import re
import uuid

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch._dynamo
import torch._inductor.config

RTOL = 1e-5
ATOL = 1e-6


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.device == expected.device or expected.device.type == "cpu", (actual.device, expected.device)
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=RTOL, atol=ATOL)


def pointwise_and_reduction(a, b):
    return (a * b).relu().add(1.0).sum(dim=1), torch.sigmoid(a - b)


@pytest.fixture(scope="module")
def compiled_fn():
    """One compiled graph (pointwise + reduction) warmed up on kiln:0."""
    fn = torch.compile(pointwise_and_reduction)
    a = torch.randn(64, 32, device="kiln:0")
    b = torch.randn(64, 32, device="kiln:0")
    fn(a, b)
    torch.kiln.synchronize()
    return fn


def test_kiln_backend_is_listed():
    assert "kiln" in torch._dynamo.list_backends()


def test_matches_eager(compiled_fn):
    a = torch.randn(64, 32, device="kiln")
    b = torch.randn(64, 32, device="kiln")
    for actual, expected in zip(compiled_fn(a, b), pointwise_and_reduction(a, b)):
        assert actual.device == torch.device("kiln:0")
        assert_close(actual, expected)


def test_reads_inputs_written_by_queued_eager_work(compiled_fn):
    # The stream is busy (a sleep, then a chain of matmuls) when the compiled
    # function is called; its kernels must see what the queued work writes.
    a = torch.zeros(64, 32, device="kiln")
    b = torch.ones(64, 32, device="kiln")
    w = torch.randn(64, 64, device="kiln") / 8
    torch.kiln._sleep(200)
    c = torch.randn(64, 32, device="kiln")
    for _ in range(20):
        c = w @ c
    a.copy_(c)
    b.fill_(3.0)
    total, sig = compiled_fn(a, b)
    # The call returned while the stream is still busy: nothing waited.
    assert not torch.kiln.current_stream().query()
    assert_close(total, (c * 3.0).relu().add(1.0).sum(dim=1))
    assert_close(sig, torch.sigmoid(c - 3.0))


def test_outputs_feed_later_eager_work(compiled_fn):
    a = torch.randn(64, 32, device="kiln")
    b = torch.randn(64, 32, device="kiln")
    torch.kiln._sleep(100)
    total, sig = compiled_fn(a, b)
    later = (total * 2).cumsum(0)  # eager, queued after the compiled kernels
    sig.mul_(0.5)
    expected_total, expected_sig = pointwise_and_reduction(a, b)
    assert_close(later, (expected_total * 2).cumsum(0))
    assert_close(sig, expected_sig * 0.5)


def test_runs_on_the_current_side_stream(compiled_fn):
    a = torch.randn(64, 32, device="kiln")
    b = torch.randn(64, 32, device="kiln")
    default = torch.kiln.current_stream()
    side = torch.kiln.Stream()
    side.wait_stream(default)
    with torch.kiln.stream(side):
        torch.kiln._sleep(200)
        a2 = a * 2  # eager, on the side stream
        total, _ = compiled_fn(a2, b)
        assert not side.query()  # the compiled kernels are queued behind the sleep
    default.synchronize()
    default.wait_stream(side)
    assert_close(total + 1, (a * 2 * b).relu().add(1.0).sum(dim=1) + 1)


def test_inputs_on_kiln_1_give_outputs_on_kiln_1():
    fn = torch.compile(pointwise_and_reduction)
    a = torch.randn(16, 8, device="kiln:1")
    b = torch.randn(16, 8, device="kiln:1")
    fn(a, b)  # compile
    assert torch.kiln.current_device() == 0
    with torch.kiln.device(1):
        torch.kiln._sleep(200)
    b.fill_(2.0)  # queued on kiln:1's stream
    total, sig = fn(a, b)
    assert total.device == torch.device("kiln:1") and sig.device == torch.device("kiln:1")
    assert not torch.kiln.current_stream(1).query()
    expected_total, expected_sig = pointwise_and_reduction(a, b)
    assert_close(total, expected_total)
    assert_close(sig, expected_sig)


def test_dynamic_shapes():
    fn = torch.compile(lambda x, y: (x.exp() * y).sum(0) / x.shape[0], dynamic=True)
    for rows in (5, 9, 17):
        x = torch.randn(rows, 7, device="kiln")
        y = torch.randn(rows, 7, device="kiln")
        assert_close(fn(x, y), (x.exp() * y).sum(0) / rows)


@pytest.mark.parametrize("sync", ["torch.kiln.synchronize", "torch.accelerator.synchronize",
                                  "stream.synchronize"])
def test_synchronize_between_kernels_of_a_graph(sync):
    # A device-less extern call (streams.synchronize_device) between fused
    # kernels: the buffered kernel is launched before it, and the inputs it
    # reads are freed after it (Inductor emitted `del arg0_1` first, then the
    # launch: UnboundLocalError).
    def f(x):
        y = x + 1
        if sync == "torch.kiln.synchronize":
            torch.kiln.synchronize()
        elif sync == "torch.accelerator.synchronize":
            torch.accelerator.synchronize()
        else:
            torch.kiln.current_stream().synchronize()
        return y * 3

    torch._dynamo.reset()
    x = torch.randn(8, device="kiln")
    assert torch.equal(torch.compile(f)(x).cpu(), f(x).cpu())


def test_mutations_of_inputs_and_their_views_are_visible():
    def mutate(a, b):
        a.add_(b)
        a[0].mul_(3.0)
        return a.sum()

    fn = torch.compile(mutate)
    a = torch.randn(6, 5, device="kiln")
    b = torch.randn(6, 5, device="kiln")
    expected_a = a.clone()
    expected = mutate(expected_a, b)
    out = fn(a, b)
    assert_close(a, expected_a)
    assert_close(out, expected)


def test_kiln_and_cpu_tensors_raise_eagers_device_error():
    a = torch.randn(4, device="kiln")
    c = torch.randn(4)
    with pytest.raises(RuntimeError) as eager:
        a + c
    with pytest.raises(RuntimeError) as compiled:
        torch.compile(lambda x, y: x + y)(a, c)
    assert str(eager.value) in str(compiled.value)


def test_zero_dim_cpu_tensor_acts_as_a_scalar():
    fn = torch.compile(lambda x, s: x * s)
    x = torch.randn(8, device="kiln")
    s = torch.tensor(2.5)
    torch.kiln._sleep(100)
    out = fn(x, s)
    s.fill_(-1.0)  # after the call: the kernel must use the value at the call
    assert_close(out, x * 2.5)


def test_index_out_of_range_raises_at_synchronize_and_later_work_runs():
    fn = torch.compile(lambda x, i: x[i] * 2)
    x = torch.randn(8, device="kiln")
    good = fn(x, torch.tensor([1, 2], device="kiln"))
    assert_close(good, x[torch.tensor([1, 2], device="kiln")] * 2)
    bad = fn(x, torch.tensor([0, 9], device="kiln"))
    with pytest.raises(IndexError, match=r"in compiled graph .*index out of bounds"):
        torch.kiln.synchronize()
    with pytest.raises(RuntimeError, match="index out of bounds"):
        bad.cpu()  # its storage holds no result (Note [Results of failed kernels])
    again = fn(x, torch.tensor([7, 0], device="kiln"))
    assert_close(again, x[torch.tensor([7, 0], device="kiln")] * 2)


# Each: (name, fn(x, bad_index), what eager raises). x is (5, 3); bad_index
# holds a 9 (out of range) and has the shape the operator wants.
EAGER_INDEX_ERRORS = [
    ("gather", lambda x, i: torch.gather(x, 0, i.view(1, 3)), RuntimeError),
    ("scatter", lambda x, i: x.scatter(0, i.view(1, 3), 1.0), RuntimeError),
    ("index", lambda x, i: x[i] * 2, IndexError),
    ("index_select", lambda x, i: x.index_select(0, i), IndexError),
    ("embedding", lambda x, i: torch.nn.functional.embedding(i, x), IndexError),
    ("index_copy", lambda x, i: x.index_copy(0, i[:2], torch.ones_like(x[:2])), IndexError),
]


@pytest.mark.parametrize("name,fn,error", EAGER_INDEX_ERRORS, ids=[c[0] for c in EAGER_INDEX_ERRORS])
@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_index_out_of_range_raises_what_eager_raises(name, fn, error, device):
    """Note [Index errors of compiled kernels]: eager gather and scatter
    raise RuntimeError, indexing raises IndexError; the compiled
    kernel raises the same class (not a subclass of the other) at the
    synchronization, and the device works afterwards."""
    x = torch.randn(5, 3, device=device)
    bad = torch.tensor([0, 9, 1], device=device)
    with pytest.raises(error) as eager:
        fn(x, bad)
        torch.kiln.synchronize(device)
    torch._dynamo.reset()
    compiled = torch.compile(fn)
    with pytest.raises(error, match="index out of bounds") as raised:
        compiled(x, bad)
        torch.kiln.synchronize(device)
    assert type(raised.value) is type(eager.value), (name, raised.value)
    good = torch.tensor([0, 4, 1], device=device)
    assert_close(compiled(x, good), fn(x, good))


def test_launcher_rejects_bad_arguments_before_launching():
    from torch_kiln import _C

    # The entry address is never called: every check runs before the launch.
    kernel = _C._GeneratedKernel("kiln_test_kernel", 1, "rwi")
    kiln = torch.zeros(4, device="kiln")
    with pytest.raises(ValueError, match="argument 0 is on cpu, expected kiln:0"):
        kernel.launch(0, torch.zeros(4), kiln, 1)
    with pytest.raises(ValueError, match="argument 1 is on kiln:1, expected kiln:0"):
        kernel.launch(0, kiln, torch.zeros(4, device="kiln:1"), 1)
    with pytest.raises(TypeError, match="takes 3 arguments, got 2"):
        kernel.launch(0, kiln, kiln)
    with pytest.raises(TypeError, match="argument 2 must be an int"):
        kernel.launch(0, kiln, kiln, 1.5)
    with pytest.raises(ValueError, match="unknown argument kind"):
        _C._GeneratedKernel("kiln_test_kernel", 1, "rx")


# Models: forward and backward, compiled vs eager kiln (and Inductor on CPU).


def make_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def make_conv_net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(4 * 4 * 4, 10),
    )


def forward_backward(model, x):
    for p in model.parameters():
        p.grad = None
    out = model(x)
    out.square().mean().backward()
    return out, [p.grad for p in model.parameters()]


def compare_training(model, x, device):
    """Compiled vs eager forward and backward of copies of `model` on `device`."""
    eager_model = copy.deepcopy(model).to(device)
    compiled_model = copy.deepcopy(model).to(device)
    compiled = torch.compile(compiled_model)
    out, grads = forward_backward(compiled, x.to(device))
    expected_out, expected_grads = forward_backward(eager_model, x.to(device))
    assert out.device == torch.device(device)
    assert_close(out, expected_out)
    for grad, expected in zip(grads, expected_grads):
        assert grad.device == torch.device(device)
        assert_close(grad, expected)
    return compiled, out, grads


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_mlp_forward_backward(device):
    x = torch.randn(8, 16)
    compiled, out, grads = compare_training(make_mlp(), x, device)
    if device == "kiln:0":
        # The same model compiled for CPU by Inductor.
        cpu_out, cpu_grads = forward_backward(torch.compile(make_mlp()), x)
        assert_close(out, cpu_out)
        for grad, expected in zip(grads, cpu_grads):
            assert_close(grad, expected)


def test_conv_net_forward_backward():
    compare_training(make_conv_net(), torch.randn(2, 1, 8, 8), "kiln:0")


def test_no_grad_inference():
    model = make_mlp().to("kiln")
    compiled = torch.compile(model)
    x = torch.randn(8, 16, device="kiln")
    with torch.no_grad():
        out = compiled(x)
        expected = model(x)
    assert not out.requires_grad
    assert_close(out, expected)


def test_training_step_adds_no_synchronizations():
    torch.manual_seed(0)
    model = make_mlp().to("kiln")
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16, device="kiln")
    target = torch.randn(8, 4, device="kiln")

    def step():
        opt.zero_grad()
        F.mse_loss(compiled(x), target).backward()
        opt.step()

    step()  # warm-up: compiles forward and backward
    torch.kiln.synchronize()
    torch.kiln.clear_op_tracking()
    for _ in range(3):
        step()
    assert torch.kiln.get_sync_ops() == {}
    torch.kiln.synchronize()


def _char_gpt_module():
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "train_char_gpt.py")
    spec = importlib.util.spec_from_file_location("train_char_gpt_for_compile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_char_gpt_forward_backward():
    # The example's model as it is, scaled_dot_product_attention included
    # (it traces under fake tensors since the Dynamo half's fix).
    module = _char_gpt_module()
    torch.manual_seed(0)
    model = module.CharGPT(vocab=20, block_size=8, width=32, layers=1, heads=2)
    idx = torch.randint(0, 20, (2, 8))
    compare_training(model, idx, "kiln:0")


def test_codegen_is_part_of_the_cache_key(monkeypatch):
    from torch._dynamo.utils import counters

    from torch_kiln.compiler.inductor.cache_key import KilnCodegenPass

    def fn(x):
        return (x * 3).tanh()

    x = torch.randn(4, 4, device="kiln")
    with torch._inductor.config.patch(fx_graph_cache=True):
        torch.compile(fn)(x)
        torch._dynamo.reset()
        counters.clear()
        torch.compile(fn)(x)
        assert counters["inductor"]["fxgraph_cache_hit"] == 1
        # A different kiln code generator must not reuse that code (a fresh
        # id: the cache directory outlives this test).
        other = f"another kiln codegen {uuid.uuid4()}"
        monkeypatch.setattr(KilnCodegenPass, "uuid", lambda self: other)
        torch._dynamo.reset()
        counters.clear()
        assert_close(torch.compile(fn)(x), fn(x))
        assert counters["inductor"]["fxgraph_cache_hit"] == 0
        assert counters["inductor"]["fxgraph_cache_miss"] == 1


def test_cpp_wrapper_raises_a_clear_error():
    x = torch.randn(4, device="kiln")
    with torch._inductor.config.patch(cpp_wrapper=True):
        with pytest.raises(Exception, match="cpp_wrapper=True is not supported on kiln yet"):
            torch.compile(lambda t: t.cos() + 1)(x)


def test_out_of_memory_inside_a_compiled_graph():
    fn = torch.compile(lambda a: torch.cat([a * 2, a * 3, a * 4, a * 5, a * 6]))
    x = torch.randn(3 * 2**18, device="kiln:1")  # 3 MiB; the output needs 15 MiB
    expected = torch.cat([x * 2, x * 3, x * 4, x * 5, x * 6])
    fn(x)  # compiled and run once with no limit: the error below is the run's
    torch.kiln.synchronize(1)
    torch.kiln.empty_cache()
    total = torch.kiln.get_device_properties(1).total_memory
    limit = torch.kiln.memory_reserved(1) + 8 * 2**20
    try:
        torch.kiln.set_per_process_memory_fraction(limit / total, 1)
        with pytest.raises(torch.OutOfMemoryError, match="kiln:1"):
            fn(x)
    finally:
        torch.kiln.set_per_process_memory_fraction(1.0, 1)
    assert_close(fn(x), expected)  # the device and the compiled function work afterwards


def _column_sums(t):
    # A reduction over 8192 rows: Inductor splits it across threads (one
    # partial sum per thread) when it is compiled for two.
    return (t * 2).sum(0)


def test_a_new_thread_count_recompiles_and_matches_cpu(restore_threads):
    # Dynamo guards on torch.get_num_threads() (its global-state guard), so a
    # function compiled at 2 threads is compiled again at 3, for 3, on kiln
    # as on CPU: the same bits as CPU at each count.
    x = torch.randn(8192, 64, generator=torch.Generator().manual_seed(0))
    cpu_fn, kiln_fn = torch.compile(_column_sums), torch.compile(_column_sums)
    torch._dynamo.reset()
    for threads in (2, 3, 1):
        torch.set_num_threads(threads)
        assert torch.equal(kiln_fn(x.to("kiln")).cpu(), cpu_fn(x)), threads


def test_a_backward_run_at_more_threads_than_compiled_for_uses_the_compiled_count(restore_threads):
    # The backward graph is compiled with the forward, at 2 threads; run
    # after torch.set_num_threads(4) (no Dynamo guard on it), its column sum
    # keeps partial sums in an array of 2: it runs 2 threads, the same bits.
    def loss(x, w):
        return (x * w).sum()

    x = torch.randn(8192, 64, generator=torch.Generator().manual_seed(0)).to("kiln")
    grads = []
    for backward_threads in (2, 4):
        torch._dynamo.reset()
        torch.set_num_threads(2)
        w = torch.ones(64, device="kiln", requires_grad=True)
        out = torch.compile(loss)(x, w)
        torch.set_num_threads(backward_threads)
        out.backward()
        grads.append(w.grad.cpu())
    assert torch.equal(grads[1], grads[0])
    # Within float32 rounding of the exact column sums (n ulp of sum |x|).
    exact, magnitude = x.cpu().double().sum(0), x.cpu().double().abs().sum(0)
    assert ((grads[0].double() - exact).abs() <= 8192 * 2.0**-24 * magnitude).all()


def test_parallel_regions_are_capped_at_the_compile_time_count():
    # The cap is the safety net for a kernel run at more threads than it
    # keeps partial results for (its arrays have one slot per thread it was
    # generated for); regions Inductor already fixes are left alone.
    from torch_kiln.compiler.inductor.kernels import cap_parallel_threads

    source = ("{\n    #pragma omp parallel\n    {}\n"
              "    #pragma omp parallel num_threads(3)\n    {}\n"
              "    # pragma omp parallel\n}")
    capped = cap_parallel_threads(source, 2)
    assert capped.count("#pragma omp parallel num_threads(omp_get_max_threads() < 2 ? "
                        "omp_get_max_threads() : 2)") == 1
    assert "    #pragma omp parallel num_threads(3)\n" in capped
    assert "    # pragma omp parallel\n" in capped  # the GEMM template's, split by blocks


def test_kernels_are_built_with_gccs_loop_vectorizer(monkeypatch):
    # Note [Kiln's kernels keep GCC's loop vectorizer]: Inductor's own flags
    # turn GCC's loop vectorizer off; the kernel loader passes the flag that
    # turns it back on (after Inductor's, so it wins) to Inductor's C++ cache.
    import torch._inductor.async_compile as async_compile
    from torch._inductor.codecache import CppCodeCache
    from torch._inductor.cpp_builder import _is_gcc, get_cpp_compiler
    from torch_kiln.compiler.inductor import kernels

    if not _is_gcc(get_cpp_compiler()):
        pytest.skip("Inductor compiles with clang here, which it leaves vectorizing")
    passed = []

    def load(source, extra_flags=(), **kwargs):
        passed.append(tuple(extra_flags))
        raise RuntimeError("stop before compiling")

    monkeypatch.setattr(async_compile, "get_compile_threads", lambda: 1)
    monkeypatch.setattr(CppCodeCache, "load", load)
    with pytest.raises(RuntimeError, match="stop before compiling"):
        kernels.load_kernel(None, "k", "", 'extern "C" void kernel_kiln_entry(const int64_t*) {}')
    assert passed == [("-ftree-loop-vectorize",)]


def comparisons_and_elementwise(x, b):
    # Masks stored as bool (the loop the vectorizer speeds up), and
    # elementwise math whose vector body and scalar tail must keep their bits.
    y = x + b
    return y <= 0, x > 0.5, torch.where(y > 0, y.exp(), y * 2) / 3, y.sigmoid() * y, (y * y).sum(-1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_vectorized_kernels_keep_cpus_bits(restore_threads, threads, dtype):
    # Kiln builds Inductor's kernels with one more flag than CPU
    # (-ftree-loop-vectorize): same source, same bits, masks equal to eager.
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 1031, generator=g).to(dtype)  # odd sizes: every kernel has a scalar tail
    b = torch.randn(1031, generator=g).to(dtype)
    torch._dynamo.reset()
    cpu_out = torch.compile(comparisons_and_elementwise)(x, b)
    torch._dynamo.reset()
    kiln_out = torch.compile(comparisons_and_elementwise)(x.to("kiln"), b.to("kiln"))
    for kiln_value, cpu_value in zip(kiln_out, cpu_out):
        assert kiln_value.device.type == "kiln"
        assert torch.equal(kiln_value.cpu(), cpu_value)
    eager = comparisons_and_elementwise(x, b)
    assert torch.equal(kiln_out[0].cpu(), eager[0]) and torch.equal(kiln_out[1].cpu(), eager[1])


def test_the_cache_key_names_the_thread_count(restore_threads):
    from torch_kiln.compiler.inductor.cache_key import KilnCodegenPass

    torch.set_num_threads(1)
    one = KilnCodegenPass().uuid()
    torch.set_num_threads(2)
    assert KilnCodegenPass().uuid() != one


def test_strided_offset_expanded_and_zero_size_inputs():
    def fn(a, b, c):
        return a * 2 + b, (c + 1).sum()

    compiled = torch.compile(fn)
    base = torch.randn(12, 10, device="kiln")
    a = base.t()[2:7]  # non-contiguous, with a storage offset
    b = torch.randn(1, 12, device="kiln").expand(5, 12)  # stride 0
    c = base[3:9, 1:4]
    out, total = compiled(a, b, c)
    expected_out, expected_total = fn(a, b, c)
    assert_close(out, expected_out)
    assert_close(total, expected_total)
    empty = torch.empty(0, 12, device="kiln")
    out, total = compiled(empty, empty, torch.empty(0, 3, device="kiln"))
    assert out.shape == (0, 12) and total.item() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64])
def test_other_dtypes(dtype):
    def fn(a, b):
        return (a * b + a).sum(0), a.max(1).values

    a = torch.randint(-5, 5, (6, 7), device="kiln").to(dtype)
    b = torch.randint(-5, 5, (6, 7), device="kiln").to(dtype)
    out, maxes = torch.compile(fn)(a, b)
    expected, expected_maxes = fn(a, b)
    assert out.dtype == dtype and maxes.dtype == dtype
    torch.testing.assert_close(out.cpu(), expected.cpu(), rtol=1e-2 if dtype == torch.bfloat16 else 0, atol=0)
    torch.testing.assert_close(maxes.cpu(), expected_maxes.cpu(), rtol=0, atol=0)


def test_random_ops_follow_the_seed():
    fn = torch.compile(lambda t: F.dropout(t, 0.5, training=True) + torch.rand_like(t))
    x = torch.ones(1000, device="kiln")
    torch.manual_seed(3)
    first = fn(x).cpu()
    torch.manual_seed(3)
    again = fn(x).cpu()
    torch.manual_seed(4)
    other = fn(x).cpu()
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    kept = first >= 1  # dropout keeps x * 2 = 2, plus a uniform [0, 1) sample
    assert 0.4 < kept.float().mean().item() < 0.6
    assert ((first - 2 * kept) >= 0).all() and ((first - 2 * kept) < 1).all()


def test_stream_context_inside_the_compiled_function():
    # Inductor reads Dynamo's stream annotations and writes `with stream1:`
    # blocks around the block's kernels (it needs the device op overrides'
    # current_stream). Checked: it compiles with fullgraph=True and gives
    # eager's result; which stream each kernel ran on is not observed here.
    side = torch.kiln.Stream()

    def fn(x):
        y = x * 2
        with torch.kiln.stream(side):
            z = y.cos()
        torch.kiln.current_stream().wait_stream(side)
        return z + 1

    x = torch.randn(64, device="kiln")
    side.wait_stream(torch.kiln.current_stream())
    out = torch.compile(fn, fullgraph=True)(x)
    assert_close(out, (x * 2).cos() + 1)


def test_max_autotune_no_cudagraphs_mode():
    fn = torch.compile(pointwise_and_reduction, mode="max-autotune-no-cudagraphs")
    a = torch.randn(16, 8, device="kiln")
    b = torch.randn(16, 8, device="kiln")
    for actual, expected in zip(fn(a, b), pointwise_and_reduction(a, b)):
        assert_close(actual, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_under_autocast(dtype):
    model = make_mlp().to("kiln")
    x = torch.randn(8, 16, device="kiln")
    with torch.autocast("kiln", dtype=dtype):
        expected = model(x)
        actual = torch.compile(model)(x)
    assert actual.dtype == expected.dtype == dtype
    # Fused code rounds to the low precision at other points than eager.
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), rtol=2e-2,
                               atol=2e-2)


def test_inductor_compiles_while_another_thread_runs_eager_kiln_work():
    """Inductor's compilation (C++ builds, fake tracing) on the main thread
    while a second thread keeps kiln:0 and kiln:1 busy with eager ops: both
    give their own results."""
    import threading

    stop = threading.Event()
    errors = []

    def eager_work():
        try:
            for device in ("kiln:0", "kiln:1"):
                a = torch.randn(48, 48, device=device)
                expected = (a @ a).relu().sum(0).cpu()
                for _ in range(3):
                    torch.testing.assert_close((a @ a).relu().sum(0).cpu(), expected,
                                               rtol=0, atol=0)
            while not stop.is_set():
                b = torch.randn(48, 48, device="kiln:0")
                torch.testing.assert_close((b * 2).cpu(), b.cpu() * 2, rtol=0, atol=0)
        except BaseException as e:  # reported below
            errors.append(e)

    worker = threading.Thread(target=eager_work)
    worker.start()
    try:
        torch._dynamo.reset()
        fn = torch.compile(lambda x, y: (x.sin() * y).cumsum(0) + y.exp().mean())
        x = torch.randn(32, 16, device="kiln")
        y = torch.randn(32, 16, device="kiln")
        out = fn(x, y)
    finally:
        stop.set()
        worker.join(timeout=60)
    assert not worker.is_alive()
    assert not errors, errors
    assert_close(out, (x.sin() * y).cumsum(0) + y.exp().mean())


@pytest.mark.parametrize("dtype,device", [(torch.uint8, "kiln:0"), (torch.int8, "kiln:1")])
def test_argmin_and_argmax_of_8_bit_integers_give_eagers_indices(dtype, device, fresh_compile):
    """Inductor 2.13 vectorizes these with 16 indices for a 64-lane value
    vector: on the CPU, compiled x.argmin(1) of a (3, 16) uint8 input gives
    [0, 0, 0] and argmax of negative int8 values garbage indices. Kiln's
    kernels run them as scalar loops (fixes.py, _fix_8bit_argreductions)."""
    def reductions(x):
        return x.argmin(1), x.argmax(1), x.min(1).indices, x.t().argmin(0), x.t().argmax()

    generator = torch.Generator().manual_seed(1)
    compiled = torch.compile(reductions)
    for sign in (1, -1):
        for width in (40,):  # 16 lanes of indices, a tail of 8
            x = (sign * torch.randint(1, 100, (3, width), generator=generator)).to(dtype)
            for actual, expected in zip(compiled(x.to(device)), reductions(x)):
                assert actual.device == torch.device(device)
                assert torch.equal(actual.cpu(), expected), (sign, width, actual, expected)
