"""Adaptive eager fusion (first increment): an elementwise chain, fused vs
unfused, in one run.

Group `fusion`. The chain is 8 float32 elementwise ops, each with a fresh
output, as eager code writes them: c = a + b; d = c * 2; e = relu(d);
f = gelu(e); g = sigmoid(f) - c; h = -g / b (add, mul, relu, gelu, sigmoid,
sub, neg, div: all on the fusion whitelist, Note [Adaptive eager fusion]).
Rows (us per chain, end to end: k chains, one synchronize at the end; CPU
column: the same chain eagerly on the CPU), at 4096 and 2^20 elements:

  unfused:  kiln with adaptive eager off (KILN_ADAPTIVE_EAGER=0)
  fused:    kiln with it on; the chains queue behind one another, so how
            many ops a group gets depends on how far Python runs ahead.

The increment runs a group's ops tile by tile with ATen's own kernels and
writes every intermediate, so the expected gain is the per-task cost of the
worker and cache reuse between ops, not fewer memory writes.
"""

from __future__ import annotations

import torch
import torch_kiln

from harness import CPU, DEVICES, KILN, Row, interleaved, row_from_samples, timed

US = 1e6


def _chain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    c = a + b
    d = c * 2
    e = d.relu()
    f = torch.nn.functional.gelu(e)
    g = f.sigmoid() - c
    return -g / b


def chain_fused_vs_unfused(quick: bool) -> list[Row]:
    repetitions = 7 if quick else 15
    rows = []
    previous = torch_kiln._C._adaptive_eager_enabled()
    try:
        for elements, k in ((4096, 50), (1 << 20, 5)):
            tensors = {d: (torch.randn(elements, device=d), torch.randn(elements, device=d))
                       for d in DEVICES}

            def run(device, fused):
                x, y = tensors[device]

                def body():
                    torch_kiln._C._set_adaptive_eager(fused)
                    for _ in range(k):
                        _chain(x, y)
                return timed(device, body, k)

            for label, fused in (("unfused", False), ("fused", True)):
                samples = interleaved({CPU: run(CPU, False), KILN: run(KILN, fused)},
                                      repetitions, warmup=2)
                rows.append(row_from_samples(
                    "fusion", f"8-op elementwise chain ({elements} elem): {label}", "us/chain",
                    samples, lambda s: s * US,
                    note="adaptive eager " + ("on" if fused else "off")))
    finally:
        torch_kiln._C._set_adaptive_eager(previous)
    return rows
