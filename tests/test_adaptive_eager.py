"""Adaptive eager fusion, first increment (KILN_ADAPTIVE_EAGER=1, off by
default; Note [Adaptive eager fusion] in torch_kiln/csrc/aten/AdaptiveEager.cc).

Queued float32 elementwise ops on a kiln stream run as one task; results must
be bit-identical to running them unfused (and to CPU). Every test makes the
ops wait in the queue deterministically behind a *gate* (a device task that
waits until the test opens it, torch_kiln._C._gate_stream), so which ops form
a group never depends on timing; fusion is switched per test with
torch_kiln._C._set_adaptive_eager. Fused runs are read from
torch.kiln.get_fused_ops().
"""

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch_kiln
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from conftest import assert_same, run_python
from kl_helpers import private_kernel_cache  # noqa: F401
from torch_kiln.kiln import _fused_kernels

_C = torch_kiln._C
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GATE_TIMEOUT_S = 60.0  # a gate opens by itself after this: a failing test cannot hang


@contextlib.contextmanager
def adaptive_eager(enabled):
    before = _C._adaptive_eager_enabled()
    _C._set_adaptive_eager(enabled)
    try:
        yield
    finally:
        _C._set_adaptive_eager(before)


@contextlib.contextmanager
def gated(timeout_s=GATE_TIMEOUT_S):
    """Work issued inside waits on the current stream until the block ends
    (or timeout_s seconds pass)."""
    open_gate = _C._gate_stream(timeout_s)
    try:
        yield
    finally:
        open_gate()


@contextlib.contextmanager
def fused_kernels(mode):
    before = _C._fused_kernels_mode()
    _C._set_fused_kernels(mode)
    try:
        yield
    finally:
        _C._set_fused_kernels(before)


@pytest.fixture(params=["aten", "interpreted", "specialized"])
def kernels(request, private_kernel_cache):  # noqa: F811
    """How a group runs its ops: each op's ATen kernel per tile, the
    generated interpreter, or each run's own generated kernel (Note
    [Generated kernels for fusion groups])."""
    return request.param


# The ops a generated kernel computes (Note [Generated kernels for fusion
# groups]); the others (exp, tanh, gelu) always run as their ATen kernels.
GENERATED_OPS = {"aten::add.out", "aten::sub.out", "aten::mul.out", "aten::div.out",
                 "aten::neg.out", "aten::sigmoid.out", "aten::relu", "aten::relu_"}


def fused_and_unfused(fn, *inputs, kernels="aten"):
    """fn(*inputs) unfused (twice: an op's first calls may synchronize once to
    check its meta kernel, which would split a group), then fused behind a
    gate. With generated kernels ("interpreted" or "specialized"), a first
    fused run queues the builds of
    the group's kernels, which are awaited, and the checked run must call one
    exactly when a fused group holds an op of GENERATED_OPS. Returns
    (unfused results, fused results, get_fused_ops())."""
    with adaptive_eager(False):
        fn(*inputs)
        expected = fn(*inputs)
    torch.kiln.synchronize()
    generated = kernels != "aten"
    with adaptive_eager(True), fused_kernels(kernels):
        if generated:
            with gated():
                fn(*inputs)
            torch.kiln.synchronize()
            assert _fused_kernels.wait(600), _fused_kernels.stats()
            assert _fused_kernels.stats()["failures"] == []
        runs = _fused_kernels.stats()["runs"]
        torch.kiln.clear_op_tracking()
        with gated():
            actual = fn(*inputs)
        torch.kiln.synchronize()
    fused = torch.kiln.get_fused_ops()
    if generated:
        ran = _fused_kernels.stats()["runs"] > runs
        group_ops = {op for key in fused for op in key.split(", ")}
        assert ran == bool(group_ops & GENERATED_OPS), (fused, _fused_kernels.stats())
    return expected, actual, fused


def assert_bits_equal(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert_same(a, e.cpu())


# ---------------------------------------------------------------- awkward values

_SPECIALS = [0.0, -0.0, 1.0, -1.5, 0.5, 7.0, -3.25, 88.7, -88.7, 1e-20, 1e20,
             float("inf"), float("-inf"), 3.4e38, -3.4e38, 1e-45, -1e-45, 1e-40,
             -1e-40, 1.17549435e-38]
# quiet NaN, -NaN, a NaN with a payload, a signalling NaN
_NAN_BITS = [0x7FC00000, -0x00400000, 0x7FC00001, 0x7F800001]


def _specials():
    nans = torch.tensor(_NAN_BITS, dtype=torch.int32).view(torch.float32)
    return torch.cat([torch.tensor(_SPECIALS, dtype=torch.float32), nans])


def awkward_pair(n, seed=0):
    """Two float32 CPU tensors of n elements: every pair of special values
    (NaN payloads, ±inf, ±0.0, denormals, extremes) in turn, then normals."""
    s = _specials()
    a, b = (t.reshape(-1) for t in torch.meshgrid(s, s, indexing="ij"))
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, generator=g) * 3, torch.randn(n, generator=g) * 3
    k = min(n, a.numel())
    x[:k], y[:k] = a[:k], b[:k]
    # the last elements (a loop's scalar tail) get specials too
    tail = min(n - k, 24)
    if tail > 0:
        x[-tail:], y[-tail:] = a[-tail:], b[-tail:]
    return x, y


BINARY = {
    "add": (lambda x, y: x + y, "aten::add.out"),
    "add_scalar": (lambda x, y: x + 2.5, "aten::add.out"),
    "add_alpha_2": (lambda x, y: torch.add(x, y, alpha=2), "aten::add.out"),
    "add_alpha_0.1": (lambda x, y: torch.add(x, y, alpha=0.1), "aten::add.out"),
    "sub": (lambda x, y: x - y, "aten::sub.out"),
    "sub_alpha_3": (lambda x, y: torch.sub(x, y, alpha=3), "aten::sub.out"),
    # ATen negates an integer alpha as an integer: -0 is +0.0 (so -0.0 - 0 * y
    # is +0.0 on CPU), and -INT64_MIN wraps to INT64_MIN.
    "sub_alpha_int_0": (lambda x, y: torch.sub(x, y, alpha=0), "aten::sub.out"),
    "sub_alpha_int64_min": (lambda x, y: torch.sub(x, y, alpha=-2**63), "aten::sub.out"),
    "rsub_scalar": (lambda x, y: 1.5 - x, "aten::sub.out"),
    "mul": (lambda x, y: x * y, "aten::mul.out"),
    "mul_scalar": (lambda x, y: x * 0.3, "aten::mul.out"),
    "div": (lambda x, y: x / y, "aten::div.out"),
    "div_scalar": (lambda x, y: x / 3.0, "aten::div.out"),
}
UNARY = {
    "neg": (torch.neg, "aten::neg.out"),
    "relu": (torch.relu, "aten::relu"),
    "exp": (torch.exp, "aten::exp.out"),
    "tanh": (torch.tanh, "aten::tanh.out"),
    "sigmoid": (torch.sigmoid, "aten::sigmoid.out"),
    "gelu": (torch.nn.functional.gelu, "aten::gelu.out"),
    "gelu_tanh": (lambda x: torch.nn.functional.gelu(x, approximate="tanh"), "aten::gelu.out"),
}
INPLACE = {
    "add_": (lambda x, y: x.add_(y), "aten::add.out"),
    "sub_": (lambda x, y: x.sub_(y, alpha=0.5), "aten::sub.out"),
    "mul_": (lambda x, y: x.mul_(y), "aten::mul.out"),
    "div_": (lambda x, y: x.div_(y), "aten::div.out"),
    "neg_": (lambda x, y: x.neg_(), "aten::neg.out"),
    "relu_": (lambda x, y: x.relu_(), "aten::relu_"),
    "exp_": (lambda x, y: x.exp_(), "aten::exp.out"),
    "sigmoid_": (lambda x, y: x.sigmoid_(), "aten::sigmoid.out"),
}
# 67: vector body + scalar tail; 100_003: several tiles (and with two
# threads, two parallel_for ranges with a tail each).
SIZES = [67, 100_003]


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def check_fused_chain(chain, x, y, key, kernels="aten"):
    """chain(a, b) on kiln fused gives one run of `key`, bit-identical to it
    unfused and to CPU's chain(x, y)."""
    expected, actual, fused = fused_and_unfused(chain, x.to("kiln"), y.to("kiln"),
                                                kernels=kernels)
    assert fused == {key: 1}
    assert_bits_equal(actual, expected)
    assert_bits_equal(actual, chain(x, y))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_op_fused_is_bit_identical(name, n, threads, kernels):
    op, aten = BINARY[name]
    x, y = awkward_pair(n)
    check_fused_chain(lambda a, b: [op(a, b), op(op(a, b), b)], x, y, f"{aten}, {aten}, {aten}",
                      kernels)


# gelu joins a group only within one tile (Note [Adaptive eager fusion]).
GELU_MAX_FUSED = 16384


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_op_fused_is_bit_identical(name, n, threads, kernels):
    op, aten = UNARY[name]
    if aten == "aten::gelu.out":
        n = min(n, GELU_MAX_FUSED)
    x, y = awkward_pair(n)
    # op(x), op(y - x): ops over every special value and over their differences
    check_fused_chain(lambda a, b: [op(a), op(b - a)], x, y, f"{aten}, aten::sub.out, {aten}",
                      kernels)


@pytest.mark.parametrize("name", sorted(INPLACE))
def test_inplace_op_fused_is_bit_identical(name, kernels):
    op, aten = INPLACE[name]
    x, y = awkward_pair(1000)

    def chain(a, b):
        a = a.clone()  # a copy: before the group
        op(a, b)
        op(a, b)
        return [a]

    check_fused_chain(chain, x, y, f"{aten}, {aten}", kernels)


@pytest.mark.parametrize("n", [16_385, 20_008, 32_768, 32_769, 100_003])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_over_one_tile_runs_unfused_and_bit_identical(n, approximate, threads):
    """ATen's gelu splits more than 16384 elements by thread count itself,
    and computes a lone trailing element otherwise than at the end of a
    longer loop: fused tile by tile it gave other bits (16385..32768
    elements at two threads; the last of 16385 at one). It stays unfused."""
    x, y = awkward_pair(n, seed=n)
    x[-1] = 1.9679388999938965  # a value whose lone-element result differs

    def chain(a, b):
        c = a * 1.0
        return [c, torch.nn.functional.gelu(c, approximate=approximate)]

    expected, actual, fused = fused_and_unfused(chain, x.to("kiln"), y.to("kiln"))
    assert all("gelu" not in key for key in fused), fused
    assert_bits_equal(actual, expected)
    assert_bits_equal(actual, chain(x, y))


def long_chain(a, b):
    c = a + b
    d = c * 2
    e = d.relu()
    f = torch.nn.functional.gelu(e)
    g = f.sigmoid() - c
    h = -g / b
    return [c, d, e, f, g, h]


# At 50,000 elements gelu runs unfused (GELU_MAX_FUSED) between two groups.
LONG_CHAIN_KEYS = {"aten::add.out, aten::mul.out, aten::relu": 1,
                   "aten::sigmoid.out, aten::sub.out, aten::neg.out, aten::div.out": 1}


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("where", ["default_stream", "side_stream"])
def test_chain_on_each_device_and_stream(device, where, kernels):
    x, y = awkward_pair(50_000, seed=1)
    kx, ky = x.to(device), y.to(device)
    torch.kiln.synchronize(device)
    with torch.kiln.device(device):
        side = torch.kiln.Stream()
        side.wait_stream(torch.kiln.current_stream())
        context = torch.kiln.stream(side) if where == "side_stream" else contextlib.nullcontext()
        with context:
            expected, actual, fused = fused_and_unfused(long_chain, kx, ky, kernels=kernels)
        torch.kiln.synchronize()
    assert fused == LONG_CHAIN_KEYS
    assert all(t.device == torch.device(device) for t in actual)
    assert_bits_equal(actual, expected)
    assert_bits_equal(actual, long_chain(x, y))


def test_an_op_cpu_rejects_at_the_call_raises_there_and_loses_no_fused_result():
    """sub.out with a bool scalar: CPU raises at the call. Kiln raises at the
    call too (Note [Dtype errors at the call]), so it never joins the open
    group and the group's earlier result stays readable. The rejected call
    runs synchronously, after the queued work, so it waits for the gate:
    a short gate lets the test go on."""
    a, b = torch.ones(33, device="kiln"), torch.zeros(33, device="kiln")
    with adaptive_eager(False):
        a * 2.0  # first calls check layouts
    torch.kiln.synchronize()
    with adaptive_eager(True):
        with gated(timeout_s=1.0):
            c = a * 2.0
            with pytest.raises(RuntimeError, match="with a bool tensor is not supported"):
                torch.sub(a, True, out=b)
        torch.kiln.synchronize()
    assert_same(c, torch.full((33,), 2.0))
    assert_same(b, torch.zeros(33))


def test_intermediate_view_kept_by_python_is_written(kernels):
    x, y = awkward_pair(4096)
    kx, ky = x.to("kiln"), y.to("kiln")

    def chain(a, b):
        c = a + b
        view = c.view(64, 64)[3]  # a view launches nothing
        d = c * b
        e = d.relu()
        return [c, view, d, e]

    expected, actual, fused = fused_and_unfused(chain, kx, ky, kernels=kernels)
    assert fused == {"aten::add.out, aten::mul.out, aten::relu": 1}
    assert_bits_equal(actual, expected)


def test_inplace_ops_on_aliases(kernels):
    x, y = awkward_pair(4096)
    kx, ky = x.to("kiln"), y.to("kiln")

    def chain(a, b):
        a = a.clone()
        alias = a.view(-1)  # the same memory: joins the group as the same tensor
        a.add_(b)
        alias.mul_(0.5)
        a.relu_()
        z = alias + a
        return [a, alias, z]

    expected, actual, fused = fused_and_unfused(chain, kx, ky, kernels=kernels)
    assert fused == {"aten::add.out, aten::mul.out, aten::relu_, aten::add.out": 1}
    assert_bits_equal(actual, expected)
    assert_bits_equal(actual, chain(x, y))


def test_partially_overlapping_tensors_are_not_fused_together(kernels):
    x, _ = awkward_pair(4097)
    kx = x.to("kiln")

    def chain(a):
        a = a.clone()
        a[:-1].add_(1)  # writes elements 0..n-2
        b = a[1:] * 2  # reads elements 1..n-1: element i reads what the add wrote at i+1
        c = b + 1
        return [a, b, c]

    expected, actual, fused = fused_and_unfused(chain, kx, kernels=kernels)
    assert fused == {"aten::mul.out, aten::add.out": 1}  # the add_ is not in their group
    assert_bits_equal(actual, expected)
    assert_bits_equal(actual, chain(x))


def test_broadcasting_and_other_dtypes_are_not_fused():
    a = torch.randn(64, 64, device="kiln")
    row = torch.randn(64, device="kiln")
    d = torch.randn(64, 64, device="kiln", dtype=torch.float64)

    def chain(a, row, d):
        return [a + row, (a + row) * 2, d + 1, (d + 1) * 2]

    expected, actual, fused = fused_and_unfused(chain, a, row, d)
    assert fused == {}
    assert_bits_equal(actual, expected)


def two_pairs(a, between):
    """Two add-mul pairs with `between()` issued between them."""
    y = a + 1
    z = y * 2
    between()
    w = z + 1
    v = w * 2
    return [y, z, w, v]


@pytest.mark.parametrize("between", ["event_record", "wait_stream", "record_stream", "copy"])
def test_queue_events_between_ops_close_the_group(between):
    a = torch.randn(1000, device="kiln")
    side = torch.kiln.Stream()
    pinned = torch.empty(1000).pin_memory()
    kept = []

    def do_between():
        if between == "event_record":
            kept.append(torch.kiln.Event())
            kept[-1].record()
        elif between == "wait_stream":
            torch.kiln.current_stream().wait_stream(side)
        elif between == "record_stream":
            t = a * 1
            t.record_stream(side)
            kept.append(t)
        else:
            pinned.copy_(a, non_blocking=True)

    expected, actual, fused = fused_and_unfused(lambda x: two_pairs(x, do_between), a)
    if between == "record_stream":
        # `a * 1` ends the first group; record_stream closes the second.
        assert fused == {"aten::add.out, aten::mul.out, aten::mul.out": 1,
                         "aten::add.out, aten::mul.out": 1}
    else:
        assert fused == {"aten::add.out, aten::mul.out": 2}
    assert_bits_equal(actual, expected)


@pytest.mark.parametrize("between", ["synchronize", "stream_synchronize", "event_synchronize", "item"])
def test_synchronizations_between_ops_close_the_group(between):
    """A host wait needs the gate open, so the ops after it are not gated:
    whether they fuse with each other depends on timing, but they never join
    the group issued before the wait."""
    a = torch.randn(1000, device="kiln")
    with adaptive_eager(False):
        two_pairs(a, lambda: None)
    torch.kiln.synchronize()
    torch.kiln.clear_op_tracking()
    with adaptive_eager(True):
        open_gate = _C._gate_stream(GATE_TIMEOUT_S)
        y = a + 1
        z = y * 2
        open_gate()
        if between == "synchronize":
            torch.kiln.synchronize()
        elif between == "stream_synchronize":
            torch.kiln.current_stream().synchronize()
        elif between == "event_synchronize":
            e = torch.kiln.Event()
            e.record()
            e.synchronize()
        else:
            assert z[0].item() == ((a[:1].cpu() + 1) * 2).item()
        w = z + 1
        v = w * 2
        torch.kiln.synchronize()
    fused = torch.kiln.get_fused_ops()
    assert fused.get("aten::add.out, aten::mul.out", 0) >= 1
    assert all(len(key.split(", ")) <= 2 for key in fused), fused
    assert_same(v, ((a.cpu() + 1) * 2 + 1) * 2)


def test_failing_op_inside_a_fused_run_names_the_op():
    a = torch.randn(1000, device="kiln")
    with adaptive_eager(False):
        (-((a + 1) * 2)).sum().item()
    with adaptive_eager(True):
        with gated():
            _C._fusion_fail_op("aten::mul.out")
            y = a + 1
            z = y * 2
            w = -z
        with pytest.raises(RuntimeError,
                           match=r"kiln::fused_elementwise: aten::mul.out \(op 2 of 3 of a fused run "
                                 r"of aten::add.out, aten::mul.out, aten::neg.out\): "
                                 r"inputs \(Float\[1000\], Long\[\]\): injected failure"):
            torch.kiln.synchronize()
        for t in (z, w):  # never computed: reading them is an error
            with pytest.raises(RuntimeError, match=r"never computed.*aten::mul.out"):
                t.sum().item()
        # The stream works again, fused.
        with gated():
            y = a + 1
            z = y * 2
        assert_same(z, (a.cpu() + 1) * 2)


def test_group_skipped_after_an_earlier_failure_names_that_failure():
    x = torch.arange(4.0, device="kiln")
    good = torch.tensor([0], device="kiln")
    bad = torch.tensor([0, 9], device="kiln")
    torch.index_select(x, 0, good)
    torch.kiln.synchronize()
    with adaptive_eager(True):
        with gated():
            y = torch.index_select(x, 0, bad)  # fails on the device
            z = y * 2  # a fusion group: skipped
            w = z + 1
        with pytest.raises(IndexError, match="index_select"):
            torch.kiln.synchronize()
    for t in (z, w):
        with pytest.raises(RuntimeError, match="never computed.*index_select"):
            t.sum().item()


# Note [Results of failed kernels]: a kernel that writes all of a buffer
# without reading it (out=, a fresh output, fill_, a random fill) ends the
# buffer's "never computed" mark once it has run, in stream order. So a block
# that the allocator hands to a new tensor while a mark is still to come on the
# stream (the kernel that reads a failed result marks its output when it runs,
# behind the gate here) holds the new values once they are written. Fused ops
# must end (and keep) marks exactly where their unfused kernels do.

# form -> (write(x, z): issues the write, returns the tensors to read, the
#          first of them the one in the reused block;
#          expected(x on the CPU): their values, or None for random fills;
#          the fused sequence it forms with fusion on, or None for none / one op)
PENDING_MARK_WRITES = {
    # the forms of test_sticky_errors.py's block-reuse test
    "add-out": (lambda x, z: [torch.add(x, 1, out=z)], lambda x: [x + 1], None),
    "fill_": (lambda x, z: [z.fill_(3.0)], lambda x: [torch.full((1000,), 3.0)], None),
    "uniform_": (lambda x, z: [z.uniform_()], None, None),
    "normal_": (lambda x, z: [z.normal_()], None, None),
    # out= then in-place on it, and out= then a read of it, in one group
    "add-out-then-mul_": (lambda x, z: [torch.add(x, 1, out=z).mul_(2)],
                          lambda x: [(x + 1) * 2], "aten::add.out, aten::mul.out"),
    "add-out-then-read": (lambda x, z: [torch.add(x, 1, out=z), z * 2],
                          lambda x: [x + 1, (x + 1) * 2], "aten::add.out, aten::mul.out"),
    "fill_-then-mul_": (lambda x, z: [z.fill_(3.0).mul_(2)],
                        lambda x: [torch.full((1000,), 6.0)], None),
    # functional: the fresh output itself is the reused block (z is None)
    "mul": (lambda x, z: [x * 2], lambda x: [x * 2], None),
    "relu": (lambda x, z: [torch.relu(x)], lambda x: [torch.relu(x)], None),
    "mul-then-neg": (lambda x, z: (lambda t: [t, -t])(x * 2), lambda x: [x * 2, -(x * 2)],
                     "aten::mul.out, aten::neg.out"),
}
# In-place on the reused block reads memory no kernel wrote: it keeps the mark,
# fused or not.
PENDING_MARK_READS = {
    "add_": lambda z: z.add_(1),
    "relu_": lambda z: z.relu_(),
    "add-out-self": lambda z: torch.add(z, 1, out=z),
}
FUNCTIONAL_WRITES = {"mul", "relu", "mul-then-neg"}


@contextlib.contextmanager
def block_with_a_pending_mark(device, side_stream, fusion):
    """Yields (x, y, block) with fusion switched to `fusion`, behind a gate on
    the current stream of `device` (a side stream if `side_stream`): y is a
    failed result (its error already raised), `block` the address of a freed
    kernel output that gets marked as never computed only when that kernel
    runs, once the block ends; the block is the next 1000 floats allocated."""
    with torch.kiln.device(device):
        stream = torch.kiln.Stream() if side_stream else torch.kiln.current_stream()
        stream.wait_stream(torch.kiln.current_stream())
        with torch.kiln.stream(stream):
            x = torch.randn(1000)
            kx = x.to(device)
            torch.index_select(kx, 0, torch.arange(1000, device=device))  # first call
            y = torch.index_select(kx, 0, torch.full((1000,), 5000, device=device))  # fails
            with pytest.raises(IndexError, match="index_select"):
                stream.synchronize()
            with adaptive_eager(fusion):
                with gated():
                    p = y * 2  # reads a failed result: marks its output when it runs
                    block = p.data_ptr()
                    del p
                    yield x, kx, y, block
                stream.synchronize()


@pytest.mark.parametrize("fusion", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("form", sorted(PENDING_MARK_WRITES))
def test_write_to_a_block_reused_while_a_mark_is_pending_holds_the_new_values(
        form, device, side_stream, fusion):
    write, expected, sequence = PENDING_MARK_WRITES[form]
    with torch.kiln.device(device):
        warm = torch.randn(1000, device=device)
        with adaptive_eager(False):  # first calls may synchronize (meta checks)
            for _ in range(2):
                write(warm, torch.empty_like(warm))
        torch.kiln.synchronize()
    torch.kiln.clear_op_tracking()
    with block_with_a_pending_mark(device, side_stream, fusion) as (x, kx, y, block):
        z = None if form in FUNCTIONAL_WRITES else torch.empty(1000, device=device)
        results = write(kx, z)
        reused = (results[0] if z is None else z).data_ptr()
        assert reused == block  # (no tensor in the message: printing would wait on the gate)
    if sequence is not None:
        assert torch.kiln.get_fused_ops() == ({sequence: 1} if fusion else {})
    if expected is None:
        values = results[0].cpu()
        assert values.isfinite().all() and values.std() > 0.1
    else:
        for actual, value in zip(results, expected(x)):
            assert_same(actual, value)
    with pytest.raises(RuntimeError, match="never computed.*index_select"):
        y.cpu()  # the failed result itself stays unreadable


@pytest.mark.parametrize("fusion", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("form", sorted(PENDING_MARK_READS))
def test_inplace_op_on_a_block_reused_while_a_mark_is_pending_keeps_the_mark(form, fusion):
    with adaptive_eager(False):
        warm = torch.randn(1000, device="kiln")
        for _ in range(2):
            PENDING_MARK_READS[form](warm)
        torch.kiln.synchronize()
    with block_with_a_pending_mark("kiln:0", False, fusion) as (x, kx, y, block):
        z = torch.empty(1000, device="kiln")
        reused = z.data_ptr()
        assert reused == block
        PENDING_MARK_READS[form](z)
        w = torch.add(kx, 1, out=torch.empty(1000, device="kiln"))  # another buffer: computed
    with pytest.raises(RuntimeError, match="never computed.*index_select"):
        z.cpu()
    assert_same(w, x + 1)


def warm_add_mul():
    """A kiln tensor after add and mul ran on it unfused; counters cleared."""
    a = torch.randn(1000, device="kiln")
    with adaptive_eager(False):
        (a + 1) * 2
    torch.kiln.synchronize()
    torch.kiln.clear_op_tracking()
    return a


def test_ops_are_still_counted_one_by_one():
    a = warm_add_mul()
    with adaptive_eager(True):
        with gated():
            (a + 1) * 2
        torch.kiln.synchronize()
    executed = torch.kiln.get_executed_ops()
    assert executed["aten::add.out"] == 1 and executed["aten::mul.out"] == 1
    assert torch.kiln.get_fused_ops() == {"aten::add.out, aten::mul.out": 1}
    torch.kiln.clear_op_tracking()
    assert torch.kiln.get_fused_ops() == {}


def test_profiler_names_a_group_of_one_op_as_the_unfused_kernel():
    a = torch.randn(1000, device="kiln")
    with adaptive_eager(False):
        a.relu()
    torch.kiln.synchronize()
    torch.kiln.clear_op_tracking()  # counts of earlier tests in this process
    with adaptive_eager(True):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
            with gated():
                a.relu()
            torch.kiln.synchronize()
    kernels = [e.name for e in prof.events()
               if e.device_type == DeviceType.PrivateUse1 and e.activity_type == "kernel"]
    assert "aten::relu" in kernels, kernels
    assert torch.kiln.get_fused_ops() == {}


def test_profiler_names_the_fused_task_by_the_ops_it_replaced():
    a = torch.randn(1000, device="kiln")
    with adaptive_eager(False):
        ((a + 1) * 2).relu()
    torch.kiln.synchronize()
    with adaptive_eager(True):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
            with gated():
                ((a + 1) * 2).relu()
            torch.kiln.synchronize()
    kernels = [e.name for e in prof.events()
               if e.device_type == DeviceType.PrivateUse1 and e.activity_type == "kernel"]
    assert "kiln::fused(aten::add, aten::mul, aten::relu)" in kernels, kernels
    assert "aten::add" not in kernels and "aten::mul" not in kernels


def test_switch_from_the_environment(tmp_path):
    code = """
import torch, torch_kiln
print(torch_kiln._C._adaptive_eager_enabled())
a = torch.randn(1000, device="kiln")
for _ in range(2):
    gate = torch_kiln._C._gate_stream(60.0)
    b = (a + 1) * 2
    gate()
    torch.kiln.synchronize()
print(torch.kiln.get_fused_ops())
"""
    off = run_python(code, {"KILN_ADAPTIVE_EAGER": None})
    assert off.returncode == 0, off.stderr
    assert off.stdout.split("\n")[:2] == ["False", "{}"]
    zero = run_python(code, {"KILN_ADAPTIVE_EAGER": "0"})
    assert zero.stdout.split("\n")[:2] == ["False", "{}"], zero.stderr
    on = run_python(code, {"KILN_ADAPTIVE_EAGER": "1", "KILN_KERNELS_CACHE_DIR": str(tmp_path)})
    assert on.returncode == 0, on.stderr
    lines = on.stdout.split("\n")
    assert lines[:2] == ["True", "{'aten::add.out, aten::mul.out': 2}"], on.stdout
    bad = run_python("import torch, torch_kiln\ntorch.ones(2, device='kiln') + 1",
                     {"KILN_ADAPTIVE_EAGER": "yes"})
    assert bad.returncode != 0
    assert "ValueError: KILN_ADAPTIVE_EAGER='yes' is invalid: expected 0" in bad.stderr


_BUILD_THEN_EXIT = """
import torch, torch_kiln
a = torch.randn(1000, device="kiln")
gate = torch_kiln._C._gate_stream(60.0)
b = (a + 1) * 2
gate()
torch.kiln.synchronize()
print(torch_kiln.kiln._fused_kernels.stats()["pending"])
"""


def test_exit_while_a_fused_kernel_builds(tmp_path):
    # An empty cache: the build runs (a compiler, seconds) when Python exits;
    # exit waits for it instead of crashing in the finalizing interpreter.
    result = run_python(_BUILD_THEN_EXIT, {"KILN_ADAPTIVE_EAGER": "1",
                                           "KILN_KERNELS_CACHE_DIR": str(tmp_path)})
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == "1\n"  # the build was still pending at exit


def test_a_failed_build_is_recorded_and_its_ops_run_unfused():
    code = """
import torch, torch_kiln
from torch_kiln.kiln import _fused_kernels

def failing_builder(signature, source):
    raise RuntimeError("no compiler here")

torch_kiln._C._set_fused_kernel_builder(failing_builder)
a = torch.randn(1000, device="kiln")
expected = (a.cpu() + 1) * 2
for _ in range(2):
    gate = torch_kiln._C._gate_stream(60.0)
    b = (a + 1) * 2
    gate()
    torch.kiln.synchronize()
    assert _fused_kernels.wait(60)
    assert torch.equal(b.cpu(), expected)
stats = _fused_kernels.stats()
print(stats["built"], stats["runs"], len(stats["failures"]))
print(stats["failures"][0].splitlines()[0])  # then the builder's traceback
print(torch.kiln.get_fused_ops())
"""
    result = run_python(code, {"KILN_ADAPTIVE_EAGER": "1"})
    assert result.returncode == 0, result.stderr
    counts, failure, fused = result.stdout.strip().split("\n")
    assert counts == "0 0 1"  # one build tried, once; no kernel ran
    assert failure.startswith("kiln adaptive eager: building the fused kernel for '")
    assert "failed; that run of ops stays unfused: RuntimeError: no compiler here" in failure
    assert fused == "{'aten::add.out, aten::mul.out': 2}"  # still one group per run


def _peculiar_run(a, b):
    # A run of generated ops no other test forms, so its plan's own kernel
    # is not built yet when the adaptive test starts.
    x = a
    for _ in range(3):
        x = (-x).sigmoid()
    return x * b


def test_adaptive_mode_runs_the_interpreter_until_a_plan_is_hot(private_kernel_cache):  # noqa: F811
    a, b = awkward_pair(5000)
    a, b = a.to("kiln"), b.to("kiln")
    with adaptive_eager(False):
        expected = _peculiar_run(a, b).cpu()
    hot = _C._FUSED_KERNEL_HOT_PLAN_RUNS
    with adaptive_eager(True), fused_kernels("adaptive"):
        def fused_run():
            with gated():
                result = _peculiar_run(a, b)
            torch.kiln.synchronize()
            assert_same(result.cpu(), expected)

        fused_run()  # queues the interpreter's build, at most: ATen per tile meanwhile
        assert _fused_kernels.wait(600), _fused_kernels.stats()
        built, interpreted = (_fused_kernels.stats()[key] for key in ("built", "interpreted_runs"))
        assert _fused_kernels.stats()["interpreter"]
        for _ in range(hot - 2):
            fused_run()
        stats = _fused_kernels.stats()
        assert stats["interpreted_runs"] == interpreted + hot - 2, stats
        assert (stats["built"], stats["pending"]) == (built, 0), stats  # not hot yet
        fused_run()  # the plan's 64th run: its own kernel is queued
        assert _fused_kernels.wait(600), _fused_kernels.stats()
        assert _fused_kernels.stats()["built"] == built + 1
        stats = _fused_kernels.stats()
        fused_run()
        after = _fused_kernels.stats()
        assert after["runs"] == stats["runs"] + 1  # its own kernel ran, not the interpreter
        assert after["interpreted_runs"] == stats["interpreted_runs"]
        assert after["failures"] == []


def test_set_fused_kernels_rejects_an_unknown_mode():
    before = _C._fused_kernels_mode()
    with pytest.raises(ValueError, match=r"_set_fused_kernels\('fast'\): expected 'aten', "
                                         r"'interpreted', 'specialized' or 'adaptive'"):
        _C._set_fused_kernels("fast")
    assert _C._fused_kernels_mode() == before == "adaptive"


def test_char_gpt_losses_with_fusion_on_equal_off(tmp_path):
    script = os.path.join(ROOT, "examples", "train_char_gpt.py")
    runs = {}
    for value in ("0", "1"):
        out = tmp_path / f"run-{value}.json"
        env = dict(os.environ, KILN_ADAPTIVE_EAGER=value)
        result = subprocess.run(
            [sys.executable, script, "--device", "kiln", "--max-steps", "5", "--batch-size", "4",
             "--block-size", "32", "--width", "32", "--layers", "2", "--heads", "2",
             "--sample-length", "0", "--json", str(out)],
            capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        runs[value] = json.loads(out.read_text())
    assert len(runs["0"]["steps"]) == 5
    assert runs["1"]["steps"] == runs["0"]["steps"]  # bit-equal floats
    assert runs["1"]["val_loss"] == runs["0"]["val_loss"]


def test_ops_captured_into_a_graph_are_not_fused():
    a = warm_add_mul()
    with adaptive_eager(True):
        graph = torch.kiln.KilnGraph()
        with torch.kiln.graph(graph):
            y = (a + 1) * 2
        assert graph.num_nodes() == 2  # captured one by one, as without fusion
        graph.replay()
        torch.kiln.synchronize()
    assert_same(y, (a.cpu() + 1) * 2)
    assert torch.kiln.get_fused_ops() == {}
    graph.reset()
