"""Adaptive eager fusion (first increment): an elementwise chain, fused vs
unfused, in one run.

Group `fusion`. The chain is 8 float32 elementwise ops, each with a fresh
output, as eager code writes them: c = a + b; d = c * 2; e = relu(d);
f = gelu(e); g = sigmoid(f) - c; h = -g / b (add, mul, relu, gelu, sigmoid,
sub, neg, div: all on the fusion whitelist, Note [Adaptive eager fusion]).
Rows (us per chain, end to end: k chains, one synchronize at the end; CPU
column: the same chain eagerly on the CPU), at 4096 and 2^20 elements:

  unfused:              kiln with adaptive eager off (KILN_ADAPTIVE_EAGER=0)
  fused, ATen per tile: on, each op of a group run as its ATen kernel tile
                        by tile (torch_kiln._C._set_fused_kernels("aten"))
  fused, interpreter:   on, runs of ops through the one generated
                        interpreter ("interpreted")
  fused, own kernels:   on, each run of ops its own generated kernel
                        ("specialized"). The default ("adaptive") runs the
                        interpreter until a run of ops is hot, then its own
                        kernel (Note [Generated kernels for fusion groups]).
                        Kernels are built before timing, so no row waits
                        for a compiler.
The chains queue behind one another, so how many ops a group gets depends
on how far Python runs ahead.

ATen per tile saves the per-task cost of the worker and gains cache reuse
between ops, but writes every intermediate. A generated kernel keeps a run
of ops (add, mul, relu; sigmoid, sub, neg, div: gelu splits the chain) in
registers and writes each output once from there.
"""

from __future__ import annotations

import torch
import torch_kiln
from torch_kiln.kiln import _fused_kernels

from harness import CPU, DEVICES, KILN, Row, interleaved, row_from_samples, timed

US = 1e6


def _chain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    c = a + b
    d = c * 2
    e = d.relu()
    f = torch.nn.functional.gelu(e)
    g = f.sigmoid() - c
    return -g / b


def _build_kernels(body) -> None:
    """Runs body until it asks for no new generated kernel (each run may
    form groups of other lengths), waiting for the builds."""
    for _ in range(10):
        built = _fused_kernels.stats()["built"]
        body()
        torch.kiln.synchronize()
        if not _fused_kernels.wait(600):
            raise RuntimeError(f"fused kernel builds still running: {_fused_kernels.stats()}")
        if _fused_kernels.stats()["built"] == built:
            return


MODES = (("unfused", False, "aten"), ("fused, ATen per tile", True, "aten"),
         ("fused, interpreter", True, "interpreted"), ("fused, own kernels", True, "specialized"))


def chain_fused_vs_unfused(quick: bool) -> list[Row]:
    repetitions = 7 if quick else 15
    rows = []
    previous = (torch_kiln._C._adaptive_eager_enabled(), torch_kiln._C._fused_kernels_mode())
    try:
        for elements, k in ((4096, 50), (1 << 20, 5)):
            tensors = {d: (torch.randn(elements, device=d), torch.randn(elements, device=d))
                       for d in DEVICES}

            def run(device, fused, kernels):
                x, y = tensors[device]

                def body():
                    torch_kiln._C._set_adaptive_eager(fused)
                    torch_kiln._C._set_fused_kernels(kernels)
                    for _ in range(k):
                        _chain(x, y)
                if device == KILN and fused and kernels != "aten":
                    _build_kernels(body)
                return timed(device, body, k)

            for label, fused, kernels in MODES:
                samples = interleaved({CPU: run(CPU, False, "aten"),
                                       KILN: run(KILN, fused, kernels)},
                                      repetitions, warmup=2)
                rows.append(row_from_samples(
                    "fusion", f"8-op elementwise chain ({elements} elem): {label}", "us/chain",
                    samples, lambda s: s * US,
                    note="adaptive eager " + ("on" if fused else "off")))
    finally:
        torch_kiln._C._set_adaptive_eager(previous[0])
        torch_kiln._C._set_fused_kernels(previous[1])
    return rows
