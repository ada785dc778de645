"""Memory snapshots on kiln: torch.kiln.memory._record_memory_history,
_snapshot, memory_snapshot and _dump_snapshot, in torch.cuda.memory's format,
read by PyTorch's own visualizer code (torch.cuda._memory_viz)."""

import inspect
import os
import pickle
import subprocess
import sys
import threading

import pytest
import torch
import torch.cuda._memory_viz as memory_viz

from conftest import run_python

MiB = 1024 * 1024
memory = torch.kiln.memory


@pytest.fixture(autouse=True)
def _stop_recording():
    """Every test starts from an empty cache and leaves recording off."""
    torch.kiln.synchronize()
    torch.kiln.empty_cache()
    yield
    memory._record_memory_history(None)


def line_of(text: str) -> int:
    """Line number in this file of the first line containing `text`."""
    lines = inspect.getsource(sys.modules[__name__]).splitlines()
    return 1 + next(i for i, line in enumerate(lines) if text in line)


def allocate_in_helper(n: int, device: str) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, device=device)  # ALLOCATION LINE


def blocks_of(snapshot, device: int, state: str):
    return [b for seg in snapshot["segments"] if seg["device"] == device
            for b in seg["blocks"] if b["state"] == state]


def events_at(snapshot, device: int, address: int):
    return [e for e in snapshot["device_traces"][device] if e.get("addr") == address]


def check_trace_replays_to_snapshot(snapshot) -> None:
    """Replays every device's trace backwards from the snapshot's state, as the
    visualizer (torch/utils/viz/MemoryViz.js) does to draw the allocator at each
    event, and checks each step is consistent: a freed block was live, an
    allocated block was not, live blocks always lie in a live segment, a freed
    segment held no live block."""
    for device, trace in enumerate(snapshot["device_traces"]):
        segments = {s["address"]: s["total_size"] for s in snapshot["segments"]
                    if s["device"] == device}
        live = {b["address"]: b["requested_size"] for s in snapshot["segments"]
                if s["device"] == device for b in s["blocks"]
                if b["state"] in ("active_allocated", "active_pending_free")}

        def in_segment(addr):
            return any(base <= addr < base + size for base, size in segments.items())

        for event in reversed(trace):
            action, addr = event["action"], event.get("addr")
            if action == "alloc":
                assert addr in live, event
                del live[addr]
            elif action == "free_completed":
                assert addr not in live, event
                live[addr] = event["size"]
                assert in_segment(addr), event
            elif action == "free_requested":
                assert addr in live, event
            elif action == "segment_free":
                assert addr not in segments, event
                segments[addr] = event["size"]
            elif action == "segment_alloc":
                assert segments.get(addr) == event["size"], event
                assert not any(addr <= b < addr + event["size"] for b in live), event
                del segments[addr]
            else:
                assert action in ("oom", "snapshot"), event


@pytest.mark.parametrize("device", [0, 1])
def test_snapshot_has_cuda_format_and_matches_memory_stats(device):
    memory._record_memory_history()
    keep = [allocate_in_helper(n, f"kiln:{device}") for n in (1000, 3000, 300_000, 5 * MiB)]
    side = torch.kiln.Stream(device)
    with torch.kiln.stream(side):
        keep.append(allocate_in_helper(2 * MiB, f"kiln:{device}"))
    snapshot = memory._snapshot()

    assert set(snapshot) >= {"segments", "device_traces", "allocator_settings"}
    assert len(snapshot["device_traces"]) == torch.kiln.device_count()
    for seg in snapshot["segments"]:
        assert set(seg) >= {"device", "address", "total_size", "allocated_size", "active_size",
                            "requested_size", "stream", "segment_type", "segment_pool_id",
                            "is_expandable", "frames", "blocks"}
        assert seg["segment_type"] in ("small", "large")
        address = seg["address"]
        for block in seg["blocks"]:  # the blocks tile the segment, in address order
            assert set(block) >= {"address", "size", "requested_size", "state", "frames"}
            assert block["address"] == address
            assert block["state"] in ("active_allocated", "active_pending_free", "inactive")
            address += block["size"]
        assert address == seg["address"] + seg["total_size"]
        assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"]
                                            if b["state"] == "active_allocated")
    for entry in snapshot["device_traces"][device]:
        assert set(entry) >= {"action", "size", "stream", "time_us", "frames"}

    # The numbers are the allocator's statistics.
    ours = [s for s in snapshot["segments"] if s["device"] == device]
    assert sum(s["total_size"] for s in ours) == torch.kiln.memory_reserved(device)
    assert sum(b["size"] for b in blocks_of(snapshot, device, "active_allocated")) == \
        torch.kiln.memory_allocated(device)
    assert sum(s["requested_size"] for s in ours) == \
        torch.kiln.memory_stats(device)["requested_bytes.all.current"]
    assert {t.untyped_storage().data_ptr() for t in keep} <= \
        {b["address"] for b in blocks_of(snapshot, device, "active_allocated")}
    # Streams are stream ids (0: the default stream), as Python sees them.
    by_address = {s["address"]: s for s in ours}
    assert by_address[keep[-1].untyped_storage().data_ptr()]["stream"] == side.stream_id
    assert by_address[keep[3].untyped_storage().data_ptr()]["stream"] == 0
    # The other device's trace is untouched by this device's allocations.
    other = 1 - device
    assert all(e["action"] == "snapshot" for e in snapshot["device_traces"][other])
    check_trace_replays_to_snapshot(snapshot)


def test_external_stream_allocations_carry_its_stream_id(runtime_stream):
    memory._record_memory_history()
    ext = torch.kiln.ExternalStream(runtime_stream(1))
    with torch.kiln.stream(ext):
        x = allocate_in_helper(3 * MiB, "kiln:1")
    snapshot = memory._snapshot()
    address = x.untyped_storage().data_ptr()
    segment = next(s for s in snapshot["segments"] if s["address"] == address)
    assert segment["stream"] == ext.stream_id == ext.kiln_stream and segment["device"] == 1
    assert {e["stream"] for e in events_at(snapshot, 1, address)} == {ext.stream_id}
    del x


def test_trace_records_each_allocator_action_in_order():
    memory._record_memory_history()
    x = allocate_in_helper(4 * MiB, "kiln")  # a large segment of its own
    address = x.untyped_storage().data_ptr()
    del x
    torch.kiln.empty_cache()
    snapshot = memory._snapshot()
    events = events_at(snapshot, 0, address)
    assert [e["action"] for e in events] == [
        "segment_alloc", "alloc", "free_requested", "free_completed", "segment_free"]
    assert [e["size"] for e in events] == [4 * MiB] * 5
    assert all(e["stream"] == 0 and e["device"] == 0 for e in events)
    times = [e["time_us"] for e in snapshot["device_traces"][0]]
    assert times == sorted(times)
    assert snapshot["device_traces"][0][-1]["action"] == "snapshot"
    check_trace_replays_to_snapshot(snapshot)


def test_frames_name_the_python_line_that_allocated_and_freed():
    memory._record_memory_history(stacks="python")
    x = allocate_in_helper(1000, "kiln")
    address = x.untyped_storage().data_ptr()
    del x  # FREE LINE
    snapshot = memory._snapshot()
    alloc, free_requested, _ = [e for e in events_at(snapshot, 0, address)
                                if e["action"] != "segment_alloc"]
    top = alloc["frames"][0]
    assert top == {"filename": __file__, "line": line_of("# ALLOCATION LINE"),
                   "name": "allocate_in_helper"}
    assert alloc["frames"][1]["name"] == "test_frames_name_the_python_line_that_allocated_and_freed"
    assert free_requested["frames"][0]["line"] == line_of("del x  # FREE LINE")
    # A live block carries the stack of its allocation.
    y = allocate_in_helper(2000, "kiln")
    block = next(b for b in blocks_of(memory._snapshot(), 0, "active_allocated")
                 if b["address"] == y.untyped_storage().data_ptr())
    assert block["frames"][0]["name"] == "allocate_in_helper"
    assert block["requested_size"] == 2000


def test_context_levels_decide_which_stacks_are_kept():
    def run(context):
        memory._record_memory_history("all", context=context, stacks="python")
        x = allocate_in_helper(1000, "kiln")
        address = x.untyped_storage().data_ptr()
        del x
        keep = allocate_in_helper(1000, "kiln")
        snapshot = memory._snapshot()
        memory._record_memory_history(None)
        by_action = {}  # the first event of each action: x's (keep may reuse its address)
        for event in events_at(snapshot, 0, address):
            by_action.setdefault(event["action"], event)
        live = next(b for b in blocks_of(snapshot, 0, "active_allocated")
                    if b["address"] == keep.untyped_storage().data_ptr())
        return by_action, live

    events, live = run(None)  # history without stacks
    assert events["alloc"]["frames"] == [] and live["frames"] == []
    events, live = run("state")  # stacks of live blocks only
    assert events["alloc"]["frames"] == [] and live["frames"][0]["name"] == "allocate_in_helper"
    events, live = run("alloc")  # also on trace entries; a free shows the allocation's stack
    assert events["alloc"]["frames"][0]["name"] == "allocate_in_helper"
    assert events["free_requested"]["frames"] == events["alloc"]["frames"]
    events, live = run("all")  # a free shows its own stack
    assert events["free_requested"]["frames"][0]["name"] == "run"


def test_stacks_all_adds_cpp_frames():
    memory._record_memory_history(stacks="all", max_entries=20)
    x = allocate_in_helper(1000, "kiln")
    snapshot = memory._snapshot()
    alloc = next(e for e in events_at(snapshot, 0, x.untyped_storage().data_ptr())
                 if e["action"] == "alloc")
    names = [f["name"] for f in alloc["frames"]]
    assert any("empty_memory_format" in name for name in names)  # C++ (the dispatcher)
    assert "allocate_in_helper" in names                          # and Python


def test_state_mode_keeps_stacks_but_no_history():
    memory._record_memory_history("state", stacks="python")
    keep = [allocate_in_helper(1000, "kiln") for _ in range(5)]
    snapshot = memory._snapshot()
    assert len(snapshot["device_traces"][0]) <= 1
    frames = [b["frames"] for b in blocks_of(snapshot, 0, "active_allocated")
              if b["address"] in {t.untyped_storage().data_ptr() for t in keep}]
    assert len(frames) == 5 and all(f[0]["name"] == "allocate_in_helper" for f in frames)


def test_max_entries_keeps_the_newest_events():
    memory._record_memory_history(max_entries=6)
    keep = [allocate_in_helper(1000, "kiln") for _ in range(10)]
    trace = memory._snapshot()["device_traces"][0]
    assert len(trace) == 6
    assert trace[-1]["action"] == "snapshot"
    assert [e["addr"] for e in trace[:-1]] == [t.untyped_storage().data_ptr() for t in keep[-5:]]


def test_disabling_stops_recording_and_drops_the_trace():
    memory._record_memory_history()
    allocate_in_helper(1000, "kiln")
    assert len(memory._snapshot()["device_traces"][0]) > 0
    memory._record_memory_history(None)
    x = allocate_in_helper(1000, "kiln")
    snapshot = memory._snapshot()
    assert snapshot["device_traces"] == [[] for _ in range(torch.kiln.device_count())]
    block = next(b for b in blocks_of(snapshot, 0, "active_allocated")
                 if b["address"] == x.untyped_storage().data_ptr())
    assert block["frames"] == []


def test_clear_history_and_skip_actions():
    memory._record_memory_history()
    allocate_in_helper(1000, "kiln")
    memory._record_memory_history(clear_history=True, skip_actions=["free_requested", "snapshot"])
    x = allocate_in_helper(1000, "kiln")
    del x
    actions = [e["action"] for e in memory._snapshot()["device_traces"][0]]
    assert actions == ["alloc", "free_completed"]


def test_record_stream_block_is_pending_free_until_the_side_stream_is_done():
    memory._record_memory_history()
    x = allocate_in_helper(1000, "kiln")
    address = x.untyped_storage().data_ptr()
    side = torch.kiln.Stream()
    with torch.kiln.stream(side):
        torch.kiln._sleep(300)
    x.record_stream(side)
    del x
    snapshot = memory._snapshot()
    pending = [b for b in blocks_of(snapshot, 0, "active_pending_free") if b["address"] == address]
    assert len(pending) == 1 and pending[0]["requested_size"] == 1000
    assert [e["action"] for e in events_at(snapshot, 0, address)][-1] == "free_requested"
    check_trace_replays_to_snapshot(snapshot)
    side.synchronize()
    allocate_in_helper(1000, "kiln")  # an allocation collects the completed free
    snapshot = memory._snapshot()
    assert "free_completed" in [e["action"] for e in events_at(snapshot, 0, address)]
    assert not blocks_of(snapshot, 0, "active_pending_free")
    check_trace_replays_to_snapshot(snapshot)


def test_out_of_memory_is_recorded():
    memory._record_memory_history()
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(1 << 50, dtype=torch.uint8, device="kiln:1")
    oom = [e for e in memory._snapshot()["device_traces"][1] if e["action"] == "oom"]
    assert len(oom) == 1 and oom[0]["size"] == 1 << 50
    assert oom[0]["device_free"] == torch.kiln.mem_get_info(1)[0]


def test_frees_from_another_python_thread_are_recorded_with_its_stack():
    memory._record_memory_history(stacks="python")
    addresses = []

    def worker():
        t = allocate_in_helper(1000, "kiln:1")
        addresses.append(t.untyped_storage().data_ptr())
        del t

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    events = events_at(memory._snapshot(), 1, addresses[0])
    assert [e["action"] for e in events][-3:] == ["alloc", "free_requested", "free_completed"]
    assert events[-1]["frames"][0]["name"] == "worker"


def test_memory_viz_reads_the_snapshot(tmp_path):
    memory._record_memory_history()
    keep = [allocate_in_helper(n, "kiln:1") for n in (1000, 300_000, 3 * MiB)]
    side = torch.kiln.Stream()
    with torch.kiln.stream(side):
        keep.append(torch.randn(1000, device="kiln"))
    del keep[0]
    before = memory._snapshot()
    keep.append(allocate_in_helper(6 * MiB, "kiln"))
    snapshot = memory._snapshot()

    summary = memory_viz.segsum(snapshot)  # checks that the blocks add up to each segment
    assert f"segments: {len(snapshot['segments'])}" in summary
    reserved = torch.kiln.memory_reserved(0) + torch.kiln.memory_reserved(1)
    assert f"total_reserved: {memory_viz.Bytes(reserved)}" in summary
    text = memory_viz.trace(snapshot)
    assert "Device 0" in text and "Device 1" in text and "cudaMalloc(" in text
    flamegraph = memory_viz.segments(snapshot, format_flamegraph=lambda lines: lines)
    assert "allocate_in_helper" in flamegraph and "active_allocated" in flamegraph
    assert "allocate_in_helper" in memory_viz.memory(snapshot, format_flamegraph=lambda lines: lines)
    assert "only_after" in memory_viz.compare(before["segments"], snapshot["segments"], format_flamegraph=lambda lines: lines)
    for html in (memory_viz.trace_plot(snapshot), memory_viz.segment_plot(snapshot)):
        assert "MemoryViz.js" in html and "snapshot.pickle" in html
    check_trace_replays_to_snapshot(snapshot)


def test_dump_snapshot_writes_a_pickle_the_viz_command_line_reads(tmp_path):
    memory._record_memory_history()
    keep = allocate_in_helper(2 * MiB, "kiln")
    path = tmp_path / "kiln_snapshot.pickle"
    memory._dump_snapshot(str(path))
    with open(path, "rb") as f:
        loaded = pickle.load(f)
    assert set(loaded) >= {"segments", "device_traces", "allocator_settings"}
    address = keep.untyped_storage().data_ptr()
    assert address in [b["address"] for b in blocks_of(loaded, 0, "active_allocated")]
    for command in ("stats", "trace"):
        result = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", command, str(path)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout
    with pytest.raises(OSError):
        memory._dump_snapshot(str(tmp_path / "no such directory" / "x.pickle"))


def test_memory_snapshot_is_the_segments():
    keep = allocate_in_helper(3 * MiB, "kiln:1")
    segments = torch.kiln.memory_snapshot()
    assert segments == memory._snapshot()["segments"]
    assert keep.untyped_storage().data_ptr() in [s["address"] for s in segments]
    assert torch.kiln.memory_snapshot((0, 0)) == segments
    with pytest.raises(ValueError, match="not a memory pool kiln made"):
        torch.kiln.memory_snapshot((10**9, 0))
    pool = torch.kiln.MemPool()
    assert torch.kiln.memory_snapshot(pool.id) == []  # a pool with nothing in it yet


def test_allocator_settings_name_kiln_sizes_and_fractions():
    settings = memory._snapshot()["allocator_settings"]
    assert settings["expandable_segments"] is False
    assert settings["min_block_size"] == 512
    assert settings["per_process_memory_fraction"] == [
        torch.kiln.get_per_process_memory_fraction(d) for d in range(torch.kiln.device_count())]


def test_legacy_boolean_form():
    memory._record_memory_history(True, trace_alloc_max_entries=100, trace_alloc_record_context=True)
    x = allocate_in_helper(1000, "kiln")
    alloc = next(e for e in events_at(memory._snapshot(), 0, x.untyped_storage().data_ptr())
                 if e["action"] == "alloc")
    assert alloc["frames"][0]["name"] == "allocate_in_helper"
    memory._record_memory_history(False)
    assert memory._snapshot()["device_traces"][0] == []


def test_import_forms_reach_the_same_module():
    import torch.kiln.memory as imported
    from torch.kiln.memory import _snapshot
    assert imported is torch.kiln.memory and _snapshot is memory._snapshot


@pytest.mark.parametrize("kwargs, error, match", [
    ({"enabled": "yes"}, ValueError, "enabled must be"),
    ({"context": "frames"}, ValueError, "context must be"),
    ({"stacks": "cpp"}, ValueError, "stacks must be"),
    ({"max_entries": 0}, ValueError, "at least 1"),
    ({"max_entries": "10"}, TypeError, "max_entries must be an int"),
    ({"max_entries": 2.5}, TypeError, "max_entries must be an int"),
    ({"skip_actions": ["malloc"]}, ValueError, "unknown action 'malloc'"),
    ({"compile_context": True}, NotImplementedError, "compile_context"),
    ({"global_record_annotations": True}, NotImplementedError, "global_record_annotations"),
    ({"device": 5}, RuntimeError, "Kiln has 2 devices"),
    ({"device": "cuda"}, ValueError, "Expected a kiln device"),
])
def test_bad_arguments_raise_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        memory._record_memory_history(**kwargs)
    assert memory._snapshot()["device_traces"][0] == []  # nothing was enabled


def test_binding_checks_its_arguments_too():
    from torch_kiln import _C
    with pytest.raises(ValueError, match="stacks must be"):
        _C._record_memory_history("all", "all", "everything", 10, False, [])
    with pytest.raises(ValueError, match="Unknown memory history action"):
        _C._record_memory_history("all", "all", "python", 10, False, ["bogus"])


def test_recording_is_off_in_a_fresh_process():
    code = (
        "import torch\n"
        "x = torch.ones(1000, device='kiln')\n"
        "s = torch.kiln.memory._snapshot()\n"
        "blocks = [b for seg in s['segments'] for b in seg['blocks'] if b['state'] == 'active_allocated']\n"
        "print(s['device_traces'], [b['frames'] for b in blocks], len(blocks))\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[[],", "[]]", "[[]]", "1"]
