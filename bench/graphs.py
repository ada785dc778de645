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

And torch.compile(mode="reduce-overhead") against the default mode (issue
16), on a small MLP's training step (forward, backward, SGD; 4 Linear
layers of width 64, batch 16, float32), ms per step:

  compiled step, default:          torch.compile(model) on each device.
  compiled step, reduce-overhead:  mode="reduce-overhead"; kiln replays kiln
                                   graphs (a step = 2 replays, the forward's
                                   and the backward's); on the CPU Inductor
                                   skips CUDA graphs, so the CPU column runs
                                   the default mode's code again. The note
                                   gives kiln reduce-overhead / kiln default.
"""

from __future__ import annotations

import time

import torch

import copy

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
    return rows + compiled_step(quick)


def _mlp() -> torch.nn.Module:
    layers = []
    for _ in range(3):
        layers += [torch.nn.Linear(64, 64), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(64, 10))


def compiled_step(quick: bool) -> list[Row]:
    repetitions = 7 if quick else 15
    k = 10 if quick else 30  # steps per repetition
    torch.manual_seed(0)
    base = _mlp()

    def stepper(device: str, mode):
        model = copy.deepcopy(base).to(device)
        compiled = torch.compile(model, mode=mode)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(16, 64, device=device)
        y = torch.randint(0, 10, (16,), device=device)

        def body():
            for _ in range(k):
                loss = torch.nn.functional.cross_entropy(compiled(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()

        for _ in range(3):  # compile, warm up, capture
            body()
        return timed(device, body, k)

    rows = []
    medians = {}
    for mode, label in ((None, "default"), ("reduce-overhead", "reduce-overhead")):
        samples = interleaved({CPU: stepper(CPU, mode), KILN: stepper(KILN, mode)},
                              repetitions, warmup=1)
        medians[label] = sorted(samples[KILN])[len(samples[KILN]) // 2]
        note = ""
        if label == "reduce-overhead":
            note = (f"kiln reduce-overhead / kiln default = "
                    f"{medians['reduce-overhead'] / medians['default']:.2f}x time")
        rows.append(row_from_samples("graphs", f"MLP train step, compiled {label}", "ms/step",
                                     samples, lambda s: s * 1e3, note=note))
    torch._dynamo.reset()
    return rows
