"""Kiln graphs: the cost of a captured op under replay against eager launch.

Group `graphs`. N = 100 small ops (`c = a + b` on 128 float32 elements, a
fresh output each, as eager code does) are captured once into a
torch.kiln.KilnGraph; a repetition replays the graph k times. Rows (all in
us per op, CPU column: the same N ops eagerly on the CPU):

  eager:                 the N ops launched eagerly on kiln, end to end
                         (k rounds, one synchronize at the end) / (k * N).
  replay, end to end:    k replays, one synchronize at the end, / (k * N):
                         the worker still runs every captured kernel.
  replay, caller:        only the calling thread's time to issue the k
                         replays (synchronized before the timer starts and
                         after it stops, outside it) / (k * N): the Python
                         thread's per-op cost, issue 16's target (<= 0.3 us
                         per captured op, against ~2.4 us per eager launch).
"""

from __future__ import annotations

import time

import torch

from harness import CPU, DEVICES, KILN, Row, Target, interleaved, row_from_samples, sync, timed

US = 1e6
N_OPS = 100
ELEMENTS = 128


def _ops(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    c = a
    for _ in range(N_OPS):
        c = a + b
    return c


def replay_overhead(quick: bool) -> list[Row]:
    repetitions = 9 if quick else 15
    k = 10 if quick else 30  # replays (or eager rounds) per repetition
    tensors = {d: (torch.randn(ELEMENTS, device=d), torch.randn(ELEMENTS, device=d)) for d in DEVICES}

    # Capture on kiln, after a warm-up run (kiln checks an op's meta kernel
    # on its first call, which a capture refuses).
    a, b = tensors[KILN]
    _ops(a, b)
    torch.kiln.synchronize()
    graph = torch.kiln.KilnGraph()
    with torch.kiln.graph(graph):
        _ops(a, b)
    assert graph.num_nodes() == N_OPS, graph.num_nodes()

    def eager(device):
        x, y = tensors[device]

        def body():
            for _ in range(k):
                _ops(x, y)
        return timed(device, body, k * N_OPS)

    def replay_body():
        for _ in range(k):
            graph.replay()

    def replay_caller() -> float:
        sync(KILN)
        start = time.perf_counter()
        replay_body()
        elapsed = time.perf_counter() - start
        sync(KILN)
        return elapsed / (k * N_OPS)

    rows = []
    samples = interleaved({CPU: eager(CPU), KILN: eager(KILN)}, repetitions, warmup=2)
    rows.append(row_from_samples("graphs", f"{N_OPS} adds ({ELEMENTS} elem): eager", "us/op",
                                 samples, lambda s: s * US))
    samples = interleaved({CPU: eager(CPU), KILN: timed(KILN, replay_body, k * N_OPS)},
                          repetitions, warmup=2)
    rows.append(row_from_samples("graphs", f"{N_OPS} adds: graph replay, end to end", "us/op",
                                 samples, lambda s: s * US))
    samples = interleaved({CPU: eager(CPU), KILN: replay_caller}, repetitions, warmup=2)
    rows.append(row_from_samples("graphs", f"{N_OPS} adds: graph replay, caller", "us/op",
                                 samples, lambda s: s * US, target=Target("kiln<=", 0.3),
                                 note="the calling thread's time per captured op"))
    graph.reset()
    return rows
