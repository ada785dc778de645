"""One rank of the kccl tests (tests/test_distributed_kccl.py).

Started as a subprocess by the test module's rank pool; reads one JSON
command per line on stdin ({"scenario": name, "args": {...}}), runs the
scenario with the process group it initialised at start and answers one
line "KCCL-RESULT {json}" on stdout. Every scenario computes the expected
result on the CPU in this process (each rank can rebuild every rank's input
from the seed) and compares, bit for bit where the math is the same.
Not a test module itself (pytest collects test_*.py only).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch_kiln.distributed

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
DEVICE = torch.device("kiln", int(os.environ["LOCAL_RANK"]))

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INT_DTYPES = [torch.int32, torch.int64, torch.int8, torch.uint8]
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES + [torch.bool]
R = dist.ReduceOp


def make_input(rank: int, shape, dtype, seed: int = 0) -> torch.Tensor:
    """Rank `rank`'s CPU input, reproducible on every rank."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 2).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g).to(dtype)
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


def ops_for(dtype):
    if dtype == torch.bool:
        return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]
    if dtype.is_floating_point:
        return [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX, "premul"]
    return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]


def premul_factor(rank):
    """Each rank's PREMUL_SUM factor: different on every rank, as NCCL allows."""
    return 0.5 + rank


def kccl_op(op):
    return dist._make_nccl_premul_sum(premul_factor(RANK)) if op == "premul" else op


def reference(parts, op):
    """The reduction kccl defines (Reductions.h), with torch on the CPU."""
    is_bool = parts[0].dtype == torch.bool
    if op == "premul":  # each rank's input times its own factor, summed in rank order
        acc = parts[0] * premul_factor(0)
        for r, p in enumerate(parts[1:], start=1):
            acc = acc + p * premul_factor(r)
        return acc
    acc = parts[0].clone()
    for p in parts[1:]:
        if op in (R.SUM, R.AVG):
            acc = torch.logical_or(acc, p) if is_bool else acc + p
        elif op == R.PRODUCT:
            acc = torch.logical_and(acc, p) if is_bool else acc * p
        elif op == R.MIN:
            acc = torch.logical_and(acc, p) if is_bool else torch.minimum(acc, p)
        elif op == R.MAX:
            acc = torch.logical_or(acc, p) if is_bool else torch.maximum(acc, p)
        elif op == R.BAND:
            acc = acc & p
        elif op == R.BOR:
            acc = acc | p
        elif op == R.BXOR:
            acc = acc ^ p
    if op == R.AVG:
        acc = acc / len(parts)
    return acc


def check_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not torch.equal(got, want):
        diff = (got.double() - want.double()).abs().max().item()
        raise AssertionError(f"{what}: kccl differs from CPU (max abs diff {diff})")


# ---------------------------------------------------------------- scenarios


def s_backend_info(args):
    return {
        "backend": dist.get_backend(),
        "default_for_kiln": dist.get_default_backend_for_device("kiln"),
        "world": dist.get_world_size(),
        "rank": dist.get_rank(),
        "device": str(DEVICE),
        "kccl_type": type(dist.group.WORLD._get_backend(DEVICE)).__name__,
        "hosts": torch_kiln.distributed.host_layout(),
    }


def s_all_reduce_ops(args):
    shape = tuple(args.get("shape", (5, 7)))
    checked = 0
    for dtype in [getattr(torch, d) for d in args.get("dtypes", [str(d)[6:] for d in ALL_DTYPES])]:
        for op in ops_for(dtype):
            parts = [make_input(r, shape, dtype, seed=checked) for r in range(WORLD)]
            t = parts[RANK].to(DEVICE)
            dist.all_reduce(t, op=kccl_op(op))
            check_equal(t, reference(parts, op), f"all_reduce {op} {dtype}")
            checked += 1
    return checked


def s_collectives(args):
    checked = 0
    for dtype in [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]:
        shape = (3, 4)
        parts = [make_input(r, shape, dtype, seed=checked) for r in range(WORLD)]
        # broadcast from every root
        for root in range(WORLD):
            t = parts[RANK].to(DEVICE)
            dist.broadcast(t, src=root)
            check_equal(t, parts[root], f"broadcast root {root} {dtype}")
        # reduce to every root (the others keep their input)
        op = R.SUM if dtype != torch.bool else R.MAX
        for root in range(WORLD):
            t = parts[RANK].to(DEVICE)
            dist.reduce(t, dst=root, op=op)
            check_equal(t, reference(parts, op) if RANK == root else parts[RANK], f"reduce root {root} {dtype}")
            if dtype.is_floating_point:  # the others keep their unscaled input
                t = parts[RANK].to(DEVICE)
                dist.reduce(t, dst=root, op=kccl_op("premul"))
                check_equal(t, reference(parts, "premul") if RANK == root else parts[RANK],
                            f"reduce PREMUL_SUM root {root} {dtype}")
        # all_gather (list) and all_gather_into_tensor
        outs = [torch.empty(shape, dtype=dtype, device=DEVICE) for _ in range(WORLD)]
        dist.all_gather(outs, parts[RANK].to(DEVICE))
        for r in range(WORLD):
            check_equal(outs[r], parts[r], f"all_gather from {r} {dtype}")
        out = torch.empty((WORLD * 3, 4), dtype=dtype, device=DEVICE)
        dist.all_gather_into_tensor(out, parts[RANK].to(DEVICE))
        check_equal(out, torch.cat(parts), f"all_gather_into_tensor {dtype}")
        # reduce_scatter_tensor and reduce_scatter (list)
        big = [make_input(r, (WORLD * 3, 4), dtype, seed=100 + checked) for r in range(WORLD)]
        rs_ops = [op] + ([R.AVG, R.MIN, "premul"] if dtype.is_floating_point
                         else [R.BXOR] if dtype != torch.bool else [])
        for rop in rs_ops:
            out = torch.empty(shape, dtype=dtype, device=DEVICE)
            dist.reduce_scatter_tensor(out, big[RANK].to(DEVICE), op=kccl_op(rop))
            want = reference([b[RANK * 3:(RANK + 1) * 3] for b in big], rop)
            check_equal(out, want, f"reduce_scatter_tensor {rop} {dtype}")
            out = torch.empty(shape, dtype=dtype, device=DEVICE)
            dist.reduce_scatter(out, list(big[RANK].to(DEVICE).chunk(WORLD)), op=kccl_op(rop))
            check_equal(out, want, f"reduce_scatter {rop} {dtype}")
        checked += 1
    dist.barrier()
    return checked


def s_chunked(args):
    # The workers run with a small KCCL_SHM_SLOT_BYTES, so these need many steps.
    n = args["numel"]
    for dtype in [torch.float32, torch.bfloat16, torch.int64]:
        parts = [make_input(r, (n,), dtype, seed=7) for r in range(WORLD)]
        t = parts[RANK].to(DEVICE)
        dist.all_reduce(t)
        check_equal(t, reference(parts, R.SUM), f"chunked all_reduce {dtype}")
        out = torch.empty(WORLD * n, dtype=dtype, device=DEVICE)
        dist.all_gather_into_tensor(out, parts[RANK].to(DEVICE))
        check_equal(out, torch.cat(parts), f"chunked all_gather_into_tensor {dtype}")
        big = [make_input(r, (WORLD * n,), dtype, seed=8) for r in range(WORLD)]
        out = torch.empty(n, dtype=dtype, device=DEVICE)
        dist.reduce_scatter_tensor(out, big[RANK].to(DEVICE))
        check_equal(out, reference([b[RANK * n:(RANK + 1) * n] for b in big], R.SUM),
                    f"chunked reduce_scatter_tensor {dtype}")
        t = parts[RANK].to(DEVICE)
        dist.broadcast(t, src=WORLD - 1)
        check_equal(t, parts[WORLD - 1], f"chunked broadcast {dtype}")
    return True


def s_noncontiguous(args):
    parts = [make_input(r, (6, 4), torch.float32, seed=3) for r in range(WORLD)]
    base = torch.zeros(4, 6, device=DEVICE)
    t = base.t()  # a transposed view of `base`
    t.copy_(parts[RANK].to(DEVICE))
    assert not t.is_contiguous()
    dist.all_reduce(t)
    check_equal(t, reference(parts, R.SUM), "all_reduce of a transposed view")
    check_equal(base, reference(parts, R.SUM).t(), "all_reduce writes through the view")
    # a strided slice, broadcast into it; the gaps stay untouched
    buf = torch.full((8,), -1.0, device=DEVICE)
    view = buf[::2]
    view.copy_(parts[RANK].flatten()[:4].to(DEVICE))
    dist.broadcast(view, src=0)
    want = torch.full((8,), -1.0)
    want[::2] = parts[0].flatten()[:4]
    check_equal(buf, want, "broadcast into a strided view")
    outs = [torch.empty(4, 6, device=DEVICE) for _ in range(WORLD)]
    dist.all_gather(outs, parts[RANK].to(DEVICE).t())
    for r in range(WORLD):
        check_equal(outs[r], parts[r].t().contiguous(), "all_gather of a transposed input")
    # empty tensors
    e = torch.empty(0, device=DEVICE)
    dist.all_reduce(e)
    assert e.numel() == 0
    return True


def s_async(args):
    from torch_kiln import _C

    results = {}
    for which in ("default", "side"):
        stream = torch.kiln.Stream() if which == "side" else torch.kiln.default_stream(DEVICE)
        with torch.kiln.stream(stream):
            t = torch.zeros(1000, device=DEVICE)
            _C._sleep(200.0)  # device work the collective must wait for
            t.fill_(RANK + 1.0)
            start = time.perf_counter()
            work = dist.all_reduce(t, async_op=True)
            issue_ms = (time.perf_counter() - start) * 1000
            fut = work.get_future()
            work.wait()  # the current stream waits; the host does not
            wait_ms = (time.perf_counter() - start) * 1000
            y = t * 2  # ordered after the collective on the current stream
            check_equal(y, torch.full((1000,), 2.0 * sum(range(1, WORLD + 1))), f"async on {which} stream")
            value = fut.wait()
            assert work.is_completed()
            assert isinstance(value, list) and value[0] is t or torch.equal(value[0].cpu(), t.cpu())
        results[which] = {"issue_ms": issue_ms, "wait_ms": wait_ms}
        assert issue_ms < 150, f"all_reduce(async_op=True) blocked the host for {issue_ms:.0f} ms"
        assert wait_ms < 150, f"Work.wait() blocked the host for {wait_ms:.0f} ms"
    # The caching allocator keeps a freed input for the collective.
    torch.kiln.synchronize()
    _C._sleep(200.0)
    t = torch.full((4096,), float(RANK + 1), device=DEVICE)
    work = dist.all_reduce(t, async_op=True)
    ptr = t.data_ptr()
    del t
    u = torch.zeros(4096, device=DEVICE)  # must not reuse the collective's memory
    assert u.data_ptr() != ptr, "the caching allocator reused memory a collective still uses"
    work.wait()
    torch.kiln.synchronize()
    dist.barrier()
    return results


def s_other_device(args):
    dev = torch.device("kiln", args["device"])
    parts = [make_input(r, (16,), torch.float32, seed=11) for r in range(WORLD)]
    t = parts[RANK].to(dev)
    dist.all_reduce(t)
    check_equal(t, reference(parts, R.SUM), f"all_reduce on {dev}")
    out = torch.empty(WORLD * 16, device=dev)
    dist.all_gather_into_tensor(out, parts[RANK].to(dev))
    check_equal(out, torch.cat(parts), f"all_gather_into_tensor on {dev}")
    return str(dev)


def expect_error(kind, fragments, fn):
    try:
        fn()
    except kind as e:
        text = str(e)
        for f in fragments:
            assert f in text, f"error message lacks {f!r}: {text}"
        return text
    raise AssertionError(f"expected {kind.__name__} containing {fragments}")


def s_errors(args):
    messages = {}
    f = torch.ones(4, device=DEVICE)
    i = torch.ones(4, dtype=torch.int64, device=DEVICE)
    messages["band_float"] = expect_error(ValueError, ["BAND", "integer or bool", "Float"],
                                          lambda: dist.all_reduce(f, op=R.BAND))
    messages["avg_int"] = expect_error(ValueError, ["AVG", "floating-point", "Long"],
                                       lambda: dist.all_reduce(i, op=R.AVG))
    messages["cpu_tensor"] = expect_error(RuntimeError, ["cpu"], lambda: dist.all_reduce(torch.ones(4)))
    # Reductions ATen's CPU kernels cannot do are refused before anything is
    # issued (they failed inside the task on one rank and broke the group).
    for dtype, op in ((torch.float8_e4m3fn, R.SUM), (torch.uint32, R.SUM), (torch.uint16, R.MIN)):
        messages[f"{op} {dtype}"] = expect_error(
            ValueError, [str(op).split(".")[-1], "is not supported", "ATen's CPU kernels"],
            lambda: dist.all_reduce(torch.zeros(4, device=DEVICE).to(dtype), op=op))
    # An output with elements that share memory (stride 0) is refused, as by NCCL.
    expanded = torch.ones(1, device=DEVICE).expand(4)
    messages["expanded"] = expect_error(ValueError, ["all_reduce", "strides [0]", "share memory"],
                                        lambda: dist.all_reduce(expanded))
    messages["expanded_broadcast"] = expect_error(ValueError, ["broadcast", "share memory"],
                                                  lambda: dist.broadcast(expanded, src=0))
    # (all_reduce refuses complex MIN/MAX in PyTorch's Python; reduce does not.)
    messages["complex_max_reduce"] = expect_error(
        ValueError, ["reduce: ReduceOp.MAX of ComplexFloat"],
        lambda: dist.reduce(torch.zeros(4, dtype=torch.complex64, device=DEVICE), dst=0, op=R.MAX))
    other = torch.device("kiln", 1 - DEVICE.index) if torch.kiln.device_count() > 1 else DEVICE
    if other != DEVICE:
        messages["mixed_devices"] = expect_error(
            ValueError, ["one kiln device"],
            lambda: dist.all_gather([torch.empty(4, device=DEVICE), torch.empty(4, device=other)][:WORLD]
                                    + [torch.empty(4, device=DEVICE)] * (WORLD - 2),
                                    torch.ones(4, device=DEVICE)))
    messages["list_length"] = expect_error(
        ValueError, ["output list has", str(WORLD)],
        lambda: dist.all_gather([torch.empty(4, device=DEVICE)] * (WORLD + 1), f))
    messages["gather_size"] = expect_error(
        ValueError, ["world_size"],
        lambda: dist.all_gather_into_tensor(torch.empty(3, device=DEVICE), f))
    messages["dtype"] = expect_error(
        ValueError, ["same dtype"],
        lambda: dist.all_gather_into_tensor(torch.empty(4 * WORLD, dtype=torch.int64, device=DEVICE), f))
    # The group still works after refused calls (nothing was issued).
    t = torch.ones(4, device=DEVICE)
    dist.all_reduce(t)
    check_equal(t, torch.full((4,), float(WORLD)), "all_reduce after refused calls")
    return messages


def s_timeout(args):
    """Rank `rank` (default 0) runs an all_reduce the others never join."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=args["seconds"]))
    out = {}
    if RANK == args.get("rank", 0):
        t = torch.ones(8, device=DEVICE)
        start = time.perf_counter()
        work = dist.all_reduce(t, group=group, async_op=True)
        work.wait()  # the host does not block: the failure shows later
        fragments = args.get("fragments") or [
            "all_reduce", "sequence number 1", "Float[8]", "ranks [1] did not arrive", "timed out"]
        # The first read raises the communication stream's pending error
        # (and so clears it, as synchronize would); a second read says the
        # values were never computed; synchronize has nothing left to raise.
        out["read"] = expect_error(RuntimeError, fragments, lambda: t.cpu())
        out["seconds"] = time.perf_counter() - start
        assert "never computed" not in out["read"], out["read"]
        out["read again"] = expect_error(RuntimeError, ["never computed", *fragments], lambda: t.cpu())
        torch.kiln.synchronize()
        out["work"] = expect_error(dist.DistBackendError, fragments, lambda: work.wait())
        out["future"] = expect_error(Exception, ["all_reduce"], lambda: work.get_future().wait())
        out["later"] = expect_error(dist.DistBackendError, ["unusable"], lambda: dist.all_reduce(t, group=group))
    dist.destroy_process_group(group)
    dist.barrier()
    return out


def s_late_rank(args):
    """Rank 1 joins an all_reduce after rank 0 timed out on it: rank 1 must
    fail too (Note [kccl broken groups]), not complete it with rank 0's
    published data and carry on while rank 0 has given up."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=args["seconds"]))
    t = torch.full((8,), float(RANK + 1), device=DEVICE)
    if RANK == 0:
        fragments = ["timed out", "ranks [1] did not arrive"]
    else:
        time.sleep(args["seconds"] + 2.0)  # well after rank 0's deadline
        fragments = ["all_reduce", "rank 0 gave up on this process group", "unusable"]

    def run_and_read():
        # Work.wait() in all_reduce raises a failure it already sees; else
        # reading the output raises it.
        dist.all_reduce(t, group=group)
        t.cpu()

    message = expect_error(RuntimeError, fragments, run_and_read)
    try:
        torch.kiln.synchronize()  # the stream's error, if all_reduce raised it first
    except RuntimeError as e:
        assert any(f in str(e) for f in fragments), str(e)
    dist.destroy_process_group(group)
    dist.barrier()
    return message


def s_mismatch(args):
    group = dist.new_group(timeout=datetime.timedelta(seconds=args["seconds"]))
    t = torch.ones(4 + 4 * RANK, device=DEVICE)
    text = expect_failed(["mismatched collectives"],
                         lambda: (dist.all_reduce(t, group=group), t.cpu()))
    dist.destroy_process_group(group)
    dist.barrier()
    return text


def s_groups(args):
    """Process groups made with other backend strings, and sub-groups."""
    out = {}
    for backend in ("kccl", "cpu:gloo,kiln:kccl"):
        g = dist.new_group(backend=backend)
        t = torch.full((3,), float(RANK + 1), device=DEVICE)
        dist.all_reduce(t, group=g)
        check_equal(t, torch.full((3,), float(sum(range(1, WORLD + 1)))), f"all_reduce in a {backend} group")
        if backend.startswith("cpu:"):
            c = torch.full((3,), float(RANK + 1))
            dist.all_reduce(c, group=g)  # CPU tensors go to gloo
            check_equal(c, torch.full((3,), float(sum(range(1, WORLD + 1)))), "gloo all_reduce")
        out[backend] = dist.get_backend(g)
        dist.destroy_process_group(g)
    if WORLD > 2:
        sub = dist.new_group(ranks=[0, 1])
        if RANK in (0, 1):
            t = torch.full((2,), float(RANK + 1), device=DEVICE)
            dist.all_reduce(t, group=sub)
            check_equal(t, torch.full((2,), 3.0), "all_reduce in a sub-group")
        dist.destroy_process_group(sub)
    dist.barrier()
    return out


def s_shutdown(args):
    """destroy_process_group() shuts the group's kccl backend down: it waits
    for the operation in flight, completes its Future (running a Python
    callback), and the backend refuses later operations with a clear error."""
    from torch_kiln import _C

    g = dist.new_group(backend="kccl")
    backend = g._get_backend(DEVICE)
    t = torch.zeros(1000, device=DEVICE)
    _C._sleep(300.0)  # device work the collective waits for
    t.fill_(RANK + 1.0)
    work = dist.all_reduce(t, group=g, async_op=True)
    seen = []
    chained = work.get_future().then(lambda fut: seen.append(fut.value()[0].sum().item()))
    dist.destroy_process_group(g)  # returns once the all_reduce has run
    assert work.is_completed(), "destroy_process_group returned before its all_reduce finished"
    chained.wait()
    total = 1000.0 * sum(range(1, WORLD + 1))
    assert seen == [total], f"the Future's callback saw {seen}, expected [{total}]"
    check_equal(t, torch.full((1000,), total / 1000), "all_reduce completed by the shutdown")
    try:
        backend.allreduce([t])
    except dist.DistBackendError as error:
        message = str(error)
    else:
        raise AssertionError("an all_reduce on a shut-down kccl backend did not raise")
    assert "kccl: all_reduce: the process group was shut down" in message, message
    backend.shutdown()  # a second shutdown is a no-op
    dist.barrier()
    return message.splitlines()[0]


def s_ddp(args):
    """DistributedDataParallel on kiln against one process with the global batch."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)]
    model = torch.nn.Sequential(*layers)
    ref = torch.nn.Sequential(*[type(m)(m.in_features, m.out_features) if isinstance(m, torch.nn.Linear) else m for m in layers])
    ref.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(
        model.to(DEVICE), bucket_cap_mb=0.004, **args.get("ddp_kwargs", {}))  # several buckets
    if args.get("hook") == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    b = 4
    losses = []
    for step in range(args.get("steps", 5)):
        x = torch.randn(WORLD * b, 8, generator=g)
        y = torch.randn(WORLD * b, 4, generator=g)
        opt.zero_grad()
        if args.get("no_sync") and step % 2 == 0:
            with ddp.no_sync():  # accumulate locally, all_reduce on the next step
                ((ddp(x[RANK * b:(RANK + 1) * b].to(DEVICE)) - y[RANK * b:(RANK + 1) * b].to(DEVICE)) ** 2).mean().backward()
            ropt.zero_grad()
            (sum(((ref(x[k * b:(k + 1) * b]) - y[k * b:(k + 1) * b]) ** 2).mean() for k in range(WORLD)) / WORLD).backward()
            x = torch.randn(WORLD * b, 8, generator=g)
            y = torch.randn(WORLD * b, 4, generator=g)
        else:
            ropt.zero_grad()
        loss = ((ddp(x[RANK * b:(RANK + 1) * b].to(DEVICE)) - y[RANK * b:(RANK + 1) * b].to(DEVICE)) ** 2).mean()
        loss.backward()
        opt.step()
        rloss = sum(((ref(x[k * b:(k + 1) * b]) - y[k * b:(k + 1) * b]) ** 2).mean() for k in range(WORLD)) / WORLD
        rloss.backward()
        ropt.step()
        losses.append(rloss.item())
    tol = args.get("rtol", 1e-5)
    for p, q in zip(ddp.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=tol, atol=tol)
    return max((p.detach().cpu() - q.detach()).abs().max().item()
               for p, q in zip(ddp.module.parameters(), ref.parameters()))


def s_gather_scatter_alltoall(args):
    rows = args.get("rows", 3)
    for dtype in [torch.float32, torch.bfloat16, torch.int64, torch.bool]:
        parts = [make_input(r, (rows, 2), dtype, seed=31) for r in range(WORLD)]
        for root in range(WORLD):
            outs = [torch.empty(rows, 2, dtype=dtype, device=DEVICE) for _ in range(WORLD)] if RANK == root else None
            dist.gather(parts[RANK].to(DEVICE), gather_list=outs, dst=root)
            if RANK == root:
                for r in range(WORLD):
                    check_equal(outs[r], parts[r], f"gather to {root} from {r} {dtype}")
            pieces = [make_input(100 + j, (rows, 2), dtype, seed=root) for j in range(WORLD)]
            out = torch.empty(rows, 2, dtype=dtype, device=DEVICE)
            dist.scatter(out, scatter_list=[p.to(DEVICE) for p in pieces] if RANK == root else None, src=root)
            check_equal(out, pieces[RANK], f"scatter from {root} {dtype}")
        # all_to_all_single, equal splits
        inputs = [make_input(r, (WORLD * rows, 2), dtype, seed=32) for r in range(WORLD)]
        out = torch.empty(WORLD * rows, 2, dtype=dtype, device=DEVICE)
        dist.all_to_all_single(out, inputs[RANK].to(DEVICE))
        want = torch.cat([inputs[r][RANK * rows:(RANK + 1) * rows] for r in range(WORLD)])
        check_equal(out, want, f"all_to_all_single {dtype}")
        # uneven splits: rank r sends rows(r, j) = r + 2j + 1 rows to rank j
        split = lambda r, j: (r + 2 * j + 1) * rows  # noqa: E731
        ins = [make_input(r, (sum(split(r, j) for j in range(WORLD)), 2), dtype, seed=33) for r in range(WORLD)]
        in_splits = [split(RANK, j) for j in range(WORLD)]
        out_splits = [split(r, RANK) for r in range(WORLD)]
        out = torch.empty(sum(out_splits), 2, dtype=dtype, device=DEVICE)
        dist.all_to_all_single(out, ins[RANK].to(DEVICE), output_split_sizes=out_splits,
                               input_split_sizes=in_splits)
        want = torch.cat([ins[r][sum(split(r, j) for j in range(RANK)):][:split(r, RANK)] for r in range(WORLD)])
        check_equal(out, want, f"all_to_all_single uneven {dtype}")
        # all_to_all with lists of tensors of different sizes
        outs = [torch.empty(split(r, RANK), 2, dtype=dtype, device=DEVICE) for r in range(WORLD)]
        dist.all_to_all(outs, [t.to(DEVICE) for t in ins[RANK].split(in_splits)])
        for r in range(WORLD):
            check_equal(outs[r], ins[r].split([split(r, j) for j in range(WORLD)])[RANK], f"all_to_all from {r} {dtype}")
    # splits that disagree between ranks are refused, naming both sides
    group = dist.new_group(timeout=datetime.timedelta(seconds=args.get("seconds", 5)))
    bad_in = [1] * WORLD
    bad_out = [1] * WORLD
    if RANK == 0:
        bad_in = [2] + [1] * (WORLD - 1)  # sends 2 rows to itself, fine, but 1 claimed below
        bad_out = [1] * WORLD  # expects 1 row from itself: mismatch with its own send
    out = torch.empty(sum(bad_out), 2, device=DEVICE)
    # Every rank sees the disagreement (each checks every pair). The
    # communication stream's sticky error is raised (once) at the next
    # synchronization -- or wherever the caching allocator next queries an
    # event of that stream, as CUDA's does.
    text = expect_failed(
        ["split sizes must agree", "rank 0 sends 4 elements to rank 0"],
        lambda: (dist.all_to_all_single(out, torch.ones(sum(bad_in), 2, device=DEVICE),
                                        output_split_sizes=bad_out, input_split_sizes=bad_in,
                                        group=group), out.cpu()))
    dist.destroy_process_group(group)
    dist.barrier()
    return text


def s_p2p(args):
    """send/recv, isend/irecv and batch_isend_irecv between neighbours."""
    n = args.get("numel", 10)
    nxt, prv = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    for dtype in [torch.float32, torch.bfloat16, torch.int64, torch.bool]:
        mine = make_input(RANK, (n,), dtype, seed=21)
        theirs = make_input(prv, (n,), dtype, seed=21)
        if WORLD == 2:
            # blocking, in the order that cannot deadlock however long
            got = torch.empty(n, dtype=dtype, device=DEVICE)
            if RANK == 0:
                dist.send(mine.to(DEVICE), dst=1)
                dist.recv(got, src=1)
            else:
                dist.recv(got, src=0)
                dist.send(mine.to(DEVICE), dst=0)
            check_equal(got, theirs, f"send/recv {dtype}")
        # a ring with batch_isend_irecv
        got = torch.empty(n, dtype=dtype, device=DEVICE)
        ops = [dist.P2POp(dist.isend, mine.to(DEVICE), nxt), dist.P2POp(dist.irecv, got, prv)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        check_equal(got, theirs, f"batch_isend_irecv ring {dtype}")
    # isend then irecv, ungrouped: fine while a message fits in one chunk (a
    # longer isend waits for its irecv, as with NCCL); a recv into a strided view
    m = 10
    base = torch.zeros(m, 2, device=DEVICE)
    w1 = dist.isend(torch.arange(m, dtype=torch.float32, device=DEVICE) + RANK, dst=nxt)
    w2 = dist.irecv(base[:, 1], src=prv)
    w1.wait()
    w2.wait()
    check_equal(base[:, 1], torch.arange(m, dtype=torch.float32) + prv, "irecv into a strided view")
    check_equal(base[:, 0], torch.zeros(m), "irecv leaves the rest of the base alone")
    # collectives stay aligned after point-to-point traffic (separate numbering)
    t = torch.ones(3, device=DEVICE)
    dist.all_reduce(t)
    check_equal(t, torch.full((3,), float(WORLD)), "all_reduce after send/recv")
    return True


def expect_failed(fragments, call_and_read):
    """A failing blocking call (recv, a synchronous collective) raises from
    Work.wait() inside the call when its task has already run by then, else
    when the tensor is read or at the next synchronization (timing: under
    load either happens). The first error raised must carry ``fragments``;
    synchronizing afterwards consumes the stream's sticky error either way."""
    texts = []
    for step in (call_and_read, torch.kiln.synchronize):
        try:
            step()
        except RuntimeError as e:
            texts.append(str(e))
    assert texts, f"expected the receive to fail with {fragments}"
    for f in fragments:
        assert f in texts[0], f"error message lacks {f!r}: {texts[0]}"
    return texts[0]


def s_p2p_errors(args):
    out = {}
    t = torch.ones(4, device=DEVICE)
    out["self"] = expect_error(ValueError, [], lambda: dist.send(t, dst=RANK))
    out["range"] = expect_error((ValueError, RuntimeError), [], lambda: dist.send(t, dst=WORLD + 3))
    group = dist.new_group(timeout=datetime.timedelta(seconds=args["seconds"]))
    if RANK == 0:
        dist.send(torch.ones(8, device=DEVICE), dst=1, group=group)
    elif RANK == 1:
        got = torch.empty(4, device=DEVICE)
        out["mismatch"] = expect_failed(
            ["mismatched send/recv", "8 elements"],
            lambda: (dist.recv(got, src=0, group=group), got.cpu()))
    dist.destroy_process_group(group)
    group = dist.new_group(timeout=datetime.timedelta(seconds=args["seconds"]))
    if RANK == 1:
        got = torch.empty(4, device=DEVICE)
        out["timeout"] = expect_failed(  # rank 0 never sends
            ["recv (sequence number 1", "ranks [0] did not arrive", "no matching send"],
            lambda: (dist.recv(got, src=0, group=group), got.cpu()))
    dist.destroy_process_group(group)
    dist.barrier()
    return out


def s_coalesced(args):
    ts = [make_input(RANK, (k + 2,), torch.float32, seed=41 + k) for k in range(3)]
    kiln = [t.to(DEVICE) for t in ts]
    dist.all_reduce_coalesced(kiln)
    for k, t in enumerate(kiln):
        check_equal(t, reference([make_input(r, (k + 2,), torch.float32, seed=41 + k) for r in range(WORLD)], R.SUM),
                    f"all_reduce_coalesced tensor {k}")
    # the coalescing manager's fast paths
    from torch.distributed.distributed_c10d import _coalescing_manager
    outs = [torch.empty(WORLD * 4, device=DEVICE) for _ in range(2)]
    with _coalescing_manager(device=DEVICE, async_ops=True) as cm:
        for k in range(2):
            dist.all_gather_into_tensor(outs[k], torch.full((4,), float(RANK + k), device=DEVICE))
    cm.wait()
    for k in range(2):
        check_equal(outs[k], torch.cat([torch.full((4,), float(r + k)) for r in range(WORLD)]), "coalesced all_gather")
    outs = [torch.empty(4, device=DEVICE) for _ in range(2)]
    with _coalescing_manager(device=DEVICE, async_ops=True) as cm:
        for k in range(2):
            dist.reduce_scatter_tensor(outs[k], torch.full((WORLD * 4,), float(RANK + k), device=DEVICE))
    cm.wait()
    for k in range(2):
        check_equal(outs[k], torch.full((4,), float(sum(r + k for r in range(WORLD)))), "coalesced reduce_scatter")
    return True


def s_dtensor_fsdp(args):
    """DTensor on a 1-D kiln mesh and FSDP2 against one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("kiln", (WORLD,))
    full = make_input(0, (WORLD * 2, 3), torch.float32, seed=51)
    d = distribute_tensor(full.to(DEVICE), mesh, [Shard(0)])
    check_equal(d.to_local(), full[RANK * 2:(RANK + 1) * 2], "distribute_tensor Shard(0)")
    check_equal(d.full_tensor(), full, "DTensor.full_tensor")
    check_equal(d.redistribute(mesh, [Replicate()]).to_local(), full, "redistribute to Replicate")
    # per-shard sums, then kccl's all_reduce in rank order
    shard_sums = [(full[r * 2:(r + 1) * 2] * 2).sum() for r in range(WORLD)]
    check_equal((d * 2).sum().full_tensor(), reference(shard_sums, R.SUM), "a reduction over a sharded DTensor")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    model.to(DEVICE)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(2)
    b = 4
    for _ in range(3):
        x = torch.randn(WORLD * b, 8, generator=g)
        y = torch.randn(WORLD * b, 4, generator=g)
        loss = ((model(x[RANK * b:(RANK + 1) * b].to(DEVICE)) - y[RANK * b:(RANK + 1) * b].to(DEVICE)) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        rloss = sum(((ref(x[k * b:(k + 1) * b]) - y[k * b:(k + 1) * b]) ** 2).mean() for k in range(WORLD)) / WORLD
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor().cpu(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
    return True


def s_failed_input(args):
    """Rank 0's input comes from a kernel that failed on the device."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=args["seconds"]))
    src = torch.arange(4.0, device=DEVICE)
    torch.index_select(src, 0, torch.tensor([1], device=DEVICE))  # first call: checked at once
    index = torch.tensor([7 if RANK == 0 else 1], device=DEVICE)
    t = torch.index_select(src, 0, index)  # fails on rank 0's stream, asynchronously
    work = dist.all_reduce(t, group=group, async_op=True)
    # Errors come out once each, where kiln raises them: the index kernel's at
    # the first synchronization of its stream, the collective's from the Work,
    # the communication stream and the output.
    messages = []
    for attempt in (lambda: t.cpu(), torch.kiln.synchronize, torch.kiln.synchronize, work.wait, lambda: t.cpu()):
        try:
            attempt()
        except Exception as e:  # noqa: BLE001
            messages.append(str(e))
    text = "\n".join(messages)
    want = "holds no valid result" if RANK == 0 else "ranks [0] did not arrive"
    assert want in text, text
    dist.destroy_process_group(group)
    dist.barrier()
    return text


def s_split_group(args):
    """torch.distributed.split_group on a default group bound to this rank's
    device (init_process_group(device_id=...)), as DeviceMesh uses it (Note
    [Splitting a kccl group]): uneven parts, default and explicit options,
    collectives in each part, a DeviceMesh, new_group with a bound device
    (non-members take the no-color path), and split_group's own errors."""
    from torch.distributed.device_mesh import init_device_mesh

    assert dist.distributed_c10d._get_default_group().bound_device_id == DEVICE
    evens, odds = list(range(0, WORLD, 2)), list(range(1, WORLD, 2))
    mine = evens if RANK in evens else odds
    for options in (None, dist.distributed_c10d._get_default_group()._get_backend(DEVICE).options):
        group = dist.split_group(split_ranks=[evens, odds], pg_options=options)
        assert dist.get_process_group_ranks(group) == mine, dist.get_process_group_ranks(group)
        assert group.rank() == mine.index(RANK) and group.size() == len(mine)
        assert dist.get_backend(group) == "kccl", dist.get_backend(group)
        t = torch.full((4,), float(RANK + 1), device=DEVICE)
        dist.all_reduce(t, group=group)
        check_equal(t, torch.full((4,), float(sum(r + 1 for r in mine))), "all_reduce in a split group")
        gathered = [torch.empty(2, device=DEVICE) for _ in mine]
        dist.all_gather(gathered, torch.full((2,), float(RANK), device=DEVICE), group=group)
        for r, g in zip(mine, gathered):
            check_equal(g, torch.full((2,), float(r)), "all_gather in a split group")
        dist.destroy_process_group(group)
    # A part this rank is not in: None (every rank calls split_group).
    alone = dist.split_group(split_ranks=[[0]])
    assert (alone is None) == (RANK != 0), alone
    if alone is not None:
        dist.destroy_process_group(alone)
    # DeviceMesh splits the bound default group for each dimension.
    mesh = init_device_mesh("kiln", (1, WORLD), mesh_dim_names=("dp", "tp"))
    tp = mesh.get_group("tp")
    t = torch.ones(3, device=DEVICE)
    dist.all_reduce(t, group=tp)
    check_equal(t, torch.full((3,), float(WORLD)), "all_reduce over the mesh's tp dimension")
    assert mesh.get_group("dp").size() == 1
    # new_group with a bound device: the non-members' no-color split.
    pair = dist.new_group(ranks=[0, 1])
    if RANK in (0, 1):
        t = torch.full((2,), float(RANK), device=DEVICE)
        dist.all_reduce(t, group=pair)
        check_equal(t, torch.full((2,), 1.0), "all_reduce in a new_group")
        dist.destroy_process_group(pair)
    texts = [expect_error(ValueError, ["duplicate"], lambda: dist.split_group(split_ranks=[[0, 0]])),
             expect_error(ValueError, ["split_ranks cannot be None or empty"],
                          lambda: dist.split_group(split_ranks=[]))]
    dist.barrier()
    return texts


def s_monitored_barrier(args):
    """dist.monitored_barrier on kccl groups (Note [kccl monitored barrier]):
    passes when every rank arrives (default group, twice, with
    wait_all_ranks, a sub-group, a non-member's warning), and names the
    ranks that did not arrive, with Gloo's messages. The failing cases use
    groups of their own (a failed monitored barrier leaves the group's
    barrier count behind on the absent ranks, as Gloo's)."""
    import warnings

    dist.monitored_barrier()
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
    pair = dist.new_group(ranks=[0, 1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.monitored_barrier(group=pair)
    if RANK > 1:
        assert any("monitored_barrier" in str(w.message) for w in caught), [str(w.message) for w in caught]
    texts = []
    absent = WORLD - 1
    one_missing = dist.new_group(ranks=list(range(WORLD)))
    if RANK != absent:
        want = (f"[Rank 0]: Rank {absent} failed to pass monitoredBarrier in 2000 ms" if RANK == 0
                else f"Rank {RANK} successfully reached monitoredBarrier")
        texts.append(expect_error(RuntimeError, [want], lambda: dist.monitored_barrier(
            group=one_missing, timeout=datetime.timedelta(seconds=2))))
    all_missing = dist.new_group(ranks=list(range(WORLD)))
    if RANK == 0:
        others = ", ".join(str(r) for r in range(1, WORLD))
        want = f"[Rank 0]: Rank{'s' if WORLD > 2 else ''} {others} failed to pass monitoredBarrier in 1000 ms"
        texts.append(expect_error(RuntimeError, [want], lambda: dist.monitored_barrier(
            group=all_missing, timeout=datetime.timedelta(seconds=1), wait_all_ranks=True)))
    dist.barrier()
    for g in (pair, one_missing, all_missing):
        if RANK in dist.get_process_group_ranks(g):
            dist.destroy_process_group(g)
    dist.barrier()
    return texts


def s_shm_names(args):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"kccl-{os.getpid()}-"))


SCENARIOS = {name[2:]: fn for name, fn in globals().items() if name.startswith("s_")}


def main() -> None:
    torch.kiln.set_device(DEVICE)
    backend = os.environ.get("KCCL_TEST_BACKEND") or None
    device_id = DEVICE if os.environ.get("KCCL_TEST_DEVICE_ID") == "1" else None
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=60), device_id=device_id)
    print("KCCL-RESULT " + json.dumps({"ok": True, "result": "ready"}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["scenario"] == "exit":
            break
        try:
            result = SCENARIOS[command["scenario"]](command.get("args", {}))
            reply = {"ok": True, "result": result}
        except BaseException:  # noqa: BLE001 - reported to the test
            reply = {"ok": False, "error": traceback.format_exc()}
        print("KCCL-RESULT " + json.dumps(reply, default=str), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
