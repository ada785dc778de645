"""Custom kiln kernels (issues 13 and 14), each next to the eager composite it
replaces, in one interleaved run (harness.py).

For each example kernel of examples/kernels/ (forward passes and one AdamW
step, float32):
  * fused kernel vs eager kiln composite: the CPU column holds the eager kiln
    composite's time (the same ops PyTorch runs for the module), the kiln
    column the fused kernel's; target: fused >= 1.5x faster (kiln/"CPU" time
    ratio <= 0.667).
  * fused kernel vs the CPU composite: the CPU column is PyTorch's CPU
    composite, the kiln column the fused kiln kernel; no target.

For the kernels written in the kl tile language (examples/kernels/kl_*.py,
issue 14), same layout: RMSNorm and softmax against the eager kiln composite
(target >= 2x faster, ratio <= 0.5) and against the part-1 C++ kernel of
the same algorithm (examples/kernels/rms_norm.py, softmax.py; softmax also
against torch.softmax; no target); causal attention at sequence 1024
against eager scaled_dot_product_attention on kiln (target >= 1.5x, ratio
<= 0.667) and against the part-1 C++ kernel
(examples/kernels/causal_attention.py; no target); the tiled matmul with
bias and GELU against the eager composite (no target). And
the time of a kl kernel's first call: cold (trace, lower, g++ build into an
empty cache) and cached (trace, lower, load from the disk cache), in the
kiln column.
"""

from __future__ import annotations

import os
import sys

import torch

from harness import CPU, KILN, Row, Target, interleaved, median, spread, sync, timed

PLANS = {"quick": (5, 3), "full": (20, 7)}  # calls per repetition, repetitions
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cases():
    sys.path.insert(0, REPO)
    from examples.kernels import adamw, bias_gelu, rms_norm

    g = torch.Generator().manual_seed(0)
    rows, cols = 4096, 1024
    x, vector = torch.randn(rows, cols, generator=g), torch.randn(cols, generator=g)
    n = rows * cols
    moments = (torch.rand(n, generator=g), torch.rand(n, generator=g))
    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.01, 10)

    def stock_adamw(param, grad, exp_avg, exp_avg_sq):
        # What torch.optim.AdamW(foreach=False) runs per parameter.
        adamw._cpu(param, grad, exp_avg, exp_avg_sq, *hyper)

    return [
        (f"AdamW step, {n:,} float32 parameters", (x.view(-1).clone(), x.view(-1) * 0.1,
                                                  *moments),
         lambda p, gr, m, v: adamw.adamw_step_(p, gr, m, v, *hyper), stock_adamw),
        (f"bias + GELU {rows}x{cols}", (x, vector),
         lambda x, b: bias_gelu.bias_gelu(x, b), bias_gelu.reference),
        (f"RMSNorm {rows}x{cols}", (x, vector),
         lambda x, w: rms_norm.rms_norm(x, w, 1e-6),
         lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6)),
    ]


def throughput(quick: bool) -> list[Row]:
    calls, repetitions = PLANS["quick" if quick else "full"]
    out: list[Row] = []
    for name, args, fused, composite in _cases():
        kiln_args = [a.to(KILN) for a in args]
        with torch.no_grad():
            reps = {
                "fused": timed(KILN, lambda: [fused(*kiln_args) for _ in range(calls)], calls),
                "kiln composite": timed(KILN, lambda: [composite(*kiln_args)
                                                       for _ in range(calls)], calls),
                "cpu composite": timed(CPU, lambda: [composite(*args) for _ in range(calls)],
                                       calls),
            }
            samples = interleaved(reps, repetitions, warmup=1)
        ms = {k: median(v) * 1e3 for k, v in samples.items()}
        note = f"{calls} calls x {repetitions} reps, float32, no_grad"
        out.append(Row("kernels", f"{name}: fused kernel vs eager kiln composite", "ms",
                       ms["kiln composite"], ms["fused"], target=Target("ratio<=", 0.667),
                       noise=max(spread(samples["fused"]), spread(samples["kiln composite"])),
                       note=note + "; CPU column = the eager composite on kiln"))
        out.append(Row("kernels", f"{name}: fused kiln kernel vs CPU composite", "ms",
                       ms["cpu composite"], ms["fused"],
                       noise=max(spread(samples["fused"]), spread(samples["cpu composite"])),
                       note=note))
        sync(KILN)
    out += _kl_throughput(calls, repetitions)
    out += _kl_compile_time()
    return out


def _kl_cases():
    """(name, inputs, kl kernel, baseline name, baseline, target ratio or
    None, [(other name, other), ...]) per kl example kernel."""
    sys.path.insert(0, REPO)
    from examples.kernels import (causal_attention, kl_attention, kl_matmul, kl_rms_norm,
                                  kl_softmax, rms_norm, softmax)

    g = torch.Generator().manual_seed(0)
    rows, cols = 4096, 1024
    x, w = torch.randn(rows, cols, generator=g), torch.randn(cols, generator=g)
    qkv = [torch.randn(1, 4, 1024, 64, generator=g) for _ in range(3)]
    m, k, n = 1024, 1024, 1024
    abc = [torch.randn(m, k, generator=g), torch.randn(k, n, generator=g) / k ** 0.5,
           torch.randn(n, generator=g)]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    gelu_tanh = kl_matmul.GELU_TANH
    return [
        (f"kl RMSNorm {rows}x{cols}", (x, w), lambda x, w: kl_rms_norm.rms_norm(x, w, 1e-6),
         "eager kiln composite",
         lambda x, w: torch.nn.functional.rms_norm(x, (cols,), w, 1e-6), 0.5,
         [("part-1 C++ kernel", lambda x, w: rms_norm.rms_norm(x, w, 1e-6))]),
        (f"kl softmax {rows}x{cols}", (x,), kl_softmax.softmax, "eager kiln composite",
         kl_softmax.composite, 0.5,
         [("torch.softmax", lambda x: torch.softmax(x, -1)),
          ("part-1 C++ kernel", softmax.softmax)]),
        # 128 x 128 blocks: the fastest of 64x64, 128x64, 64x128 and 128x128 at
        # this size, forward and forward + backward (docs/kernels.md, Measured)
        ("kl causal attention (1, 4, 1024, 64), 128x128 blocks", qkv,
         lambda q, k, v: kl_attention.causal_attention(q, k, v, block=(128, 128)),
         "eager kiln SDPA", lambda q, k, v: sdpa(q, k, v, is_causal=True), 0.667,
         [("part-1 C++ kernel", lambda q, k, v: causal_attention.causal_attention(
             q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), 128, 128))]),
        # no target in issue 14; no part-1 GEMM example (kiln's C++ kernels
        # leave GEMM to ATen: the composite's mm is that C++ version)
        (f"kl matmul + bias + GELU {m}x{k}x{n}", abc,
         lambda a, b, c: kl_matmul.matmul_bias_act(a, b, c, gelu_tanh),
         "eager kiln composite",
         lambda a, b, c: torch.nn.functional.gelu(a @ b + c, approximate="tanh"), None, []),
    ]


def _kl_throughput(calls: int, repetitions: int) -> list[Row]:
    out: list[Row] = []
    for name, args, kernel, base_name, base, limit, others in _kl_cases():
        kiln_args = [a.to(KILN) for a in args]
        with torch.no_grad():
            reps = {
                "kl": timed(KILN, lambda: [kernel(*kiln_args) for _ in range(calls)], calls),
                "base": timed(KILN, lambda: [base(*kiln_args) for _ in range(calls)], calls),
            }
            for other_name, other in others:
                reps[other_name] = timed(
                    KILN, lambda other=other: [other(*kiln_args) for _ in range(calls)], calls)
            samples = interleaved(reps, repetitions, warmup=1)
        ms = {k: median(v) * 1e3 for k, v in samples.items()}
        note = f"{calls} calls x {repetitions} reps, float32, no_grad; CPU column = the {base_name}"
        out.append(Row("kernels", f"{name}: kl kernel vs {base_name}", "ms", ms["base"],
                       ms["kl"], target=Target("ratio<=", limit) if limit is not None else None,
                       noise=max(spread(samples["kl"]), spread(samples["base"])), note=note))
        for other_name, _ in others:
            out.append(Row("kernels", f"{name}: kl kernel vs {other_name}", "ms",
                           ms[other_name], ms["kl"],
                           noise=max(spread(samples["kl"]), spread(samples[other_name])),
                           note=f"{calls} calls x {repetitions} reps; CPU column = the "
                                f"{other_name} on kiln"))
        sync(KILN)
    return out


def _kl_compile_time() -> list[Row]:
    """First-call time of a fresh kl kernel object: cold (empty disk cache)
    and cached (the library on disk)."""
    import tempfile
    import time

    import torch_kiln.kl as kl
    from examples.kernels import kl_softmax

    x = torch.randn(64, 1024, device=KILN)
    out = torch.empty_like(x)
    old = os.environ.get("KILN_KERNELS_CACHE_DIR")
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        os.environ["KILN_KERNELS_CACHE_DIR"] = cache
        try:
            times = {}
            for kind in ("cold", "cached"):
                kernel = kl.jit(kl_softmax.softmax_kernel.fn)  # a new object: nothing in memory
                start = time.perf_counter()
                kernel[(16,)](out, x, 64, 1024, ROWS=4, BLOCK=1024)
                sync(KILN)
                times[kind] = (time.perf_counter() - start) * 1e3
        finally:
            if old is None:
                os.environ.pop("KILN_KERNELS_CACHE_DIR", None)
            else:
                os.environ["KILN_KERNELS_CACHE_DIR"] = old
    for kind, note in (("cold", "trace + lower + g++ build into an empty cache"),
                       ("cached", "trace + lower + load from the disk cache")):
        rows.append(Row("kernels", f"kl softmax first call, {kind}", "ms", None, times[kind],
                        note=note + "; one sample"))
    return rows
