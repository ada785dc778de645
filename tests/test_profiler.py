"""torch.profiler on kiln: the device side (ProfilerActivity.PrivateUse1).

Kernel tasks, copies and record_function ranges appear as kiln device events
with their stream and device times, linked to the CPU ops that launched them,
in key_averages() and in the chrome trace. See docs/profiling.md.
"""

import copy
import json

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from conftest import assert_same, run_python

ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}


@pytest.fixture(autouse=True)
def _warm_up():
    """First calls of an op pay one-time costs (schema caches, worker thread
    setup); run them before profiling so timings compare kernels."""
    a = torch.randn(64, 64, device="kiln")
    (a @ a + 1).sum().cpu()
    torch.kiln.synchronize()


def device_events(prof):
    return [e for e in prof.events() if e.device_type == DeviceType.PrivateUse1]


def cpu_ops(prof, name):
    return [e for e in prof.events() if e.device_type == DeviceType.CPU and e.name == name]


def launching_op(prof, event):
    """The CPU operator a device event is linked to (runtime calls such as
    kilnLaunchTask share its id, so they are left out)."""
    ops = [e for e in prof.events() if e.device_type == DeviceType.CPU
           and e.id == event.linked_correlation_id and not e.name.startswith("kiln")]
    assert len(ops) == 1, (event.name, [o.name for o in ops])
    return ops[0]


def chrome_trace(prof, tmp_path):
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    return json.loads(path.read_text())["traceEvents"]


def test_kernel_tasks_are_kiln_device_events_with_stream_and_duration():
    a = torch.randn(128, 128, device="kiln")
    side = torch.kiln.Stream()
    torch.kiln.synchronize()
    with profile(activities=ACTIVITIES) as prof:
        b = a @ a
        side.wait_stream(torch.kiln.current_stream())
        with torch.kiln.stream(side):
            c = b.relu()
        torch.kiln.synchronize()

    kernels = {e.name: e for e in device_events(prof) if e.activity_type == "kernel"}
    assert {"aten::mm", "aten::relu"} <= kernels.keys(), kernels.keys()
    mm, relu = kernels["aten::mm"], kernels["aten::relu"]
    assert mm.device_index == 0 and relu.device_index == 0
    assert mm.device_resource_id == 0  # the default stream's torch stream id
    assert relu.device_resource_id == side.stream_id != 0
    for kernel in (mm, relu):
        assert kernel.time_range.end > kernel.time_range.start
    # In stream order: relu waited for mm (wait_stream).
    assert relu.time_range.start >= mm.time_range.end
    # Each kernel is linked to the CPU op that launched it.
    assert launching_op(prof, mm).name == "aten::mm"
    assert launching_op(prof, relu).name == "aten::relu"
    assert_same(c, (a.cpu() @ a.cpu()).relu())


def test_matmul_device_time_exceeds_a_tiny_add_in_key_averages():
    a = torch.randn(512, 512, device="kiln")
    t = torch.ones(4, device="kiln")
    torch.kiln.synchronize()
    with profile(activities=ACTIVITIES) as prof:
        for _ in range(3):
            a @ a
            t + 1
        torch.kiln.synchronize()

    averages = prof.key_averages()
    cpu_rows = {e.key: e for e in averages if e.device_type == DeviceType.CPU}
    mm, add = cpu_rows["aten::mm"], cpu_rows["aten::add"]
    # The self device time of an op row is the time of the kernels it launched.
    kernels = {name: [e.time_range.elapsed_us() for e in device_events(prof) if e.name == name]
               for name in ("aten::mm", "aten::add")}
    assert len(kernels["aten::mm"]) == 3 and len(kernels["aten::add"]) == 3
    assert mm.self_device_time_total == pytest.approx(sum(kernels["aten::mm"]), rel=1e-6)
    assert add.self_device_time_total == pytest.approx(sum(kernels["aten::add"]), rel=1e-6)
    assert 0 < add.self_device_time_total < mm.self_device_time_total
    assert min(kernels["aten::add"]) < min(kernels["aten::mm"])
    assert mm.device_time_total >= mm.self_device_time_total
    table = averages.table(sort_by="device_time_total", row_limit=20)
    assert "Self KILN" in table and "KILN total" in table
    assert "aten::mm" in table and "kilnLaunchTask" in table


def test_copies_appear_with_direction_bytes_and_their_op(tmp_path):
    host = torch.arange(1 << 12, dtype=torch.float32)
    pinned = torch.arange(1 << 12, dtype=torch.float32).pin_memory()
    torch.kiln.synchronize()
    with profile(activities=ACTIVITIES) as prof:
        d0 = host.to("kiln")                           # pageable host -> device
        d0p = pinned.to("kiln", non_blocking=True)     # pinned host -> device
        d1 = d0.to("kiln:1")                           # device 0 -> device 1 (peer)
        back = d1.cpu()                                # device -> pageable host
        torch.kiln.synchronize(0)
        torch.kiln.synchronize(1)

    copies = [e for e in device_events(prof) if e.activity_type == "gpu_memcpy"]
    names = sorted(e.name for e in copies)
    assert names == sorted([
        "Memcpy HtoD (Pageable -> Device)",
        "Memcpy HtoD (Pinned -> Device)",
        "Memcpy PtoP (Device -> Device)",
        "Memcpy DtoH (Device -> Pageable)",
    ]), names
    by_name = {e.name: e for e in copies}
    assert by_name["Memcpy DtoH (Device -> Pageable)"].device_index == 1
    for copy in copies:
        assert copy.time_range.end >= copy.time_range.start
        assert copy.linked_correlation_id > 0
    assert {launching_op(prof, e).name for e in copies} == {"aten::_copy_from"}
    assert_same(back, host)
    assert_same(d0p, pinned)

    # The chrome trace keeps the byte counts.
    traced = [e for e in chrome_trace(prof, tmp_path) if e.get("cat") == "gpu_memcpy"]
    assert len(traced) == 4
    assert all(e["args"]["bytes"] == host.numel() * host.element_size() for e in traced)


def test_chrome_trace_has_one_track_per_kiln_stream_used(tmp_path):
    a = torch.randn(64, 64, device="kiln")
    a1 = torch.randn(64, 64, device="kiln:1")
    s1 = torch.kiln.Stream()
    s2 = torch.kiln.Stream()
    assert len({0, s1.stream_id, s2.stream_id}) == 3
    torch.kiln.synchronize(0)
    torch.kiln.synchronize(1)
    with profile(activities=ACTIVITIES) as prof:
        a @ a
        for s in (s1, s2):
            s.wait_stream(torch.kiln.current_stream())
            with torch.kiln.stream(s):
                a.sin()
        a1.cos()
        torch.kiln.synchronize(0)
        torch.kiln.synchronize(1)
    events = chrome_trace(prof, tmp_path)

    work = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")]
    tracks = {(e["pid"], e["tid"]) for e in work}
    assert tracks == {(0, 0), (0, s1.stream_id), (0, s2.stream_id), (1, 0)}
    for e in work:
        assert e["args"]["device"] == e["pid"] and e["args"]["stream"] == e["tid"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name" and (e["pid"], e["tid"]) in tracks}
    assert names == {
        (0, 0): "kiln:0 stream 0 (default)",
        (0, s1.stream_id): f"kiln:0 stream {s1.stream_id}",
        (0, s2.stream_id): f"kiln:0 stream {s2.stream_id}",
        (1, 0): "kiln:1 stream 0 (default)",
    }
    process_names = {e["pid"]: e["args"]["name"] for e in events
                     if e.get("ph") == "M" and e.get("name") == "process_name"}
    assert process_names[0] == "kiln"

    # Launches and kernels are joined by flow arrows (ac2g): each kernel ends a
    # flow that starts at its kilnLaunchTask on the launching CPU thread, and
    # carries the External id of the op that launched it.
    kernels = [e for e in work if e["cat"] == "kernel"]
    starts = {e["id"]: e for e in events if e.get("cat") == "ac2g" and e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e.get("cat") == "ac2g" and e["ph"] == "f"}
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "privateuse1_runtime" and e["name"] == "kilnLaunchTask"}
    cpu_ops_by_id = {e["args"]["External id"]: e for e in events
                     if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    for kernel in kernels:
        correlation = kernel["args"]["correlation"]
        launch = launches[correlation]
        assert starts[correlation]["pid"] == launch["pid"] != kernel["pid"]
        assert (ends[correlation]["pid"], ends[correlation]["tid"]) == (kernel["pid"], kernel["tid"])
        op = cpu_ops_by_id[kernel["args"]["External id"]]
        assert op["name"] == kernel["name"]  # e.g. aten::mm launched aten::mm's kernel
        assert launch["args"]["External id"] == kernel["args"]["External id"]
        assert launch["ts"] <= kernel["ts"]


def test_record_function_ranges_appear_on_the_device_track(tmp_path):
    a = torch.randn(256, 256, device="kiln")
    torch.kiln.synchronize()
    with profile(activities=ACTIVITIES) as prof:
        a.exp()  # outside the range
        with record_function("attention_block"):
            b = a @ a
            b.softmax(dim=-1)
        torch.kiln.synchronize()
    events = chrome_trace(prof, tmp_path)

    ranges = [e for e in events if e.get("cat") == "gpu_user_annotation"]
    assert [r["name"] for r in ranges] == ["attention_block"]
    (device_range,) = ranges
    assert (device_range["pid"], device_range["tid"]) == (0, 0)
    kernels = {e["name"]: e for e in events if e.get("cat") == "kernel"}
    inside = [kernels["aten::mm"], kernels["aten::_softmax"]]
    first = min(k["ts"] for k in inside)
    last = max(k["ts"] + k["dur"] for k in inside)
    assert device_range["ts"] <= first and device_range["ts"] + device_range["dur"] >= last
    outside = kernels["aten::exp"]
    assert outside["ts"] + outside["dur"] <= device_range["ts"] + 0.01
    # The CPU-side range is there too, and the device range names its id.
    (cpu_range,) = [e for e in events if e.get("cat") == "user_annotation"
                    and e["name"] == "attention_block"]
    assert device_range["args"]["External id"] == cpu_range["args"]["External id"]
    # In key_averages the device range is its own row; the CPU range's device
    # time is that of the kernels inside it, not of the span on top.
    averages = {(e.key, e.device_type): e for e in prof.key_averages()}
    kernel_us = sum(k["dur"] for k in inside)
    assert averages[("attention_block", DeviceType.CPU)].device_time_total == pytest.approx(
        kernel_us, rel=1e-3, abs=0.01)
    assert averages[("attention_block", DeviceType.PrivateUse1)].device_time_total >= kernel_us - 0.01


def test_backward_kernels_are_linked_to_backward_ops():
    w = torch.randn(64, 64, device="kiln", requires_grad=True)
    x = torch.randn(32, 64, device="kiln")
    torch.kiln.synchronize()
    with profile(activities=ACTIVITIES) as prof:
        (x @ w).square().sum().backward()
        torch.kiln.synchronize()
    # Backward ops run on autograd's kiln device thread; their launches are
    # still attributed to them.
    kernels = [e for e in device_events(prof) if e.activity_type == "kernel"]
    assert kernels
    launching_threads = {launching_op(prof, k).thread for k in kernels}
    assert len(launching_threads) >= 2  # the Python thread and autograd's
    mm_kernels = [k for k in kernels if k.name == "aten::mm"]
    assert len(mm_kernels) >= 2  # forward, and the gradient of w
    assert w.grad is not None
    assert_same(w.grad, (x.cpu().t() @ (2 * (x.cpu() @ w.detach().cpu()))))


def test_cpu_only_profile_records_no_device_activity():
    a = torch.randn(64, 64, device="kiln")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        a @ a
        torch.kiln.synchronize()
    assert device_events(prof) == []
    assert not [e for e in prof.events() if e.name == "kilnLaunchTask"]
    assert cpu_ops(prof, "aten::mm")


def test_profiling_does_not_change_results():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 32)

    def step(device):
        m = copy.deepcopy(model).to(device)
        out = m(x.to(device))
        loss = out.square().mean()
        loss.backward()
        grads = [p.grad.detach().cpu() for p in m.parameters()]
        return out.detach().cpu(), grads

    expected_out, expected_grads = step("cpu")
    plain_out, plain_grads = step("kiln")
    with profile(activities=ACTIVITIES, record_shapes=True) as prof:
        with record_function("step"):
            profiled_out, profiled_grads = step("kiln")
    after_out, after_grads = step("kiln")
    assert device_events(prof)  # it did profile the device
    for out in (plain_out, profiled_out, after_out):
        assert_same(out, expected_out)
    for grads in (plain_grads, profiled_grads, after_grads):
        for got, want in zip(grads, expected_grads):
            assert_same(got, want)


def test_scheduled_profiling_records_only_active_steps():
    a = torch.randn(128, 128, device="kiln")
    traces = []

    def on_ready(prof):
        traces.append([e.name for e in prof.events() if e.device_type == DeviceType.PrivateUse1])

    schedule = torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1)
    with profile(activities=ACTIVITIES, schedule=schedule, on_trace_ready=on_ready) as prof:
        for step in range(6):
            with record_function(f"step{step}"):
                a.add(step)
            torch.kiln.synchronize()
            prof.step()
    assert len(traces) == 1
    kernels = [name for name in traces[0] if name == "aten::add"]
    assert len(kernels) == 2  # steps 2 and 3 only
    ranges = sorted(name for name in traces[0] if name.startswith("step"))
    assert ranges == ["step2", "step3"]


def test_launch_blocking_mode_is_profiled_too():
    # KILN_LAUNCH_BLOCKING=1 runs each task inside its launch; it is still
    # recorded as device work, nested in its launch on the timeline.
    code = """
import torch
from torch.profiler import profile, ProfilerActivity
a = torch.randn(64, 64, device="kiln")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
    (a @ a).cpu()
kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.PrivateUse1
           and e.name == "aten::mm"]
launches = [e for e in prof.events() if e.name == "kilnLaunchTask"]
assert len(kernels) == 1 and len(launches) == 1, (kernels, launches)
k, l = kernels[0].time_range, launches[0].time_range
assert l.start <= k.start and k.end <= l.end, (l.start, k.start, k.end, l.end)
print("ok")
"""
    result = run_python(code, {"KILN_LAUNCH_BLOCKING": "1"})
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr


# --- The legacy profiler: torch.autograd.profiler.profile(use_device="kiln") ---
# Without Kineto, PyTorch times each op between two kiln events recorded on
# the current stream at its start and end (Note [Legacy profiler on kiln]).

def legacy_profile(fn):
    with torch.autograd.profiler.profile(use_device="kiln") as prof:
        result = fn()
    return prof, result


def assert_no_negative_times(prof):
    for e in prof.function_events:
        assert e.time_range.start >= 0 and e.time_range.end >= e.time_range.start, e.name
        assert e.cpu_time_total >= 0 and e.self_cpu_time_total >= 0, e.name
        assert e.device_time_total >= 0 and e.self_device_time_total >= 0, e.name
        assert all(k.duration >= 0 for k in e.kernels), e.name


def test_legacy_profiler_times_a_kiln_matmul_on_the_device():
    import time

    a = torch.randn(512, 512)
    ka = a.to("kiln")
    (ka @ ka).cpu()  # first call of mm on this layout, outside the profile
    start = time.perf_counter()
    prof, product = legacy_profile(lambda: ka @ ka)  # __exit__ synchronizes
    wall_us = (time.perf_counter() - start) * 1e6
    assert_same(product, a @ a)
    assert_no_negative_times(prof)

    rows = {e.key: e for e in prof.key_averages()}
    assert {"aten::matmul", "aten::mm"} <= rows.keys(), rows.keys()
    matmul, mm = rows["aten::matmul"], rows["aten::mm"]
    assert matmul.count == 1
    # The kernel ran on the device after aten::mm had returned on the host:
    # its device time is the kernel's, far longer than the launch.
    assert mm.self_device_time_total > 0
    assert mm.device_time_total > mm.cpu_time_total
    # Events complete in stream order, so the device time of aten::matmul
    # brackets that of the aten::mm it called, and all fits in the profile.
    assert matmul.device_time_total >= max(e.device_time_total for e in prof.function_events
                                           if e.name == "aten::mm")
    assert matmul.device_time_total <= wall_us
    table = prof.key_averages().table(sort_by="self_device_time_total")
    assert "Self KILN" in table and "aten::mm" in table

    # The same program profiled on CPU lists the same ops (kiln adds the
    # allocation of the out= result it computes into).
    cpu_prof, _ = legacy_profile(lambda: a @ a)
    cpu_ops = {e.key for e in cpu_prof.key_averages()} - {"aten::resolve_conj"}
    assert cpu_ops <= rows.keys(), (cpu_ops, rows.keys())


def test_legacy_profiler_times_backward_ops_on_autograd_threads():
    torch.manual_seed(0)
    w = torch.randn(128, 128, requires_grad=True)
    x = torch.randn(32, 128)
    kw = w.detach().to("kiln").requires_grad_()
    kx = x.to("kiln")
    (kx @ kw).relu().sum().backward()  # first calls, outside the profile
    kw.grad = None
    torch.kiln.synchronize()

    def step():
        (kx @ kw).relu().sum().backward()
        return kw.grad

    prof, grad = legacy_profile(step)
    (x @ w).relu().sum().backward()
    assert_same(grad, w.grad)
    assert_no_negative_times(prof)
    backward_mms = [e for e in prof.function_events
                    if e.name == "aten::mm" and e.thread != prof.function_events[0].thread]
    assert backward_mms, "no aten::mm on autograd's kiln device thread"
    assert sum(e.device_time_total for e in backward_mms) > 0


def test_legacy_profiler_does_not_warn_and_leaves_kineto_profiling_intact():
    # Before kiln registered its ProfilerStubs, every op's profiler callback
    # threw "PrivateUse1 used in profiler but not enabled" (logged to stderr
    # once per op) and CPU times came out negative.
    code = """
import torch, warnings
from torch.profiler import profile, ProfilerActivity
warnings.simplefilter("error")
a = torch.randn(64, 64, device="kiln")
(a @ a).cpu()
for _ in range(2):
    with torch.autograd.profiler.profile(use_device="kiln") as prof:
        for _ in range(20):
            b = (a @ a).relu()
    rows = {e.key: e for e in prof.key_averages()}
    assert rows["aten::mm"].count >= 20 and rows["aten::mm"].self_device_time_total > 0, rows
    assert all(e.cpu_time_total >= 0 and e.device_time_total >= 0 for e in prof.function_events)
    # Kineto's path, before and after: device kernels from kiln's plugin.
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as kprof:
        (a @ a).cpu()
    kernels = [e.name for e in kprof.events() if e.device_type == torch.autograd.DeviceType.PrivateUse1]
    assert "aten::mm" in kernels, kernels
assert torch.equal(b.cpu(), (a.cpu() @ a.cpu()).relu())
print("ok")
"""
    result = run_python(code)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr
    assert "used in profiler but not enabled" not in result.stderr
    assert "Exception in RecordFunction callback" not in result.stderr
    assert "could not" not in result.stderr  # the stubs' own warnings


# --- torch.kiln.nvtx: torch.cuda.nvtx's ranges as record_function ranges ------

@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_nvtx_ranges_appear_as_profiler_ranges_on_cpu_and_device(device, tmp_path):
    from torch.kiln import nvtx
    a = torch.randn(128, 128, device=device)
    torch.kiln.synchronize(device)
    with profile(activities=ACTIVITIES) as prof:
        assert nvtx.range_push("outer") == 0
        assert nvtx.range_push("inner") == 1
        b = a @ a
        assert nvtx.range_pop() == 1
        nvtx.mark("checkpoint")
        with nvtx.range("block {}", 7):
            b.exp()
        handle = nvtx.range_start("cross_thread")
        import threading
        worker = threading.Thread(target=nvtx.range_end, args=(handle,))
        worker.start()
        worker.join()
        assert nvtx.range_pop() == 0
        torch.kiln.synchronize(device)
    events = chrome_trace(prof, tmp_path)
    cpu = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    assert {"outer", "inner", "checkpoint", "block 7", "cross_thread"} <= cpu
    on_device = {e["name"] for e in events if e.get("cat") == "gpu_user_annotation"}
    # The innermost range around kiln work shows on the device track, as for
    # record_function (see test_record_function_ranges_appear_on_the_device_track).
    assert {"inner", "block 7"} <= on_device


def test_nvtx_range_decorates_and_pops_on_exceptions():
    from torch.kiln import nvtx

    @nvtx.range("decorated")
    def work(x):
        return x * 2

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert_same(work(torch.ones(3, device="kiln")), torch.full((3,), 2.0))
        with pytest.raises(KeyError):
            with nvtx.range("failing"):
                raise KeyError("x")
    names = [e.name for e in prof.events()]
    assert "decorated" in names and "failing" in names
    assert nvtx.range_pop() == -1  # both ranges were closed: nothing is open


def test_nvtx_bad_input():
    from torch.kiln import nvtx
    assert nvtx.range_pop() == -1  # as NVTX: a negative depth, nothing changes
    with pytest.raises(ValueError, match="is not the handle of an open range"):
        nvtx.range_end(10**9)
    handle = nvtx.range_start("once")
    nvtx.range_end(handle)
    with pytest.raises(ValueError, match="each range ends once"):
        nvtx.range_end(handle)
    for call in (nvtx.range_push, nvtx.range_start, nvtx.mark):
        with pytest.raises(TypeError, match="msg must be a str"):
            call(5)
    import torch.kiln.nvtx as imported
    assert imported is torch.kiln.nvtx
