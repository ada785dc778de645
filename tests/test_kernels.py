"""Custom kiln kernels (torch_kiln.kernels, kiln/kernel.h; issue 13 part 1).

The example kernel (examples/kernels/bias_gelu.py) is checked against
PyTorch's composite (float32 rounding: std::erf per element against ATen's
vectorized gelu), with torch.library.opcheck, in stream order, on kiln:0
and kiln:1, on a side stream, under torch.compile(fullgraph=True), and in a
model; the interface's errors are checked at the call, at compile time and
inside kernels.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._dynamo

import torch_kiln.kernels as kernels

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from examples.kernels import bias_gelu as bg  # noqa: E402
from examples.kernels import adamw  # noqa: E402
from examples.kernels import rms_norm as rn  # noqa: E402
from examples.kernels import causal_attention as ca  # noqa: E402
from examples.kernels import softmax as sm  # noqa: E402

RTOL, ATOL = 1e-5, 1e-5


@pytest.fixture(scope="module", autouse=True)
def kernel_cache(tmp_path_factory):
    """A private kernel cache for the module (and child processes)."""
    path = tmp_path_factory.mktemp("kiln-kernels")
    old = os.environ.get("KILN_KERNELS_CACHE_DIR")
    os.environ["KILN_KERNELS_CACHE_DIR"] = str(path)
    bg._library = rn._library = adamw._library = None
    yield path
    bg._library = rn._library = adamw._library = None
    if old is None:
        os.environ.pop("KILN_KERNELS_CACHE_DIR", None)
    else:
        os.environ["KILN_KERNELS_CACHE_DIR"] = old


SCALE = r"""
#include <kiln/kernel.h>
KILN_KERNEL(scale) {
  auto out = ctx.tensor<float, 1>(0);
  auto x = ctx.tensor<const float, 1>(1);
  const double alpha = ctx.scalar(2);
  ctx.parallel_for(0, x.size(0), 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out(i) = float(alpha * x(i));
  });
}
// Fails from inside the kernel when limit < x.size(0).
KILN_KERNEL(checked) {
  auto x = ctx.tensor<const float, 1>(0);
  const int64_t limit = ctx.integer(1);
  KILN_KERNEL_CHECK(x.size(0) <= limit, "x has ", x.size(0), " elements, more than ", limit);
}
"""
SCALE_SIGNATURES = ["scale(float32[*]! out, float32[*] x, float alpha)",
                    "checked(float32[*] x, int limit)"]


@pytest.fixture(scope="module")
def scale_lib():
    return kernels.load_inline("test_scale_ext", SCALE, SCALE_SIGNATURES)


def inputs(device, rows=64, cols=96, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g)
    bias = torch.randn(cols, generator=g)
    x, bias = x.to(device), bias.to(device)
    return x.requires_grad_(requires_grad), bias.requires_grad_(requires_grad)


def close(actual, expected):
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------- results

@pytest.mark.parametrize("device", ["kiln:0", "kiln:1", "cpu"])
def test_bias_gelu_forward_and_backward_match_pytorch(device):
    x, bias = inputs(device, requires_grad=True)
    out = bg.bias_gelu(x, bias)
    assert out.device == torch.device(device)
    out.backward(torch.ones_like(out) * 0.5)
    rx, rb = inputs("cpu", requires_grad=True)
    ref = bg.reference(rx, rb)
    ref.backward(torch.ones_like(ref) * 0.5)
    close(out, ref)
    close(x.grad, rx.grad)
    close(bias.grad, rb.grad)


@pytest.mark.parametrize("cols", [1024, 1001])
def test_bias_gelu_large_outputs_take_streaming_stores(cols):
    # 8 MiB and more: the forward writes with streaming stores
    # (kStreamingBytes); with 1001 columns some rows start unaligned and
    # take ordinary stores. Both give the values of small outputs.
    rows = (8 << 20) // (4 * cols) + 1
    x, bias = inputs("kiln", rows=rows, cols=cols)
    out = bg.bias_gelu(x, bias)
    close(out, bg.reference(x.cpu(), bias.cpu()))
    # Row by row in outputs too small to stream: the same values bit for bit.
    for r in (0, 1, rows // 2, rows - 1):
        assert torch.equal(bg.bias_gelu(x[r:r + 1], bias).cpu(), out[r:r + 1].cpu()), r


def test_opcheck_kiln_and_cpu():
    # opcheck's autograd-registration test supports only CPU/CUDA/XPU tensors
    # ("NYI devices other than CPU/CUDA/XPU"): it runs on CPU, where it checks
    # the same registration (autograd is registered for every device).
    kiln_args = inputs("kiln", requires_grad=True)
    torch.library.opcheck(bg.bias_gelu, kiln_args,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    torch.library.opcheck(bg.bias_gelu, inputs("cpu", requires_grad=True))


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1", "cpu"])
def test_rms_norm_forward_and_backward_match_pytorch(device):
    g = torch.Generator().manual_seed(1)
    x, weight = torch.randn(48, 100, generator=g), torch.randn(100, generator=g)
    xd = x.clone().to(device).requires_grad_()
    wd = weight.clone().to(device).requires_grad_()
    out = rn.rms_norm(xd, wd, 1e-6)
    assert out.device == torch.device(device)
    out.backward(out.detach().cos())
    xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = torch.nn.functional.rms_norm(xr, (100,), wr, 1e-6)
    ref.backward(ref.detach().cos())
    close(out, ref)
    close(xd.grad, xr.grad)
    close(wd.grad, wr.grad)


def test_rms_norm_opcheck_and_module():
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(16, 40, generator=g), torch.randn(40, generator=g)
    torch.library.opcheck(rn.rms_norm, (x.to("kiln").requires_grad_(),
                                        weight.to("kiln").requires_grad_(), 1e-5),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    torch.library.opcheck(rn.rms_norm, (x.clone().requires_grad_(),
                                        weight.clone().requires_grad_(), 1e-5))
    fused, stock = rn.RMSNorm(40, eps=1e-5).to("kiln"), torch.nn.RMSNorm(40, eps=1e-5).to("kiln")
    for model in (fused, stock):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(3):
            opt.zero_grad()
            model(x.to("kiln")).pow(3).mean().backward()
            opt.step()
    close(fused.weight, stock.weight)


def test_rms_norm_compiled_fullgraph():
    torch._dynamo.reset()
    model = rn.RMSNorm(32).to("kiln")

    def step(x):
        return model(x * 2).relu()

    x = torch.randn(8, 32, device="kiln")
    close(torch.compile(step, fullgraph=True)(x), step(x))
    torch._dynamo.reset()


# The C++ counterparts of the kl softmax and attention kernels (bench's
# kernels group sets them side by side): forward only, float32.
@pytest.mark.parametrize("device", ["kiln:0", "kiln:1", "cpu"])
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (33, 1024), (3, 1000)])
def test_cpp_softmax_matches_pytorch(device, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)) * 4
    out = sm.softmax(x.to(device))
    assert out.device == torch.device(device)
    torch.testing.assert_close(out.cpu(), torch.softmax(x, -1))
    # a strided view: made contiguous first
    torch.testing.assert_close(sm.softmax(x.t().to(device)).cpu(), torch.softmax(x.t(), -1))


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1", "cpu"])
@pytest.mark.parametrize("bh, seq, d, blocks", [(2, 100, 64, (32, 16)), (1, 1, 8, (128, 128)),
                                                (3, 77, 17, (64, 64)), (1, 300, 32, (128, 128))])
def test_cpp_causal_attention_matches_sdpa(device, bh, seq, d, blocks):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(bh, seq, d, generator=g) for _ in range(3))
    out = ca.causal_attention(q.to(device), k.to(device), v.to(device), *blocks)
    assert out.device == torch.device(device)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=1e-4)


def test_cpp_softmax_and_attention_reject_bad_inputs_at_the_call():
    x = torch.randn(4, 4, device="kiln")
    with pytest.raises(RuntimeError, match=r"kilnex::softmax: x must be 2-D, got 3-D"):
        sm.softmax(x[None])
    with pytest.raises(RuntimeError, match=r"kilnex::softmax: x must be float32, got torch.float64"):
        sm.softmax(x.double())
    q = torch.randn(2, 8, 4, device="kiln")
    with pytest.raises(RuntimeError, match=r"q, k and v must have one shape"):
        ca.causal_attention(q, q, q[:, :4])
    with pytest.raises(RuntimeError, match=r"q, k and v must be float32, got torch.bfloat16"):
        ca.causal_attention(q.bfloat16(), q.bfloat16(), q.bfloat16())
    with pytest.raises(RuntimeError, match=r"blocks must be positive, got \(0, 16\)"):
        ca.causal_attention(q, q, q, 0, 16)
    torch.testing.assert_close(sm.softmax(x).cpu(), torch.softmax(x.cpu(), -1))


def test_cpp_softmax_and_attention_are_one_node_under_compile():
    torch._dynamo.reset()
    x = torch.randn(8, 40, device="kiln")
    q = torch.randn(2, 16, 8, device="kiln")

    def f(x, q):
        return sm.softmax(x * 2), ca.causal_attention(q, q * 0.5, q, 8, 8)

    for got, want in zip(torch.compile(f, fullgraph=True)(x, q), f(x, q)):
        torch.testing.assert_close(got, want)
    torch._dynamo.reset()


@pytest.mark.parametrize("kiln_device", ["kiln:0", "kiln:1"])
def test_cpp_examples_take_size_one_dims_of_any_stride(kiln_device):
    # PyTorch calls a tensor contiguous whatever the stride of a size-1 dim,
    # so .contiguous() leaves it: a (2, 1, 1000) q from a transpose has
    # stride(1) == 1, which the kernels' stride checks refused ("needs
    # contiguous (seq, head_dim) rows") until they used is_contiguous().
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1000, 1, generator=g).transpose(1, 2)
    assert q.is_contiguous() and q.stride(1) == 1
    out = ca.causal_attention(*(t.to(kiln_device) for t in (q, q * 2, q * 3)))
    expected = torch.nn.functional.scaled_dot_product_attention(q, q * 2, q * 3, is_causal=True)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=1e-4)
    x = torch.randn(1, 5, generator=g).t()  # (5, 1), stride(1) == 5
    torch.testing.assert_close(sm.softmax(x.to(kiln_device)).cpu(), torch.softmax(x, -1))
    weight = torch.randn(3, generator=g)[::3]  # (1,), stride 3
    out = rn.rms_norm(x.to(kiln_device), weight.to(kiln_device), 1e-6)
    torch.testing.assert_close(out.cpu(), torch.nn.functional.rms_norm(x, (1,), weight, 1e-6))
    param, grad = torch.randn(2, generator=g)[::2], torch.randn(1, generator=g)
    kiln_param = param.to(kiln_device)
    moments = [torch.zeros(4, device=kiln_device)[::4] for _ in range(2)]  # (1,), stride 4
    adamw.adamw_step_(kiln_param, grad.to(kiln_device), *moments, 0.1, 0.9, 0.999, 1e-8, 0.0, 1)
    reference, ref_moments = param.clone(), [torch.zeros(1), torch.zeros(1)]
    adamw.adamw_step_(reference, grad, *ref_moments, 0.1, 0.9, 0.999, 1e-8, 0.0, 1)
    torch.testing.assert_close(kiln_param.cpu(), reference)
    torch.kiln.synchronize()


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1", "cpu"])
def test_fused_adamw_trains_like_adamw(device):
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(37, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
    x, y = torch.randn(16, 37), torch.randn(16, 5)
    fused, stock = copy.deepcopy(model).to(device), copy.deepcopy(model).to(device)
    optimizers = [(fused, adamw.FusedAdamW(fused.parameters(), lr=1e-2, weight_decay=0.1)),
                  (stock, torch.optim.AdamW(stock.parameters(), lr=1e-2, weight_decay=0.1,
                                            foreach=False))]
    for _ in range(10):
        for m, opt in optimizers:
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x.to(device)), y.to(device)).backward()
            opt.step()
    for p, q in zip(fused.parameters(), stock.parameters()):
        torch.testing.assert_close(p.cpu(), q.cpu(), rtol=1e-6, atol=1e-6)


def test_fused_adamw_opcheck_compile_and_errors():
    def args(device):
        g = torch.Generator().manual_seed(3)
        return [torch.randn(300, generator=g).to(device), torch.randn(300, generator=g).to(device),
                torch.zeros(300, device=device), torch.zeros(300, device=device),
                1e-3, 0.9, 0.999, 1e-8, 0.01, 1]

    torch.library.opcheck(adamw.adamw_step_, args("kiln"),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(adamw.adamw_step_, args("cpu"))
    # Under torch.compile(fullgraph=True) the in-place op is one node and
    # its mutations reach the caller's tensors.
    torch._dynamo.reset()
    eager, compiled = args("kiln"), args("kiln")
    adamw.adamw_step_(*eager)
    torch.compile(lambda *a: adamw.adamw_step_(*a), fullgraph=True)(*compiled)
    for e, c in zip(eager[:4], compiled[:4]):
        close(c, e)
    torch._dynamo.reset()
    bad = args("kiln")
    bad[2] = torch.zeros(600, device="kiln")[::2]
    with pytest.raises(RuntimeError, match="exp_avg must be contiguous"):
        adamw.adamw_step_(*bad)
    bad = args("kiln")
    bad[1] = torch.zeros(299, device="kiln")
    with pytest.raises(RuntimeError, match=r"grad has shape \(299,\), param \(300,\)"):
        adamw.adamw_step_(*bad)


def test_call_returns_at_once_and_runs_in_stream_order(scale_lib):
    """Inputs written by queued eager work are read after it; results feed
    later eager work; nothing waits on the host."""
    torch.kiln.clear_op_tracking()
    x = torch.randn(1 << 20, device="kiln")
    y = (x * 3).exp()  # queued eager work the kernel reads
    out = torch.empty_like(y)
    before = dict(torch.kiln.get_sync_ops())
    scale_lib.scale(out, y, 0.5)
    later = out + 1  # eager work reading the kernel's output
    assert dict(torch.kiln.get_sync_ops()) == before
    close(later, (x.cpu() * 3).exp().double().mul(0.5).float() + 1)
    assert torch.kiln.get_executed_ops()["test_scale_ext::scale"] == 1


def test_runs_on_the_current_side_stream(scale_lib):
    x = torch.randn(4096, device="kiln:1")
    out = torch.empty_like(x)
    side = torch.kiln.Stream(device="kiln:1")
    side.wait_stream(torch.kiln.current_stream("kiln:1"))
    with torch.kiln.stream(side):
        scale_lib.scale(out, x, 2.0)
    torch.kiln.current_stream("kiln:1").wait_stream(side)
    close(out, x.cpu() * 2)


def test_profiler_shows_the_kernel_on_the_device_track(scale_lib):
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(1024, device="kiln")
    out = torch.empty_like(x)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        scale_lib.scale(out, x, 3.0)
        torch.kiln.synchronize()
    names = {e.key for e in prof.key_averages()}
    assert "test_scale_ext::scale" in names


def test_compiled_fullgraph_is_one_node_with_eagers_results():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    model = bg.BiasGelu(32, 48).to("kiln")

    def step(x):
        return model(x).sum(1) * 2

    x = torch.randn(16, 32, device="kiln")
    compiled = torch.compile(step, fullgraph=True)
    out = compiled(x)
    close(out, step(x))
    assert not counters["graph_break"]
    # The op is one node of the traced graph.
    gm_nodes = []

    def backend(gm, example_inputs):
        gm_nodes.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    torch.compile(step, backend=backend, fullgraph=True)(x)
    assert sum(1 for t in gm_nodes if "bias_gelu" in str(t)) == 1
    torch._dynamo.reset()


def test_model_trains_like_the_composite():
    torch.manual_seed(0)
    fused = bg.BiasGelu(24, 40).to("kiln")
    composite = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU()).to("kiln")
    with torch.no_grad():
        composite[0].weight.copy_(fused.linear.weight)
        composite[0].bias.copy_(fused.bias)
    x = torch.randn(8, 24, device="kiln")
    for model in (fused, composite):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    close(fused.linear.weight, composite[0].weight)
    close(fused.bias, composite[0].bias)


# ---------------------------------------------------------------- errors at the call

def test_wrong_dtype_rank_device_and_count_raise_at_the_call(scale_lib):
    x = torch.randn(8, device="kiln")
    out = torch.empty_like(x)
    with pytest.raises(TypeError, match=r"test_scale_ext::scale: argument 'x' has dtype "
                                        r"float64, expected float32"):
        scale_lib.scale(out, x.double(), 1.0)
    with pytest.raises(ValueError, match=r"argument 'x' has 2 dimensions .*expected 1"):
        scale_lib.scale(out, x.view(2, 4), 1.0)
    with pytest.raises(RuntimeError, match=r"argument 'x' is on cpu, expected kiln:0"):
        scale_lib.scale(out, x.cpu(), 1.0)
    with pytest.raises(RuntimeError, match=r"one kiln device, got kiln:0, kiln:1"):
        scale_lib.scale(out, x.to("kiln:1"), 1.0)
    with pytest.raises(TypeError, match=r"takes 3 arguments .*got 2"):
        scale_lib.scale(out, x)
    with pytest.raises(TypeError, match=r"argument 'alpha' must be a float, got str"):
        scale_lib.scale(out, x, "2")
    with pytest.raises(RuntimeError, match=r"expected kiln tensors"):
        scale_lib.scale(out.cpu(), x.cpu(), 1.0)
    # The op's own checks name the op.
    with pytest.raises(RuntimeError, match=r"kilnex::bias_gelu: bias must have shape"):
        bg.bias_gelu(torch.randn(4, 8, device="kiln"), torch.randn(7, device="kiln"))
    close(out.fill_(1), torch.ones(8))  # the device keeps working


def test_error_inside_a_kernel_surfaces_at_synchronize_and_the_device_keeps_working(scale_lib):
    x = torch.randn(100, device="kiln")
    scale_lib.checked(x, 10)
    with pytest.raises(RuntimeError, match=r"test_scale_ext::checked: .*x has 100 elements, "
                                           r"more than 10"):
        torch.kiln.synchronize()
    out = torch.empty_like(x)
    scale_lib.scale(out, x, 2.0)
    close(out, x.cpu() * 2)


def test_a_view_the_signature_does_not_allow_fails_inside_the_kernel():
    lib = kernels.load_inline("test_bad_view_ext", r"""
        #include <kiln/kernel.h>
        KILN_KERNEL(bad) { auto x = ctx.tensor<double, 1>(0); (void)x; }
    """, ["bad(float32[*] x)"])
    lib.bad(torch.randn(4, device="kiln"))
    with pytest.raises(RuntimeError, match=r"argument 0 is a float32 tensor; the kernel viewed "
                                           r"it as float64"):
        torch.kiln.synchronize()


def test_compile_error_shows_the_compilers_message_and_line():
    source = "#include <kiln/kernel.h>\nKILN_KERNEL(broken) {\n  undefined_name(ctx);\n}\n"
    with pytest.raises(kernels.KernelCompileError,
                       match=r"(?s)test_broken_ext cpp_sources\[0\]:3:.*undefined_name"):
        kernels.load_inline("test_broken_ext", source, ["broken()"])


def test_compile_error_in_a_source_file_names_the_file(tmp_path):
    path = tmp_path / "my_kernel.cpp"
    path.write_text("#include <kiln/kernel.h>\n\nKILN_KERNEL(k) { int x = ; }\n")
    with pytest.raises(kernels.KernelCompileError, match=rf"(?s){path}:3:"):
        kernels.load("test_file_ext", [str(path)], ["k()"])


def test_load_from_a_file(tmp_path):
    path = tmp_path / "scale.cpp"
    path.write_text(SCALE)
    lib = kernels.load("test_scale_file_ext", [str(path)], SCALE_SIGNATURES)
    x = torch.randn(16, device="kiln")
    out = torch.empty_like(x)
    lib.scale(out, x, -1.0)
    close(out, -x.cpu())


@pytest.mark.parametrize("functions, error, message", [
    (["scale(float32[*]! out, float32[*] x, double alpha)"], ValueError, "cannot read argument"),
    (["scale(float33[*]! out, float32[*] x, float alpha)"], ValueError, "unknown dtype 'float33'"),
    (["scale(float32[*]! out, float32[*, 2] x, float alpha)"], ValueError, "one '\\*' per dim"),
    (["scale float32"], ValueError, "expected 'name\\(arguments\\)'"),
    (["missing(float32[*] x)"], AttributeError, "define no KILN_KERNEL\\(missing\\)"),
    ([], ValueError, "at least one kernel signature"),
])
def test_bad_declarations_raise_clear_errors(functions, error, message):
    with pytest.raises(error, match=message):
        kernels.load_inline("test_scale_ext", SCALE, functions)


def test_bad_library_name_and_missing_file():
    with pytest.raises(ValueError, match="must be a Python identifier"):
        kernels.load_inline("bad-name", SCALE, SCALE_SIGNATURES)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        kernels.load("test_nofile_ext", ["/nonexistent/k.cpp"], ["k()"])
    with pytest.raises(IsADirectoryError, match=r"is a directory; pass the C\+\+ files in it"):
        kernels.load("test_dir_ext", [os.path.dirname(__file__)], ["k()"])


# ---------------------------------------------------------------- cache

def test_a_second_process_loads_from_the_cache_without_compiling(scale_lib, kernel_cache):
    code = textwrap.dedent(f"""
        import subprocess, torch
        import torch_kiln.kernels as kernels
        from torch_kiln.kernels import build
        calls = []
        real_run = subprocess.run
        def run(cmd, *a, **k):
            calls.append(cmd)
            return real_run(cmd, *a, **k)
        build.subprocess.run = run
        lib = kernels.load_inline("test_scale_ext", {SCALE!r}, {SCALE_SIGNATURES!r})
        x = torch.ones(4, device="kiln"); out = torch.empty_like(x)
        lib.scale(out, x, 3.0)
        print(out.sum().item(), [c for c in calls if "-shared" in c])
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, KILN_KERNELS_CACHE_DIR=str(kernel_cache)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["12.0", "[]"], result.stdout


def test_changed_source_rebuilds(kernel_cache):
    first = kernels.load_inline("test_rebuild_ext", SCALE, SCALE_SIGNATURES)
    second = kernels.load_inline("test_rebuild_ext", SCALE + "\n// changed\n", SCALE_SIGNATURES)
    assert first.path != second.path
    assert kernels.load_inline("test_rebuild_ext", SCALE, SCALE_SIGNATURES).path == first.path


def test_unwritable_cache_directory_names_the_variable(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("KILN_KERNELS_CACHE_DIR", str(blocked / "cache"))
    with pytest.raises(OSError, match="set KILN_KERNELS_CACHE_DIR to a writable directory"):
        kernels.load_inline("test_nocache_ext", SCALE, SCALE_SIGNATURES)


def test_namespace_registers_each_kernel_as_an_operator():
    lib = kernels.load_inline("test_ns_ext", SCALE, SCALE_SIGNATURES, namespace="kiln_test_ns")
    assert str(torch.ops.kiln_test_ns.scale.default._schema) == \
        "kiln_test_ns::scale(Tensor(a0!) out, Tensor x, float alpha) -> ()"
    x = torch.randn(64, device="kiln:1")
    out = torch.empty_like(x)
    torch.ops.kiln_test_ns.scale(out, x, 4.0)
    close(out, x.cpu() * 4)
    # One mutating node under torch.compile; the caller sees the mutation.
    torch._dynamo.reset()
    out2 = torch.zeros_like(x)

    def fn(o, t):
        torch.ops.kiln_test_ns.scale(o, t * 2, 0.5)
        return o + 1

    result = torch.compile(fn, fullgraph=True)(out2, x)
    close(out2, x.cpu())
    close(result, x.cpu() + 1)
    torch._dynamo.reset()
    # The checks of the call still apply through the operator.
    with pytest.raises(TypeError, match="argument 'x' has dtype float64, expected float32"):
        torch.ops.kiln_test_ns.scale(out, x.double(), 1.0)
    with pytest.raises(RuntimeError, match="operator kiln_test_ns::scale .*exists already"):
        kernels.load_inline("test_ns_ext", SCALE, SCALE_SIGNATURES, namespace="kiln_test_ns")
    assert lib.namespace == "kiln_test_ns"


def test_kernel_reads_its_device_and_stream():
    lib = kernels.load_inline("test_stream_id_ext", r"""
        #include <kiln/kernel.h>
        KILN_KERNEL(where) {
          auto out = ctx.tensor<int64_t, 1>(0);
          out(0) = ctx.device();
          out(1) = ctx.stream_id();
        }
    """, ["where(int64[*]! out)"])
    out = torch.zeros(2, dtype=torch.int64, device="kiln:1")
    side = torch.kiln.Stream(device="kiln:1")
    side.wait_stream(torch.kiln.current_stream("kiln:1"))
    with torch.kiln.stream(side):
        lib.where(out)
    side.synchronize()
    assert out.tolist() == [1, side.stream_id]


# ---------------------------------------------------------------- found by a fresh user

FILL = r"""
#include <kiln/kernel.h>
KILN_KERNEL(fill) {
  auto out = ctx.tensor<float, 1>(0);
  const double v = ctx.scalar(1);
  ctx.parallel_for(0, out.size(0), 1024, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out(i) = float(v);
  });
}
KILN_KERNEL(count) {  // no tensor arguments
  KILN_KERNEL_CHECK(ctx.integer(0) >= 0, "negative count ", ctx.integer(0), " on kiln:", ctx.device());
}
"""


@pytest.fixture(scope="module")
def fill_lib():
    return kernels.load_inline("test_fill_ext", FILL, ["fill(float32[*]! out, float v)",
                                                        "count(int n)"])


def test_written_tensors_bump_their_version_so_autograd_sees_the_write(fill_lib):
    x = torch.randn(4, device="kiln", requires_grad=True)
    y = x.exp()  # exp's backward uses y
    version = y._version
    fill_lib.fill(y.detach(), 0.0)
    assert y._version == version + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_an_expanded_written_tensor_is_rejected(fill_lib):
    out = torch.zeros(1, device="kiln").expand(1000)
    with pytest.raises(RuntimeError, match=r"argument 'out' is written by the kernel, but more "
                                           r"than one of its elements"):
        fill_lib.fill(out, 1.0)


def test_an_inference_tensor_is_written_only_in_inference_mode(fill_lib):
    # it was written silently outside inference mode, where torch refuses
    # in-place updates of inference tensors (custom operators' too)
    with torch.inference_mode():
        out = torch.zeros(4, device="kiln")
    with pytest.raises(RuntimeError, match=r"argument 'out' is written by the kernel but is an "
                                           r"inference tensor"):
        fill_lib.fill(out, 1.0)
    assert torch.equal(out.cpu(), torch.zeros(4))
    with torch.inference_mode():
        fill_lib.fill(out, 1.0)
    assert torch.equal(out.cpu(), torch.ones(4))


def test_scalar_arguments_overflow_and_numpy(fill_lib):
    import numpy as np

    out = torch.zeros(8, device="kiln")
    with pytest.raises(OverflowError, match=r"test_fill_ext::fill: argument 'v' = .* does not "
                                            r"fit a double"):
        fill_lib.fill(out, 10 ** 400)
    with pytest.raises(OverflowError, match=r"argument 'n' = 9223372036854775808 does not fit "
                                            r"int64"):
        fill_lib.count(2 ** 63)
    fill_lib.fill(out, np.float32(0.5))
    fill_lib.count(np.int64(3))
    close(out, torch.full((8,), 0.5))


def test_a_kernel_without_tensors_runs_on_the_current_device(fill_lib):
    with torch.kiln.device(1):
        fill_lib.count(-1)
    with pytest.raises(RuntimeError, match="negative count -1 on kiln:1"):
        torch.kiln.synchronize(1)


def test_an_operator_with_more_than_26_written_tensors_gets_distinct_alias_sets():
    many = ", ".join(f"float32[*]! t{i}" for i in range(30))
    lib = kernels.load_inline("test_many_written_ext",  # kept: it owns the registration
                              "#include <kiln/kernel.h>\nKILN_KERNEL(many) {}\n",
                              [f"many({many})"], namespace="kiln_test_many")
    schema = torch.ops.kiln_test_many.many.default._schema
    aliases = [a.alias_info for a in schema.arguments]
    assert all(a is not None and a.is_write for a in aliases)
    assert len({next(iter(a.before_set)) for a in aliases}) == 30  # no two share a set
    assert lib.namespace == "kiln_test_many"


def test_more_bad_declarations():
    for kind in ("int a", "float32[*] t"):  # scalars and tensors count alike
        many = ", ".join(f"{kind}{i}" for i in range(65))
        with pytest.raises(ValueError, match="65 arguments; kiln kernels take at most 64"):
            kernels.load_inline("test_fill_ext", FILL, [f"many({many})"])
    with pytest.raises(ValueError, match="9 dimensions; kiln kernels take at most 8"):
        kernels.load_inline("test_fill_ext", FILL, ["fill(float32[*,*,*,*,*,*,*,*,*]! out, "
                                                     "float v)"])
    with pytest.raises(TypeError, match="extra_cflags must be a list of flags"):
        kernels.load_inline("test_fill_ext", FILL, ["fill(float32[*]! out, float v)"],
                            extra_cflags="-O0")
    with pytest.raises(ValueError, match="at most 100 are allowed"):
        kernels.load_inline("x" * 300, FILL, ["fill(float32[*]! out, float v)"])


def test_an_undefined_symbol_fails_the_build():
    source = "#include <kiln/kernel.h>\nvoid helper();\nKILN_KERNEL(f) { helper(); }\n"
    with pytest.raises(kernels.KernelCompileError, match=r"(?s)undefined reference to "
                                                         r"`helper\(\)'"):
        kernels.load_inline("test_link_ext", source, ["f()"])


def test_a_damaged_cached_library_is_rebuilt(kernel_cache):
    from torch_kiln.kernels import build

    # Built but not loaded here: truncating a library a process has mapped
    # would crash that process (SIGBUS) when it next runs the code.
    path = str(build.build_library("test_damaged_ext", inline_sources=[FILL]))
    code = textwrap.dedent(f"""
        import os, torch
        open({path!r}, "wb").close()
        import torch_kiln.kernels as kernels
        lib = kernels.load_inline("test_damaged_ext", {FILL!r}, ["fill(float32[*]! out, float v)"])
        out = torch.zeros(3, device="kiln"); lib.fill(out, 2.0)
        print(out.sum().item(), os.path.getsize({path!r}) > 0)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, KILN_KERNELS_CACHE_DIR=str(kernel_cache)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["6.0", "True"], result.stdout


# ---------------------------------------------------------------- autograd (no formula)

NO_FORMULA = "Trying to backward through {} \\(a custom kiln kernel\\) but no autograd formula " \
             "was registered"


@pytest.fixture(scope="module")
def grad_ns_lib():
    return kernels.load_inline("test_grad_ns_ext", SCALE, SCALE_SIGNATURES,
                               namespace="kiln_test_grad")


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("form", ["direct", "torch.ops"])
def test_backward_through_a_kernel_raises_instead_of_dropping_the_gradient(grad_ns_lib, device,
                                                                           form):
    # scale(out, x, 2) then (out * x).sum(): the true x.grad is 4x; without a
    # formula autograd used to see only the `* x` path and give 2x, silently.
    call = grad_ns_lib.scale if form == "direct" else torch.ops.kiln_test_grad.scale
    x = torch.arange(10, dtype=torch.float32, device=device, requires_grad=True)
    out = torch.empty(10, device=device)
    call(out, x, 2.0)
    assert out.requires_grad and out.grad_fn is not None
    close(out.detach(), x.detach().cpu() * 2)  # the forward is unchanged
    loss = (out * x).sum()
    with pytest.raises(RuntimeError, match=NO_FORMULA.format("test_grad_ns_ext::scale")) as info:
        loss.backward()
    assert "register_autograd" in str(info.value) and "torch.no_grad()" in str(info.value)
    # A non-leaf written tensor that requires grad: overwriting it is not
    # differentiable either (leaf.grad used to come out as ones).
    leaf = torch.ones(10, device=device, requires_grad=True)
    out = leaf * 1
    call(out, x.detach(), 2.0)
    with pytest.raises(RuntimeError, match=NO_FORMULA.format("test_grad_ns_ext::scale")):
        out.sum().backward()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "no input requires grad"])
def test_kernels_without_grad_record_nothing(grad_ns_lib, mode):
    x = torch.arange(10, dtype=torch.float32, device="kiln",
                     requires_grad=mode != "no input requires grad")
    out = torch.empty(10, device="kiln")
    if mode == "inference_mode":
        with torch.inference_mode():
            out = torch.empty(10, device="kiln")
            x = torch.arange(10, dtype=torch.float32, device="kiln")
            grad_ns_lib.scale(out, x, 3.0)
            torch.ops.kiln_test_grad.scale(out, out, 1.0)
    else:
        with torch.no_grad() if mode == "no_grad" else torch.enable_grad():
            grad_ns_lib.scale(out, x, 3.0)
            torch.ops.kiln_test_grad.scale(out, out, 1.0)
    assert not out.requires_grad and out.grad_fn is None
    close(out, x.detach().cpu() * 3)



def test_backward_through_a_compiled_operator_call_raises_too(grad_ns_lib, fresh_compile):
    # Under torch.compile the kernel runs inside the compiled graph (grad
    # mode off); the operator's Autograd kernel is traced instead, so the
    # backward raises at compile time rather than giving x.grad == 2x.
    torch._dynamo.reset()

    def fn(o, t):
        torch.ops.kiln_test_grad.scale(o, t, 2.0)
        return (o * t).sum()

    x = torch.arange(10, dtype=torch.float32, device="kiln", requires_grad=True)
    with pytest.raises(Exception, match=NO_FORMULA.format("kiln_test_grad::scale")):
        torch.compile(fn)(torch.empty(10, device="kiln"), x).backward()
    torch._dynamo.reset()
    # Without a tensor that requires grad it compiles and runs as before.
    out = torch.empty(10, device="kiln")
    result = torch.compile(fn)(out, x.detach())
    close(result, (x.detach().cpu() ** 2 * 2).sum())
    torch._dynamo.reset()
