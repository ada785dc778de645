"""Custom kiln kernels (issue 13), each next to the eager composite it
replaces, in one interleaved run (harness.py).

For each example kernel of examples/kernels/ (forward passes and one AdamW
step, float32):
  * fused kernel vs eager kiln composite: the CPU column holds the eager kiln
    composite's time (the same ops PyTorch runs for the module), the kiln
    column the fused kernel's; target: fused >= 1.5x faster (kiln/"CPU" time
    ratio <= 0.667).
  * fused kernel vs the CPU composite: the CPU column is PyTorch's CPU
    composite, the kiln column the fused kiln kernel; no target.
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
    return out
