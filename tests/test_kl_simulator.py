"""The kl simulator (KILN_KL_SIMULATE=1, @kl.jit(simulate=True), and every
call on CPU tensors) against the compiled kernel: one kernel exercising the
language (elementwise math with broadcasting, casts, integer floor division
and remainder, bool logic, where, reductions with and without keepdims,
matmul, transpose, static and dynamic loops with loop-carried tiles and
scalars, program ids of a 2-program grid, ragged masks, strided inputs) must
give the same numbers simulated and compiled, for float32 and bfloat16
inputs; plus what only the simulator does: print of tiles, NaN-filled
uninitialised tiles, out-of-bounds accesses reported with the line.
"""

import pytest
import torch

import torch_kiln.kl as kl
from kl_helpers import private_kernel_cache, where  # noqa: F401
from quick_shard import rotate

HERE = __file__
R, C = 8, 16
N_FLOAT, N_INT, N_RED = 19, 11, 7


@pytest.fixture(autouse=True)
def _cache(private_kernel_cache):  # noqa: F811
    yield


@kl.jit
def zoo(out_f, out_i, out_red, out_mm, x, y, ints, n_loop, alpha, R: kl.constexpr,
        C: kl.constexpr):
    rows = kl.program_id(0) * R + kl.arange(0, R)
    cols = kl.arange(0, C)
    r2, c2 = rows[:, None], cols[None, :]
    mask = (r2 < x.shape[0]) & (c2 < x.shape[1])
    a = kl.load(x, (r2, c2), mask=mask, other=0.5).to(kl.float32)
    b = kl.load(y, (r2, c2), mask=mask, other=1.5).to(kl.float32)
    floats = [a + b * alpha, a - b, a * b, a / b, kl.exp(a), kl.log(kl.abs(b) + 1.0),
              kl.sqrt(kl.abs(a)), kl.rsqrt(kl.abs(b) + 0.5), kl.tanh(a), kl.sigmoid(b),
              kl.erf(a), kl.floor(a * 3.0), kl.maximum(a, b), kl.minimum(a, 0.0),
              kl.where(a > b, a, b * 2.0), -a,
              (a.to(kl.bfloat16) * b.to(kl.bfloat16) + 1.0).to(kl.float32),
              a.to(kl.int32).to(kl.float32), kl.maximum(a, b[:, :])]
    for k in kl.static_range(len(floats)):
        kl.store(out_f, (k, r2, c2), floats[k], mask=mask)
    i = kl.load(ints, (r2, c2), mask=mask, other=1)
    integers = [i // 3, i % 3, i // -4, i % -4, (i > 0) & (i < 10), (i < -5) | (i > 5),
                ~(i > 0), i * 7 - 2, i.to(kl.int32) * 2, kl.maximum(i, 3), (i > 0) ^ (i > 4)]
    for k in kl.static_range(len(integers)):
        kl.store(out_i, (k, r2, c2), integers[k], mask=mask)
    acc = kl.zeros((R, C), kl.float32)
    total = kl.full((), 0.0, kl.float32)
    count = kl.full((), 0, kl.int64)
    for k in kl.range(0, n_loop):
        acc = acc + a * k.to(kl.float32)
        total = total + kl.sum(kl.sum(b, axis=1), axis=0)
        count = count + 1
    odd = kl.zeros((R, C), kl.float32)
    for k in kl.range(1, n_loop, 2):
        odd = odd + b
    reductions = [kl.sum(a, axis=1, keepdims=True), kl.max(a, axis=0)[None, :],
                  kl.min(b, axis=1)[:, None], kl.sum(i, axis=1)[:, None].to(kl.float32),
                  acc + total + count.to(kl.float32), odd,
                  kl.sum(a, axis=0, keepdims=True) * kl.max(b, axis=1, keepdims=True)]
    for k in kl.static_range(len(reductions)):
        kl.store(out_red, (k, r2, c2), reductions[k], mask=mask)
    mm = kl.matmul(a, kl.transpose(b)) + kl.matmul(a.to(kl.bfloat16), b.T.to(kl.bfloat16))
    kl.store(out_mm, (r2, kl.arange(0, R)[None, :]), mm, mask=r2 < out_mm.shape[0])


def zoo_inputs(device, dtype):
    g = torch.Generator().manual_seed(0)
    rows, cols = 2 * R - 3, C - 2  # ragged in both dims
    x = torch.randn(cols, rows, generator=g).to(dtype).t()  # a strided (transposed) view
    y = (torch.rand(rows, cols, generator=g) * 4 - 2).to(dtype)
    ints = torch.randint(-20, 21, (rows, cols), generator=g)
    outs = [torch.zeros(N_FLOAT, rows, cols), torch.zeros(N_INT, rows, cols, dtype=torch.int64),
            torch.zeros(N_RED, rows, cols), torch.zeros(rows, R)]
    return [t.to(device) for t in outs], [t.to(device) for t in (x, y, ints)]


def run_zoo(device, dtype, n_loop):
    outs, ins = zoo_inputs(device, dtype)
    zoo[(2,)](*outs, *ins, n_loop, 0.75, R=R, C=C)
    return [t.cpu() for t in outs]


def assert_agree(compiled, simulated, dtype):
    f, i, red, mm = compiled
    sf, si, sred, smm = simulated
    assert torch.equal(i, si)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(f, sf, **tol)
    torch.testing.assert_close(red, sred, **tol)
    torch.testing.assert_close(mm, smm, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("n_loop,dtype", rotate([0, 3], [torch.float32, torch.bfloat16]))
def test_compiled_agrees_with_the_simulator(dtype, n_loop, monkeypatch):
    compiled = run_zoo("kiln", dtype, n_loop)
    monkeypatch.setenv("KILN_KL_SIMULATE", "1")
    simulated_on_kiln = run_zoo("kiln", dtype, n_loop)
    monkeypatch.delenv("KILN_KL_SIMULATE")
    simulated_on_cpu = run_zoo("cpu", dtype, n_loop)
    assert_agree(compiled, simulated_on_kiln, dtype)
    for a, b in zip(simulated_on_kiln, simulated_on_cpu):
        assert torch.equal(a, b)


def test_simulated_results_match_pytorch():
    """Spot checks of the simulator against PyTorch (float32)."""
    (f, i, red, mm), (x, y, ints) = zoo_inputs("cpu", torch.float32)
    zoo[(2,)](f, i, red, mm, x, y, ints, 3, 0.75, R=R, C=C)
    torch.testing.assert_close(f[0], x + y * 0.75)
    torch.testing.assert_close(f[4], torch.exp(x))
    torch.testing.assert_close(f[14], torch.where(x > y, x, y * 2))
    assert torch.equal(i[0], torch.div(ints, 3, rounding_mode="floor"))
    assert torch.equal(i[3], torch.remainder(ints, -4))
    # the masked-off columns hold other=0.5 (x) and 1.5 (y)
    torch.testing.assert_close(red[0], (x.sum(1, keepdim=True) + 2 * 0.5).expand_as(x))
    torch.testing.assert_close(red[5], y)  # kl.range(1, 3, 2): k = 1 only
    rows = x.shape[0]
    for p in range(2):  # each program's block of R rows (masked rows hold other=0.5/1.5)
        lo, hi = p * R, min(rows, (p + 1) * R)
        xa = torch.full((R, C), 0.5)
        ya = torch.full((R, C), 1.5)
        xa[:hi - lo, :x.shape[1]] = x[lo:hi]
        ya[:hi - lo, :x.shape[1]] = y[lo:hi]
        expected = xa @ ya.T + (xa.bfloat16().float() @ ya.bfloat16().float().T)
        # kl.range(0, 3): acc = a * (0 + 1 + 2), total = 3 * sum(b), count = 3
        torch.testing.assert_close(red[4, lo:hi], (xa * 3 + ya.sum() * 3 + 3)[:hi - lo,
                                                                             :x.shape[1]])
        torch.testing.assert_close(mm[lo:hi], expected[:hi - lo], rtol=1e-2, atol=1e-2)


SCALARS = (1.01, 0.3, -2.7182818, 1e-3, 257)  # 257: an int bf16 cannot hold
HALF_OPS = (  # (name, kl on a tile t and a number s, torch's eager equivalent)
    ("add", lambda t, s: t + s, None), ("sub", lambda t, s: t - s, None),
    ("rsub", lambda t, s: s - t, None), ("mul", lambda t, s: t * s, None),
    ("rmul", lambda t, s: s * t, None), ("div", lambda t, s: t / s, None),
    ("maximum", lambda t, s: kl.maximum(t, s), torch.clamp_min),
    ("eq", lambda t, s: t == s, None), ("lt", lambda t, s: t < s, None),
    ("ge", lambda t, s: s >= t, None),
)


@kl.jit
def with_numbers(out, x, BLOCK: kl.constexpr):
    """out[op, scalar, :] = HALF_OPS[op](x, SCALARS[scalar]), as float32."""
    offs = kl.program_id(0) * BLOCK + kl.arange(0, BLOCK)
    inside = offs < x.shape[0]
    t = kl.load(x, offs, mask=inside)
    for o in kl.static_range(len(HALF_OPS)):
        for k in kl.static_range(len(SCALARS)):
            r = HALF_OPS[o][1](t, SCALARS[k])
            kl.store(out, (o, k, offs), r.to(kl.float32), mask=inside)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_python_numbers_with_half_tiles_round_as_pytorch_simulated_and_compiled(
        dtype, monkeypatch):
    """Note [kl Python numbers with half tiles]: both modes give torch's bits."""
    x = (torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    x[:4] = torch.tensor([1.0, 0.3, 256.0, -2.71875])  # equal to some scalars once rounded
    results = {}
    for mode in ("compiled", "simulated"):
        if mode == "simulated":
            monkeypatch.setenv("KILN_KL_SIMULATE", "1")
        out = torch.empty(len(HALF_OPS), len(SCALARS), x.shape[0], device="kiln")
        with_numbers[(4,)](out, x.to("kiln"), BLOCK=256)
        results[mode] = out.cpu()
        monkeypatch.delenv("KILN_KL_SIMULATE", raising=False)
    for o, (name, fn, torch_fn) in enumerate(HALF_OPS):
        for k, s in enumerate(SCALARS):
            expected = (torch_fn or fn)(x, s).float()
            assert torch.equal(results["compiled"][o, k], results["simulated"][o, k]), (name, s)
            assert torch.equal(results["compiled"][o, k], expected), (name, s)


@kl.jit(simulate=True)
def printing(out, x):
    t = kl.load(x, kl.arange(0, 4))
    print("tile:", t * 2)
    kl.store(out, kl.arange(0, 4), t)


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1", "cpu"])
def test_print_shows_tile_values(device, capsys):
    x = torch.arange(4.0, device=device)
    out = torch.zeros(4, device=device)
    printing[(1,)](out, x)
    text = capsys.readouterr().out
    assert "tile: Tile(shape=(4,), dtype=float32, tensor([0., 2., 4., 6.]))" in text
    assert torch.equal(out.cpu(), torch.arange(4.0))


@kl.jit
def uninitialised(out, x):
    i = kl.arange(0, 4)
    never = kl.load(x, i, mask=i < 0)  # every element masked off, no other=
    kl.store(out, (0, i), never)
    kl.store(out, (1, i), kl.empty((4,), kl.float32) + 1.0)
    kl.store(out, (2, i), kl.load(x, i, mask=i < 2))


@pytest.mark.parametrize("simulate", [False, True])
def test_uninitialised_tiles_are_nan(simulate, monkeypatch):
    if simulate:
        monkeypatch.setenv("KILN_KL_SIMULATE", "1")
    out = torch.zeros(3, 4, device="kiln")
    uninitialised[(1,)](out, torch.ones(4, device="kiln"))
    out = out.cpu()
    assert torch.isnan(out[:2]).all()
    assert torch.equal(out[2, :2], torch.ones(2)) and torch.isnan(out[2, 2:]).all()


@kl.jit(simulate=True)
def unmasked_overrun(out, x, BLOCK: kl.constexpr):
    i = kl.program_id(0) * BLOCK + kl.arange(0, BLOCK)
    v = kl.load(x, i)  # LINE:overrun-load
    kl.store(out, i, v, mask=i < out.shape[0])


@kl.jit(simulate=True)
def unmasked_store_overrun(out, x, BLOCK: kl.constexpr):
    i = kl.arange(0, BLOCK)
    kl.store(out, (i, 0), kl.load(x, i, mask=i < x.shape[0], other=0.0))  # LINE:overrun-store


@pytest.mark.parametrize("device", ["kiln:0", "cpu"])
def test_out_of_bounds_without_mask_is_reported_with_the_line(device):
    x = torch.ones(10, device=device)
    out = torch.zeros(10, device=device)
    with pytest.raises(kl.KernelError, match=rf"kl kernel 'unmasked_overrun' at "
                       rf".*{where(HERE, 'LINE:overrun-load')}: kl.load from 'x' \(shape \(10,\)\)"
                       rf": index 10 is out of bounds for dimension 0 of size 10 \(tile element "
                       rf"\(2,\), program \(1, 0, 0\)\); mask the ragged edge"):
        unmasked_overrun[(2,)](out, x, BLOCK=8)
    with pytest.raises(kl.KernelError, match=rf"{where(HERE, 'LINE:overrun-store')}: kl.store to "
                       rf"'out' \(shape \(10, 1\)\): index 10 is out of bounds for dimension 0"):
        unmasked_store_overrun[(1,)](torch.zeros(10, 1, device=device), x, BLOCK=16)
    unmasked_overrun[(2,)](out, torch.ones(16, device=device), BLOCK=8)  # in bounds: fine
    assert torch.equal(out.cpu(), torch.ones(10))


@kl.jit
def divide(out, x, d):
    i = kl.arange(0, 4)
    kl.store(out, i, kl.load(x, i) // d)  # LINE:divide


def test_integer_division_by_zero(monkeypatch):
    x = torch.arange(4, device="kiln")
    out = torch.zeros(4, dtype=torch.int64, device="kiln")
    monkeypatch.setenv("KILN_KL_SIMULATE", "1")
    with pytest.raises(kl.KernelError, match=rf"{where(HERE, 'LINE:divide')}: integer "
                       "division by zero"):
        divide[(1,)](out, x, 0)
    monkeypatch.delenv("KILN_KL_SIMULATE")
    divide[(1,)](out, x, 0)
    with pytest.raises(RuntimeError, match=rf"kl::divide: .*kl kernel 'divide' at "
                       rf".*{where(HERE, 'LINE:divide')}: kl 'floordiv': integer division by "
                       "zero"):
        torch.kiln.synchronize()
    out = torch.zeros(4, dtype=torch.int64, device="kiln")  # the old one holds no result
    divide[(1,)](out, x, -3)  # the device keeps working
    assert torch.equal(out.cpu(), torch.div(torch.arange(4), -3, rounding_mode="floor"))
