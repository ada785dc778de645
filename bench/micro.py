"""Micro-benchmarks: per-op overhead of `add`, empty+free, host<->device
copies, a 1024^3 matmul and a conv layer forward+backward.

Each function returns bench.harness.Row objects; all CPU/kiln pairs are
measured interleaved (see harness.py). What each row measures is written in
its docstring and in bench/README.md.
"""

from __future__ import annotations

import ctypes

import torch

from harness import CPU, DEVICES, KILN, Row, Target, interleaved, row_from_samples, sync, timed

US = 1e6
MIB = 1 << 20

ADD_SIZES = [("1", 1), ("128", 128), ("64^3", 64 ** 3), ("2^22", 1 << 22)]


def _add_ops(n: int, quick: bool) -> int:
    """Ops per repetition: ~5-20 ms of work per repetition."""
    if n <= 128:
        return 1000 if quick else 3000
    if n <= 64 ** 3:
        return 200 if quick else 500
    return 5 if quick else 15


def add_overhead(quick: bool) -> list[Row]:
    """`c = a + b` on float32 vectors of 1, 128, 64^3 and 2^22 elements, a
    fresh output each time (as eager code does; kiln's comes from its caching
    allocator, CPU's from the CPU allocator).

    submit:     k ops issued back to back, one synchronize at the end;
                time / k. On kiln this is the rate at which the caller can
                issue ops (or, when kernels are longer than the issue cost,
                the rate the worker runs them). On CPU it is the op's time.
    round trip: a torch.kiln.synchronize() after every op; time / k. On CPU
                the op is synchronous, so this is again the op's time.
    """
    rows = []
    repetitions = 9 if quick else 15
    for label, n in ADD_SIZES:
        k = _add_ops(n, quick)
        tensors = {d: (torch.randn(n, device=d), torch.randn(n, device=d)) for d in DEVICES}
        tiny = n <= 128
        for mode in ("submit", "round trip"):
            reps = {}
            for device in DEVICES:
                a, b = tensors[device]
                if mode == "submit" or device == CPU:
                    def body(a=a, b=b, k=k):
                        for _ in range(k):
                            c = a + b  # noqa: F841
                else:
                    def body(a=a, b=b, k=k, synchronize=torch.kiln.synchronize):
                        for _ in range(k):
                            c = a + b  # noqa: F841
                            synchronize()
                reps[device] = timed(device, body, k)
            samples = interleaved(reps, repetitions, warmup=2)
            if tiny and mode == "submit":
                target = Target("ratio<=", 2.0)
            elif tiny:
                target = Target("kiln<=", 12.0)
            elif n == 1 << 22:
                target = Target("ratio<=", 1.05)
            else:
                target = None
            rows.append(row_from_samples(
                "per-op overhead", f"add {label} elem: {mode}", "us/op", samples,
                lambda s: s * US, target=target))
    return rows


def empty_free(quick: bool) -> list[Row]:
    """`torch.empty(1 MiB of float32)` and dropping it, per pair in us: CPU
    allocator (malloc/free) vs kiln's caching allocator."""
    k = 2000 if quick else 5000
    reps = {}
    for device in DEVICES:
        def body(device=device, k=k, empty=torch.empty):
            for _ in range(k):
                t = empty(MIB // 4, device=device)  # noqa: F841
                del t
        reps[device] = timed(device, body, k)
    samples = interleaved(reps, 5 if quick else 11, warmup=2)
    return [row_from_samples("memory", "empty 1 MiB + free", "us", samples, lambda s: s * US)]


def copies(quick: bool) -> list[Row]:
    """Host<->kiln copies of float32 tensors, 4 MiB and 256 MiB, in GB/s
    (1e9 bytes/s), `dst.copy_(src)` into a preallocated destination:

      H2D pageable: kiln_dst.copy_(host_src)
      H2D pinned:   kiln_dst.copy_(host_src.pin_memory(), non_blocking=True)
      D2H pageable: host_dst.copy_(kiln_src)            (blocking)
      D2H pinned:   pinned_dst.copy_(kiln_src, non_blocking=True)
    each followed by torch.kiln.synchronize() at the end of the repetition.
    The CPU column is the same copy_ between two host tensors of the same
    kind (the host memory bandwidth a copy can reach on this machine), so the
    ratio is the fraction of a host memcpy's bandwidth that kiln reaches.
    """
    rows = []
    sizes = [("4 MiB", 4 * MIB), ("256 MiB", 256 * MIB)]
    for label, nbytes in sizes:
        n = nbytes // 4
        big = nbytes > 64 * MIB
        k = (1 if quick else 2) if big else (20 if quick else 50)
        repetitions = (3 if quick else 5) if big else (5 if quick else 9)
        host_src = torch.randn(n)
        host_dst = torch.empty(n)
        pinned_src = host_src.pin_memory()
        pinned_dst = torch.empty(n).pin_memory()
        kiln_src = host_src.to(KILN)
        kiln_dst = torch.empty(n, device=KILN)
        sync(KILN)
        cases = [
            ("H2D pageable", host_dst, host_src, kiln_dst, host_src, False),
            ("H2D pinned", host_dst, pinned_src, kiln_dst, pinned_src, True),
            ("D2H pageable", host_dst, host_src, host_dst, kiln_src, False),
            ("D2H pinned", pinned_dst, pinned_src, pinned_dst, kiln_src, True),
        ]
        for name, cpu_dst, cpu_src, dst, src, non_blocking in cases:
            def cpu_body(d=cpu_dst, s=cpu_src, k=k):
                for _ in range(k):
                    d.copy_(s)

            def kiln_body(d=dst, s=src, k=k, nb=non_blocking):
                for _ in range(k):
                    d.copy_(s, non_blocking=nb)

            samples = interleaved({CPU: timed(CPU, cpu_body, k), KILN: timed(KILN, kiln_body, k)},
                                  repetitions, warmup=1)
            rows.append(row_from_samples(
                "copies", f"{name} {label}", "GB/s", samples, lambda s, b=nbytes: b / s / 1e9,
                higher_is_better=True))
        del host_src, host_dst, pinned_src, pinned_dst, kiln_src, kiln_dst
    torch.kiln.empty_cache()
    return rows


def matmul(quick: bool) -> list[Row]:
    """`c = a @ b` with a, b float32 1024x1024, k back to back then one
    synchronize; ms per matmul (ATen's CPU matmul, MKL here, on both)."""
    k = 2 if quick else 4
    reps = {}
    for device in DEVICES:
        torch.manual_seed(0)
        a = torch.randn(1024, 1024).to(device)
        b = torch.randn(1024, 1024).to(device)

        def body(a=a, b=b, k=k):
            for _ in range(k):
                c = a @ b  # noqa: F841
        reps[device] = timed(device, body, k)
    samples = interleaved(reps, 5 if quick else 11, warmup=1)
    return [row_from_samples("kernels", "matmul 1024^3", "ms", samples, lambda s: s * 1e3,
                             target=Target("ratio<=", 1.05))]


def conv(quick: bool) -> list[Row]:
    """Conv2d(16 -> 32 channels, 3x3, padding 1) on a (32, 16, 28, 28) float32
    input that requires grad: y = conv(x); y.backward(g) (input and weight
    gradients, accumulated), k back to back then one synchronize; ms per
    forward+backward."""
    k = 3 if quick else 6
    reps = {}
    for device in DEVICES:
        torch.manual_seed(0)
        layer = torch.nn.Conv2d(16, 32, 3, padding=1).to(device)
        x = torch.randn(32, 16, 28, 28).to(device).requires_grad_()
        g = torch.randn(32, 32, 28, 28).to(device)

        def body(layer=layer, x=x, g=g, k=k):
            for _ in range(k):
                layer(x).backward(g)
        reps[device] = timed(device, body, k)
    samples = interleaved(reps, 5 if quick else 11, warmup=2)
    return [row_from_samples("kernels", "conv 16->32 3x3 fwd+bwd, 32x16x28x28", "ms", samples,
                             lambda s: s * 1e3)]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _heap_in_use() -> int:
    """Bytes the process's malloc has handed out and not taken back (glibc's
    mallinfo2: uordblks + hblkhd). Unlike the resident set, it falls when
    memory is freed, so a delta measures what is held."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def pending_op_memory(quick: bool) -> list[Row]:
    """Host memory held per launched-but-not-started op, in KiB: the stream is
    stalled (torch.kiln._sleep), 1000 `c = a + b` on 128-element tensors are
    launched behind it (below the default KILN_LAUNCH_QUEUE_DEPTH of 1024, so
    none waits), and the growth of the heap in use (glibc mallinfo2) is
    divided by 1000: the task's argument images and launch record, the
    output tensors' host objects; the outputs' device blocks come from the
    caching allocator's cache, warmed first, so they are not counted. The
    host waits once a stream holds KILN_LAUNCH_QUEUE_DEPTH entries, so this
    times the depth bounds what a stalled stream holds. Kiln only.
    """
    n = 1000
    a, b = torch.randn(128, device=KILN), torch.randn(128, device=KILN)
    per_op = []
    for _ in range(3 if quick else 5):
        outputs = [a + b for _ in range(n)]  # warm the allocator and the ring
        del outputs
        torch.kiln.synchronize()
        torch.kiln._sleep(2000)
        outputs = []
        before = _heap_in_use()
        for _ in range(n):
            outputs.append(a + b)
        per_op.append((_heap_in_use() - before) / n / 1024)
        del outputs
        torch.kiln.synchronize()
    per_op.sort()
    median = per_op[len(per_op) // 2]
    return [Row("queue", "host memory per pending op (add, 128 elem)", "KiB", None, median,
                note=f"{len(per_op)} runs of {n} ops behind a stalled stream: "
                     f"{', '.join(f'{v:.2f}' for v in per_op)} KiB; with the default depth of "
                     f"1024 a stalled stream holds about {median:.1f} MiB")]
