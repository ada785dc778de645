"""The kl lowering's optimisations never change a result: each example kernel
(examples/kernels/kl_*.py, the attention backward's included) gives
bit-identical outputs with every optimisation of torch_kiln/kl/lowering.py
on (the default) and off, on ragged shapes (masked edges), full tiles,
float32 and bfloat16, kiln:0 and kiln:1:

- elementwise fusion, into elementwise ops, last-axis reductions and stores
  (Note [kl elementwise fusion]);
- masks as row intervals (Note [kl interval masks]);
- program-invariant ops run once per chunk (Note [kl program-invariant ops]).

Each configuration builds its own kernel object (``kl.jit(kernel.fn)``):
a specialisation is built once per kernel object and process.
"""

import os
import sys

import pytest
import torch

import torch_kiln.kl as kl
from torch_kiln.kl import lowering
from kl_helpers import private_kernel_cache  # noqa: F401
from quick_shard import rotate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from examples.kernels import (kl_attention, kl_attention_backward, kl_matmul,  # noqa: E402
                              kl_rms_norm, kl_softmax)

SWITCHES = ("FUSE_ELEMENTWISE", "INTERVAL_MASKS", "HOIST_INVARIANT", "TRANSPOSE_BLOCKS")


@pytest.fixture(autouse=True)
def _cache(private_kernel_cache):  # noqa: F811
    yield


def randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def run_with(monkeypatch, module, name, call, on: dict):
    """``call()`` with module.<name> a fresh kernel object lowered with ``on``."""
    for switch, value in on.items():
        monkeypatch.setattr(lowering, switch, value)
    monkeypatch.setattr(module, name, kl.jit(getattr(module, name).fn))
    out = call()
    torch.kiln.synchronize()
    return out.cpu()


def attention_grads(q, k, v):
    """dq, dk, dv of the kl causal attention (32x16 blocks: the key walk
    starts off the query blocks' grid), flattened into one tensor."""
    q, k, v = (t.flatten(0, 1) for t in (q, k, v))
    out, lse = kl_attention.causal_attention_forward(q, k, v, 32, 16)
    grads = kl_attention.causal_attention_backward(v.sin(), q, k, v, out, lse, 32, 16)
    return torch.cat([g.flatten() for g in grads])


CASES = {
    # name: (module, kernel attribute, inputs(dtype), call(inputs))
    "rms_norm": (kl_rms_norm, "rms_norm_kernel",
                 lambda dt: (randn(37, 100, dtype=dt), randn(100, dtype=dt, seed=1)),
                 lambda x, w: kl_rms_norm.rms_norm(x, w, 1e-6, rows_per_program=4)),
    "rms_norm_full_tiles": (kl_rms_norm, "rms_norm_kernel",
                            lambda dt: (randn(64, 128, dtype=dt), randn(128, dtype=dt, seed=1)),
                            lambda x, w: kl_rms_norm.rms_norm(x, w, 1e-6)),
    "softmax": (kl_softmax, "softmax_kernel", lambda dt: (randn(37, 100, dtype=dt) * 5,),
                lambda x: kl_softmax.softmax(x, rows_per_program=4)),
    "softmax_full_tiles": (kl_softmax, "softmax_kernel",
                           lambda dt: (randn(16, 256, dtype=dt) * 5,), kl_softmax.softmax),
    "matmul_gelu": (kl_matmul, "matmul_bias_act_kernel",
                    lambda dt: (randn(70, 50, dtype=dt), randn(50, 90, dtype=dt, seed=1),
                                randn(90, dtype=dt, seed=2)),
                    lambda a, b, bias: kl_matmul.matmul_bias_act(a, b, bias, kl_matmul.GELU_TANH)),
    "attention": (kl_attention, "attention_kernel",
                  lambda dt: tuple(randn(2, 3, 100, 16, dtype=dt, seed=s) for s in range(3)),
                  lambda q, k, v: kl_attention.causal_attention(q, k, v, block=(32, 32))),
    # the backward's two loops: a runtime loop start (from the diagonal on),
    # loop-invariant k/v tiles, several accumulators, transposes into matmul
    "attention_backward_dkdv": (kl_attention_backward, "attention_backward_dkdv_kernel",
                                lambda dt: tuple(randn(2, 3, 100, 16, dtype=dt, seed=s)
                                                 for s in range(3)), attention_grads),
    "attention_backward_dq": (kl_attention_backward, "attention_backward_dq_kernel",
                              lambda dt: tuple(randn(2, 3, 100, 16, dtype=dt, seed=s)
                                               for s in range(3)), attention_grads),
}


@pytest.mark.parametrize("case,dtype,device", rotate(  # each case once in `make test`
    sorted(CASES), [torch.float32, torch.bfloat16], ["kiln:0", "kiln:1"]))
def test_optimised_lowering_is_bit_identical_to_the_plain_one(case, dtype, device, monkeypatch):
    module, name, inputs, call = CASES[case]
    args = [t.to(device) for t in inputs(dtype)]
    plain = run_with(monkeypatch, module, name, lambda: call(*args),
                     {s: False for s in SWITCHES})
    optimised = run_with(monkeypatch, module, name, lambda: call(*args),
                         {s: True for s in SWITCHES})
    assert optimised.dtype == dtype
    assert torch.equal(optimised, plain), (optimised - plain).abs().max()


def test_rms_norm_source_reads_no_mask_tile_and_loads_the_weight_once_per_chunk():
    x = torch.randn(64, 128, device="kiln")
    w = torch.randn(128, device="kiln")
    out = torch.empty_like(x)
    src = kl_rms_norm.rms_norm_kernel.source(out, x, w, 64, 128, 1e-6, ROWS=4, BLOCK=128)
    body = src[src.index("KILN_KERNEL("):]
    assert "bool* __restrict" not in body  # no mask tile is materialised
    assert body.count("kl_compare_interval(") >= 3  # the masks as row intervals
    program_loop = body.index("for (int64_t kl_program")
    weight_load = body.index("weight_data + (")
    assert weight_load < program_loop  # hoisted out of the program loop
    x_load = body.index("x_data + (")
    assert x_load > program_loop
    # v * v is summed in the reduction's loop, not stored first
    assert any("vacc" in line and "+ (KlVec::loadu(" in line and ") * KlVec::loadu(" in line
               for line in body.splitlines()), "v * v is not fused into its sum"


@kl.jit
def mask_as_value_kernel(out, n, BLOCK: kl.constexpr):
    cols = kl.arange(0, BLOCK)
    inside = cols < n
    kl.store(out, cols, inside.to(kl.float32) * 2.0, mask=cols < BLOCK)


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_a_mask_read_as_a_value_is_still_computed(device, monkeypatch):
    out = torch.full((16,), -1.0, device=device)
    src = mask_as_value_kernel.source(out, 5, BLOCK=16)
    assert "bool* __restrict" in src[src.index("KILN_KERNEL("):]
    mask_as_value_kernel[(1,)](out, 5, BLOCK=16)
    assert out.cpu().tolist() == [2.0] * 5 + [0.0] * 11


def test_attention_causal_mask_is_an_interval_in_where():
    q = torch.randn(1, 64, 16, device="kiln")
    out = torch.empty_like(q)
    lse = torch.empty(1, 64, device="kiln")
    src = kl_attention.attention_kernel.source(out, lse, q, q, q, 64, 0.25, BM=32, BN=32, D=16)
    body = src[src.index("KILN_KERNEL("):]
    assert "bool* __restrict" not in body
    assert body.count("kl_gemm(") == 2  # q @ k^T and p @ v through oneDNN's brgemm


@kl.jit
def masked_copy_kernel(out, x, lo, hi, BLOCK: kl.constexpr):
    # row r keeps the columns c with lo < c <= hi and BLOCK - 1 - c >= r:
    # conditions with both signs of coefficient, >, <= and >=
    r = kl.program_id(0)
    cols = kl.arange(0, BLOCK)
    mask = (cols > lo) & (cols <= hi) & ((BLOCK - 1 - cols) >= r)
    v = kl.load(x, (r, cols), mask=mask, other=-7.0)
    kl.store(out, (r, cols), kl.where(mask, v * 2.0, v), mask=cols < BLOCK)


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("lo, hi", [(2, 11), (-5, 40), (20, 30), (-100, -50), (7, 3)])
def test_interval_masks_match_the_simulator_including_empty_rows(device, lo, hi):
    # (20, 30) and (-100, -50) enable nothing in any row (the interval lies
    # past either end of the row); they must give `other` and write nothing
    # outside the row
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(3))
    guard = torch.full((3, 16), 123.0)
    expected = torch.empty(16, 16)
    masked_copy_kernel[(16,)](expected, x, lo, hi, BLOCK=16)  # CPU tensors: the simulator
    buf = torch.cat([guard, torch.full((16, 16), float("nan")), guard]).to(device)
    out = buf[3:19]
    masked_copy_kernel[(16,)](out, x.to(device), lo, hi, BLOCK=16)
    assert torch.equal(out.cpu(), expected)
    assert torch.equal(buf[:3].cpu(), guard) and torch.equal(buf[19:].cpu(), guard)


@kl.jit
def empty_interval_kernel(out, x, w, lo, BLOCK: kl.constexpr):
    r = kl.program_id(0)
    cols = kl.arange(0, BLOCK)
    v = kl.load(x, (r, cols), mask=cols > lo, other=-7.0)  # no column when lo >= BLOCK - 1
    wt = kl.load(w, cols)  # program-invariant: loaded once, its buffer follows v's
    kl.store(out, (r, cols), v + wt)


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("lo", [20, 15, 3, -4])
def test_an_interval_past_the_row_end_writes_only_the_row(device, lo):
    # lo = 20: the interval [21, 21) lies past the 16-element row; filling
    # the row with `other` must not run on into the next tile's scratch
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
    w = torch.arange(16.0)
    expected = torch.where(torch.arange(16) > lo, x, torch.tensor(-7.0)) + w
    out = torch.empty(4, 16, device=device)
    empty_interval_kernel[(4,)](out, x.to(device), w.to(device), lo, BLOCK=16)
    assert torch.equal(out.cpu(), expected)


@kl.jit
def carried_sum_kernel(out, doubled, w, steps, BLOCK: kl.constexpr):
    # acc starts as the sum of a program-invariant tile (read twice, so the
    # sum is accumulated in the tile's loop) and is rewritten by the loop:
    # each program must start from the sum again
    cols = kl.arange(0, BLOCK)
    w2 = kl.load(w, cols) * 2.0
    acc = kl.sum(w2, axis=0)
    for i in kl.range(0, steps, 1):
        acc = acc + 1.0
    kl.store(out, kl.program_id(0), acc)
    kl.store(doubled, kl.program_id(0) * BLOCK + cols, w2)


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_a_loop_carried_reduction_of_an_invariant_tile_restarts_in_each_program(device):
    w = torch.arange(16.0)
    out = torch.zeros(8, device=device)
    doubled = torch.zeros(8 * 16, device=device)
    carried_sum_kernel[(8,)](out, doubled, w.to(device), 3, BLOCK=16)
    assert out.cpu().tolist() == [float(w.sum() * 2 + 3)] * 8
    assert torch.equal(doubled.cpu(), (w * 2).repeat(8))


# Found by trying to break the optimisations (a helper's adversarial run).

@kl.jit
def fast_exp_kernel(out, x, BLOCK: kl.constexpr):
    cols = kl.arange(0, BLOCK)
    kl.store(out, cols, kl.fast_exp(kl.load(x, cols)))


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_fast_exp_propagates_nan(device):
    x = torch.tensor([float("nan"), 0.0, 1.0, -1.0] * 4)  # 16: whole vectors
    out = torch.zeros(16, device=device)
    fast_exp_kernel[(1,)](out, x.to(device), BLOCK=16)
    assert torch.isnan(out.cpu()[::4]).all(), out.cpu()


@kl.jit
def row_reductions_kernel(out, x, N: kl.constexpr):
    # unfused (a loaded tile) and fused (an elementwise expression reduced in
    # the loop that computes it): each ends with kl_lanes_* over the vector
    # accumulator, then the tail elements
    r = kl.program_id(0)
    t = kl.load(x, (r, kl.arange(0, N)))
    cols = kl.arange(0, 6)
    kl.store(out, (r, cols), kl.where(cols == 0, kl.max(t, axis=0),
                                      kl.where(cols == 1, kl.min(t, axis=0),
                                               kl.where(cols == 2, kl.sum(t, axis=0),
                                                        kl.where(cols == 3, kl.max(t * 1.0, axis=0),
                                                                 kl.where(cols == 4, kl.min(t * 1.0, axis=0),
                                                                          kl.sum(t * 1.0, axis=0)))))))


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("n", [16, 32, 35])  # whole vectors (AVX-512, AVX2) and a tail
def test_row_reductions_propagate_nan_and_inf_from_every_lane(device, n):
    # a NaN, +inf or -inf in each position of a row: the lanes are combined
    # by a tree of shuffles (kl_lanes_max etc.), so every lane must reach the
    # result
    rows = []
    for special in (float("nan"), float("inf"), -float("inf")):
        for pos in range(n):
            row = torch.arange(n, dtype=torch.float32) - n / 2
            row[pos] = special
            rows.append(row)
    x = torch.stack(rows)
    out = torch.zeros(len(rows), 6, device=device)
    row_reductions_kernel[(len(rows),)](out, x.to(device), N=n)
    expected = torch.stack([x.amax(1), x.amin(1), x.sum(1)] * 2, dim=1)
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_fast_exp_near_the_float32_underflow(device):
    # exp(-87) = 1.65e-38 and exp(-87.3) = 1.22e-38 are normal floats
    x = torch.tensor([-87.0, -87.3, -86.8, -88.0] * 4)
    out = torch.zeros(16, device=device)
    fast_exp_kernel[(1,)](out, x.to(device), BLOCK=16)
    ref = torch.exp(x)
    assert torch.allclose(out.cpu(), ref, rtol=1e-5, atol=0), (out.cpu(), ref)


def _ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in float32 units in the last place (ordered bit patterns)."""
    def ordered(t):
        i = t.view(torch.int32).to(torch.int64)
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
    return (ordered(a) - ordered(b)).abs()


@kl.jit
def fast_exp_blocks_kernel(out, x, BLOCK: kl.constexpr):
    cols = kl.program_id(0) * BLOCK + kl.arange(0, BLOCK)
    kl.store(out, cols, kl.fast_exp(kl.load(x, cols)))


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_fast_exp_is_within_5_ulp_on_a_dense_sweep(device):
    # 2^20 floats spread over every exponent that matters: overflow, the
    # normal range, the denormal results below exp(-87.34), and underflow to
    # 0; plus the specials. The reference is exp in float64, rounded once.
    x = torch.cat([torch.linspace(-110.0, 100.0, 1 << 20),
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 88.7228, -103.97])])
    n = x.numel() + (-x.numel()) % 1024  # whole blocks, padded with zeros
    x = torch.cat([x, torch.zeros(n - x.numel())])
    out = torch.empty(n, device=device)
    fast_exp_blocks_kernel[(n // 1024,)](out, x.to(device), BLOCK=1024)
    ref = torch.exp(x.double()).float()
    got = out.cpu()
    ulp = _ulp_distance(got, ref)
    assert ulp.max().item() <= 5, (x[ulp.argmax()].item(), got[ulp.argmax()].item(),
                                   ref[ulp.argmax()].item())
    assert torch.equal(got[x == float("inf")], torch.tensor([float("inf")]))
    assert torch.equal(got[x == -float("inf")], torch.tensor([0.0]))


@kl.jit
def store_then_load_kernel(out, x, BLOCK: kl.constexpr):
    cols = kl.arange(0, BLOCK)
    kl.store(out, cols, kl.full((BLOCK,), 3.0))
    v = kl.load(x, cols)  # no program_id: program-invariant, but reads the store above
    kl.store(out, cols + BLOCK, v + 1.0)


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_a_load_after_a_store_to_the_same_tensor_reads_the_stored_value(device):
    buf = torch.zeros(16, device=device)
    store_then_load_kernel[(1,)](buf, buf, BLOCK=8)
    simulated = torch.zeros(16)
    store_then_load_kernel[(1,)](simulated, simulated, BLOCK=8)
    assert simulated.tolist() == [3.0] * 8 + [4.0] * 8
    assert buf.cpu().tolist() == simulated.tolist()


@kl.jit
def carried_limit_kernel(out, x, n, BLOCK: kl.constexpr):
    cols = kl.arange(0, BLOCK)
    lim = n + 0
    m = cols < lim  # made before the loop: cols < n in every iteration
    v = kl.load(x, cols)
    acc = kl.zeros((BLOCK,))
    for k in kl.range(0, 3):
        acc = acc + kl.load(x, cols, mask=m, other=0.0) + kl.where(m, v, 0.0)
        kl.store(out, cols + BLOCK, acc, mask=m)
        lim = lim + 2  # a loop-carried scalar the mask compares with
    kl.store(out, cols, acc)


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_an_interval_mask_made_before_a_loop_keeps_its_value_in_the_loop(device):
    out = torch.zeros(32, device=device)
    carried_limit_kernel[(1,)](out, torch.ones(16, device=device), 4, BLOCK=16)
    expected = torch.zeros(32)
    expected[:4] = 6.0
    expected[16:20] = 6.0
    simulated = torch.zeros(32)
    carried_limit_kernel[(1,)](simulated, torch.ones(16), 4, BLOCK=16)
    assert torch.equal(simulated, expected)
    assert torch.equal(out.cpu(), expected), out.cpu()


@kl.jit
def tile3d_kernel(out, total, x, A: kl.constexpr, B: kl.constexpr, C: kl.constexpr):
    a = kl.arange(0, A)[:, None, None]
    b = kl.arange(0, B)[None, :, None]
    c = kl.arange(0, C)[None, None, :]
    v = kl.load(x, (a, b, c))
    kl.store(out, (a, b, c), v * 2.0 + 1.0)
    kl.store(total, (kl.arange(0, A)[:, None], kl.arange(0, B)[None, :]), kl.sum(v, axis=2))


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_a_3d_tile_is_loaded_computed_and_stored_row_by_row(device):
    x = torch.arange(60.0).reshape(3, 4, 5)
    out = torch.zeros(3, 4, 5, device=device)
    total = torch.zeros(3, 4, device=device)
    tile3d_kernel[(1,)](out, total, x.to(device), A=3, B=4, C=5)
    assert torch.equal(out.cpu(), x * 2 + 1), out.cpu()[0]
    assert torch.equal(total.cpu(), x.sum(2))


@kl.jit
def _transpose_kernel(out, x, R: kl.constexpr, C: kl.constexpr):
    r, c = kl.arange(0, R), kl.arange(0, C)
    t = kl.load(x, (r[:, None], c[None, :])) * 2.0  # a tile in a buffer
    kl.store(out, (c[:, None], r[None, :]), kl.transpose(t))


# Shapes on and off the 8- and 16-wide SIMD blocks of kl_transpose_f32 (a
# whole block, edge columns, edge rows, both, a single row or column).
@pytest.mark.parametrize("shape", [(16, 16), (37, 21), (1, 19)] + [
    pytest.param(shape, marks=pytest.mark.slow) for shape in [(32, 8), (24, 20), (19, 1), (8, 40)]])
def test_transpose_of_a_buffered_tile_is_exact(shape, monkeypatch):
    rows, cols = shape
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    results = []
    for on in (True, False):
        monkeypatch.setattr(lowering, "TRANSPOSE_BLOCKS", on)
        kernel = kl.jit(_transpose_kernel.fn)
        out = torch.empty(cols, rows, device="kiln")
        kernel[(1,)](out, x.to("kiln"), R=rows, C=cols)
        source = kernel.source(out, x.to("kiln"), R=rows, C=cols)
        assert ("kl_transpose_f32(v" in source) == on
        results.append(out.cpu())
    assert torch.equal(results[0], (x * 2.0).t())
    assert torch.equal(results[1], results[0])


# Note [kl loop-carried state] (tracer.py): found by a helper's adversarial
# run; compiled kernels silently differed from the simulator.

@kl.jit
def _swap_kernel(oa, ob, x, n_iter, N: kl.constexpr, TRANSPOSED: kl.constexpr):
    r = kl.arange(0, N)
    a = kl.load(x, (r[:, None], r[None, :]))
    b = a * 10.0
    s, u = kl.sum(kl.sum(a, axis=1), axis=0), kl.sum(kl.sum(b, axis=1), axis=0)  # scalars
    for _ in kl.range(0, n_iter, 1):
        if TRANSPOSED:
            a, b = kl.transpose(b), a
        else:
            a, b = b, a
        s, u = u, s + 1.0
    kl.store(oa, (r[:, None], r[None, :]), a + s)
    kl.store(ob, (r[:, None], r[None, :]), b + u)


@kl.jit
def _shift_kernel(oa, ob, x, n_iter, N: kl.constexpr):
    r = kl.arange(0, N)
    a = kl.load(x, (r,))
    b = kl.zeros((N,), kl.float32)
    for _ in kl.range(0, n_iter, 1):
        a, b = a + 1.0, a  # b takes a's state of the iteration before
    kl.store(oa, (r,), a)
    kl.store(ob, (r,), b)


def _compiled_and_simulated(kernel, outs, args, **constexprs):
    compiled = [o.to("kiln") for o in outs]
    kernel[(1,)](*compiled, *[a.to("kiln") if isinstance(a, torch.Tensor) else a for a in args],
                 **constexprs)
    simulated = [o.clone() for o in outs]
    kl.jit(kernel.fn, simulate=True)[(1,)](*simulated, *args, **constexprs)
    return [o.cpu() for o in compiled], simulated


@pytest.mark.parametrize("n_iter", [0, 1, 2, 3])
@pytest.mark.parametrize("transposed", [False, True])
def test_swapped_loop_carried_tiles_and_scalars(n_iter, transposed):
    x = torch.arange(16.0).reshape(4, 4)
    outs = [torch.zeros(4, 4), torch.zeros(4, 4)]
    compiled, simulated = _compiled_and_simulated(_swap_kernel, outs, [x, n_iter], N=4,
                                                  TRANSPOSED=transposed)
    a, b, s, u = x, x * 10.0, x.sum(), (x * 10.0).sum()
    for _ in range(n_iter):
        a, b = (b.t() if transposed else b), a
        s, u = u, s + 1.0
    assert torch.equal(simulated[0], a + s) and torch.equal(simulated[1], b + u)
    assert torch.equal(compiled[0], simulated[0]) and torch.equal(compiled[1], simulated[1])


@pytest.mark.parametrize("n_iter", [1, 2, 3])
def test_a_carried_tile_taking_another_carried_tiles_state(n_iter):
    x = torch.arange(4.0)
    compiled, simulated = _compiled_and_simulated(_shift_kernel, [torch.zeros(4), torch.zeros(4)],
                                                  [x, n_iter], N=4)
    assert torch.equal(simulated[0], x + n_iter) and torch.equal(simulated[1], x + n_iter - 1)
    assert torch.equal(compiled[0], simulated[0]) and torch.equal(compiled[1], simulated[1])


@kl.jit
def _shared_start_kernel(oa, ob, x, n_iter, N: kl.constexpr, COPY: kl.constexpr):
    r = kl.arange(0, N)
    t = kl.load(x, (r,))
    a = b = kl.zeros((N,), kl.float32)
    if COPY:
        b = a * 1
    for _ in kl.range(0, n_iter, 1):
        a = a + t
        b = b + 10.0
    kl.store(oa, (r,), a)
    kl.store(ob, (r,), b)


@kl.jit
def _alias_of_state_kernel(out, x, n_iter, N: kl.constexpr):
    r = kl.arange(0, N)
    t = kl.load(x, (r,))
    acc = t
    for _ in kl.range(0, n_iter, 1):
        acc = acc + t
    kl.store(out, (r,), acc + t)


def test_two_names_on_one_tile_before_a_loop_that_assigns_one_is_an_error():
    x = torch.arange(4.0)
    outs = [torch.zeros(4, device="kiln"), torch.zeros(4, device="kiln")]
    with pytest.raises(kl.KernelError, match=r"kl kernel '_shared_start_kernel' at .*"
                                         r"test_kl_lowering.py:\d+: 'a' and 'b' hold the same "
                                         r"tile when the kl.range loop starts"):
        _shared_start_kernel[(1,)](*outs, x.to("kiln"), 2, N=4, COPY=False)
    with pytest.raises(kl.KernelError, match="'acc' and 't' hold the same tile .* for example "
                                         "acc = kl.zeros\\(...\\) or acc = t \\* 1"):
        _alias_of_state_kernel[(1,)](outs[0], x.to("kiln"), 2, N=4)
    # the fix the message names works, compiled as simulated
    compiled, simulated = _compiled_and_simulated(_shared_start_kernel,
                                                  [torch.zeros(4), torch.zeros(4)], [x, 2],
                                                  N=4, COPY=True)
    assert torch.equal(simulated[0], 2 * x) and torch.equal(simulated[1], torch.full((4,), 20.0))
    assert torch.equal(compiled[0], simulated[0]) and torch.equal(compiled[1], simulated[1])


@kl.jit
def _shrinking_bound_kernel(out, n, N: kl.constexpr):
    r = kl.arange(0, N)
    acc = kl.zeros((N,), kl.float32)
    m = n * 1
    for _ in kl.range(0, m, 1):
        acc = acc + 1.0
        m = m - 1  # Python's range read its end once
    kl.store(out, (r,), acc + m * 100)


@pytest.mark.parametrize("n", [0, 2, 5])
def test_a_carried_loop_bound_is_read_once(n):
    compiled, simulated = _compiled_and_simulated(_shrinking_bound_kernel, [torch.zeros(4)], [n],
                                                  N=4)
    assert torch.equal(simulated[0], torch.full((4,), float(n)))  # m ends at 0
    assert torch.equal(compiled[0], simulated[0])


@kl.jit
def _same_tile_at_the_end_kernel(oa, ob, n, N: kl.constexpr, CASE: kl.constexpr):
    r = kl.arange(0, N)
    a = kl.zeros((N,), kl.float32)
    b = kl.full((N,), 5.0, kl.float32)
    for _ in kl.range(0, n, 1):  # LINE:same-at-end
        if CASE == 0:
            a = b = a + 1.0
        else:
            a = b
    kl.store(oa, (r,), a)
    kl.store(ob, (r,), b)


@kl.jit
def _old_value_kernel(oa, oo, n, N: kl.constexpr):
    r = kl.arange(0, N)
    a = kl.zeros((N,), kl.float32)
    for _ in kl.range(0, n, 1):
        old = a
        a = a + 1.0
    kl.store(oa, (r,), a)
    kl.store(oo, (r,), old)


def _accumulate(acc, n):
    for _ in kl.range(0, n, 1):
        acc = acc + 1.0
    return acc


@kl.jit
def _loop_in_a_helper_kernel(o1, o2, x, n, N: kl.constexpr):
    r = kl.arange(0, N)
    a = kl.load(x, (r,))
    s = _accumulate(a, n)
    kl.store(o1, (r,), a)
    kl.store(o2, (r,), s)


@kl.jit
def _tile_becomes_number_kernel(out, n, N: kl.constexpr):
    a = kl.zeros((N,), kl.float32)
    for _ in kl.range(0, n, 1):
        a = 1.0
    kl.store(out, (kl.arange(0, N),), a)


def test_names_that_would_read_another_names_loop_state_are_errors():
    two = [torch.zeros(4, device="kiln"), torch.zeros(4, device="kiln")]
    for case in (0, 1):
        with pytest.raises(kl.KernelError, match="'[ab]' and '[ab]' hold the same tile at the end "
                                                 "of the kl.range loop's body"):
            _same_tile_at_the_end_kernel[(1,)](*two, 2, N=4, CASE=case)
    with pytest.raises(kl.KernelError, match="'old' holds the value 'a' had at the start of an "
                                             "iteration .* copy it \\(old = a \\* 1\\)"):
        _old_value_kernel[(1,)](*two, 2, N=4)
    with pytest.raises(kl.KernelError, match="'acc' and 'a' \\(in _loop_in_a_helper_kernel\\) "
                                             "hold the same tile when the kl.range loop starts"):
        _loop_in_a_helper_kernel[(1,)](*two, torch.ones(4, device="kiln"), 2, N=4)
    with pytest.raises(kl.KernelError, match="'a' is a tile before the kl.range loop and float "
                                             "1.0 at the end of its body"):
        _tile_becomes_number_kernel[(1,)](two[0], 2, N=4)


@kl.jit
def _moving_offsets_kernel(out, x, K, BK: kl.constexpr):
    offs = kl.arange(0, BK)
    z = kl.arange(0, 1)
    acc = kl.zeros((1, BK), kl.float32)
    for _ in kl.range(0, K, BK):
        v = kl.load(x, (z[:, None], offs[None, :]), mask=offs[None, :] < K, other=0.0)
        acc = acc + v
        offs = offs + BK  # a carried int64 index tile: forms built from it must follow it
    kl.store(out, (z[:, None], kl.arange(0, BK)[None, :]), acc + (offs[None, :] - offs[None, :]))


@pytest.mark.parametrize("k", [0, 4, 16, 14])
def test_index_tiles_built_from_a_carried_index_tile(k):
    x = torch.arange(16.0).reshape(1, 16)[:, :max(k, 1)].contiguous()
    compiled, simulated = _compiled_and_simulated(_moving_offsets_kernel, [torch.zeros(1, 4)],
                                                  [x, k], BK=4)
    padded = torch.nn.functional.pad(x[:, :k], (0, (-k) % 4))
    expected = padded.reshape(1, -1, 4).sum(1) if k else torch.zeros(1, 4)
    assert torch.equal(simulated[0], expected)
    assert torch.equal(compiled[0], simulated[0])


# int64 overflow. The simulator runs on PyTorch's int64 tensors, which wrap
# (two's complement); compiled kernels are built with -fwrapv so that plain
# arithmetic wraps the same way, and masks (computed as exact row intervals,
# Note [kl interval masks]) raise rather than differ where an operand would
# wrap. Both cases were silently different before: g++ folded (n * 4) // 4
# to n and m + 1 > m to true.
@kl.jit
def wrapping_arithmetic_kernel(out, n, BLOCK: kl.constexpr):
    i = kl.arange(0, BLOCK)
    m = (n * 4) // 4
    kl.store(out, (i,), m + i * 0)


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_int64_arithmetic_wraps_as_in_the_simulator(device):
    n = 2**62 + 1
    expected = (torch.tensor(n) * 4) // 4  # PyTorch's wrapped int64: 1
    simulated = torch.zeros(4, dtype=torch.int64)
    wrapping_arithmetic_kernel[(1,)](simulated, n, BLOCK=4)
    out = torch.zeros(4, dtype=torch.int64, device=device)
    wrapping_arithmetic_kernel[(1,)](out, n, BLOCK=4)
    assert expected.item() == 1
    assert simulated.tolist() == [1] * 4
    assert out.cpu().tolist() == simulated.tolist()


@kl.jit
def successor_mask_kernel(out, n, BLOCK: kl.constexpr):
    i = kl.arange(0, BLOCK)
    m = n + i
    kl.store(out, (i,), kl.where(m + 1 > m, 1, 0))


@kl.jit
def descending_mask_kernel(out, n, BLOCK: kl.constexpr):
    i = kl.arange(0, BLOCK)
    m = n - i * 3
    kl.store(out, (i,), kl.where(m - 1 < m, 1, 0))


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_a_mask_comparison_at_the_int64_limit(device):
    # inside int64 up to the last element: the simulator's mask, exactly
    out = torch.zeros(4, dtype=torch.int64, device=device)
    successor_mask_kernel[(1,)](out, 2**63 - 5, BLOCK=4)
    simulated = torch.zeros(4, dtype=torch.int64)
    successor_mask_kernel[(1,)](simulated, 2**63 - 5, BLOCK=4)
    assert simulated.tolist() == [1, 1, 1, 1]
    assert out.cpu().tolist() == simulated.tolist()
    # m + 1 wraps at the last element: the simulator wraps (m + 1 > m is
    # false there); compiled kl does not guess, it names the comparison
    successor_mask_kernel[(1,)](simulated, 2**63 - 4, BLOCK=4)
    assert simulated.tolist() == [1, 1, 1, 0]
    with pytest.raises(RuntimeError, match=r"kl kernel 'successor_mask_kernel' at .*test_kl_lowering.py:\d+: "
                                           r"kl.gt: an operand of the mask's comparison leaves int64 "
                                           r"at element 3"):
        successor_mask_kernel[(1,)](out, 2**63 - 4, BLOCK=4)
        torch.kiln.synchronize(device)
    # the message names the first element that wraps, not the row's end
    wide = torch.zeros(16, dtype=torch.int64, device=device)
    with pytest.raises(RuntimeError, match=r"leaves int64 at element 4 of a row"):
        successor_mask_kernel[(1,)](wide, 2**63 - 5, BLOCK=16)
        torch.kiln.synchronize(device)
    with pytest.raises(RuntimeError, match=r"kl.lt: an operand .* leaves int64 at element 3 "):
        descending_mask_kernel[(1,)](wide, -2**63 + 7, BLOCK=16)
        torch.kiln.synchronize(device)
    # later work runs (out itself was never written: kiln marks it so)
    again = torch.zeros(4, dtype=torch.int64, device=device)
    successor_mask_kernel[(1,)](again, 7, BLOCK=4)
    assert again.cpu().tolist() == [1, 1, 1, 1]


@kl.jit
def trip_count_kernel(out, lo, hi, STEP: kl.constexpr):
    cnt = kl.full((), 0, kl.int64)
    last = kl.full((), 0, kl.int64)
    for k in kl.range(lo, hi, STEP):
        cnt = cnt + 1
        last = k + 0
    i = kl.arange(0, 2)
    kl.store(out, (i,), kl.where(i == 0, cnt, last))


@pytest.mark.parametrize("lo, hi, step, device", rotate(
    [(2**63 - 8, 2**63 - 1, 4), (0, 2**63 - 1, 2**62), (-2**63, 2**63 - 1, 2**62), (-5, 3, 2),
     (5, 1, 1), (7, 7, 3), (2**63 - 2, 2**63 - 1, 1)], ["kiln:0", "kiln:1"]))
def test_a_range_loop_runs_pythons_trip_count_up_to_the_int64_limits(device, lo, hi, step):
    # compiled, k += STEP wrapped near the int64 maximum and `k < hi` held
    # for ever (a hang); the loop now counts Python's range's trips
    expected = [len(range(lo, hi, step)), range(lo, hi, step)[-1] if range(lo, hi, step) else 0]
    simulated = torch.zeros(2, dtype=torch.int64)
    trip_count_kernel[(1,)](simulated, lo, hi, STEP=step)
    out = torch.zeros(2, dtype=torch.int64, device=device)
    trip_count_kernel[(1,)](out, lo, hi, STEP=step)
    assert simulated.tolist() == expected
    assert out.cpu().tolist() == expected


# Scalar arguments and scalar tiles with bfloat16/float16 tiles promote and
# round as PyTorch's 0-dim tensors and Python numbers do (Note [kl Python
# numbers with half tiles]): bf16 x - 1.01 subtracted 1.01f where PyTorch
# subtracts bf16(1.01) = 1.0078125, and bf16 1.0 + 257 gave 258, not 256.
@kl.jit
def half_scalar_kernel(o, x, s, OP: kl.constexpr, N: kl.constexpr):
    i = kl.arange(0, N)
    v = kl.load(x, (i,))
    if OP == 0:
        r = v - s
    if OP == 1:
        r = v * s
    if OP == 2:
        r = s - v
    if OP == 3:
        r = (v == s).to(kl.float32)
    if OP == 4:
        r = v / s
    if OP == 5:
        r = v + kl.sum(v.to(kl.float32), axis=0) * 0.0 + s  # a computed float32 scalar
    kl.store(o, (i,), r)


_HALF_OPS = {0: lambda x, s: x - s, 1: lambda x, s: x * s, 2: lambda x, s: s - x,
             3: lambda x, s: (x == s).to(x.dtype), 4: lambda x, s: x / s,
             5: lambda x, s: x + s}


@pytest.mark.parametrize("op, s, dtype", rotate(  # each op once in `make test`
    sorted(_HALF_OPS), [1.01, 257, 0.3], [torch.bfloat16, torch.float16]))
def test_scalar_arguments_with_half_tiles_round_as_pytorch(dtype, s, op):
    x = torch.tensor([1.0, 1.0078125, 3.3, -7.1, 256, 300], dtype=dtype)
    expected = _HALF_OPS[op](x, s)
    for device in ("cpu", "kiln:0", "kiln:1"):  # the simulator, then compiled
        out = torch.empty_like(x, device=device)
        half_scalar_kernel[(1,)](out, x.to(device), s, OP=op, N=6)
        assert torch.equal(out.cpu(), expected), (device, out.cpu(), expected)


@kl.jit
def wide_row_copy_kernel(out, x, BLOCK: kl.constexpr):
    c = kl.arange(0, BLOCK)
    kl.store(out, (c,), kl.load(x, (c,)))


@pytest.mark.parametrize("device", ["cpu", "kiln:0"])
def test_an_index_tile_over_a_partition_is_not_held_to_scratch(device):
    # the int64 kl.arange of 32,768 is 256 KiB but computed in place; the
    # bf16 row it indexes (64 KiB) fits: this raised before
    x = torch.randn(32768, device=device).bfloat16()
    out = torch.empty_like(x)
    wide_row_copy_kernel[(1,)](out, x, BLOCK=32768)
    assert torch.equal(out.cpu(), x.cpu())
    # a float32 row of 65,536 (256 KiB) is still over the limit
    y = torch.randn(65536, device=device)
    with pytest.raises(kl.KernelError, match=r"tile of shape \(65536,\) float32 needs 262144 bytes"):
        wide_row_copy_kernel[(1,)](torch.empty_like(y), y, BLOCK=65536)
