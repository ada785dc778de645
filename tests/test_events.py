"""Events: record, wait, query, synchronize and elapsed_time, across streams
and devices."""

import pytest
import torch


def test_elapsed_time_of_matmul_exceeds_small_add():
    x = torch.randn(2048, 2048, device="kiln")
    small = torch.ones(16, device="kiln")
    torch.kiln.synchronize()
    events = [torch.kiln.Event(enable_timing=True) for _ in range(4)]
    events[0].record()
    y = x @ x
    events[1].record()
    events[2].record()
    z = small + 1
    events[3].record()
    events[3].synchronize()
    matmul_ms = events[0].elapsed_time(events[1])
    add_ms = events[2].elapsed_time(events[3])
    assert add_ms >= 0
    assert matmul_ms > 0 and matmul_ms > add_ms
    del y, z


def test_generic_torch_event_timing():
    a = torch.Event(device="kiln", enable_timing=True)
    b = torch.Event(device="kiln", enable_timing=True)
    a.record()
    torch.kiln._sleep(20)
    b.record()
    b.synchronize()
    assert a.elapsed_time(b) >= 19.0


def test_event_recorded_on_a_orders_work_on_b():
    a, b = torch.kiln.Stream(), torch.kiln.Stream()
    data = torch.zeros(1 << 16, device="kiln")
    torch.kiln.synchronize()
    done = torch.kiln.Event()
    with torch.kiln.stream(a):
        torch.kiln._sleep(100)
        data.add_(3.0)
        done.record()
    b.wait_event(done)
    with torch.kiln.stream(b):
        result = data * 2
        assert result.sum().item() == 6.0 * (1 << 16)


def test_event_wait_across_devices():
    src = torch.kiln.Stream("kiln:1")
    data = torch.zeros(1000, device="kiln:1")
    torch.kiln.synchronize(1)
    ready = torch.kiln.Event()
    with torch.kiln.stream(src):
        torch.kiln._sleep(100)
        data.fill_(5.0)
        ready.record(src)
    ready.wait(torch.kiln.current_stream(0))
    assert data.to("kiln:0").sum().item() == 5000.0


def test_query_and_synchronize():
    e = torch.kiln.Event()
    assert e.query()  # never recorded
    torch.kiln._sleep(150)
    e.record()
    assert not e.query()
    e.synchronize()
    assert e.query()


def test_elapsed_time_needs_timing_enabled():
    a, b = torch.kiln.Event(), torch.kiln.Event()
    a.record()
    b.record()
    b.synchronize()
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        a.elapsed_time(b)


def test_elapsed_time_needs_events_on_one_device():
    timed = torch.kiln.Event(enable_timing=True)
    timed.record()
    with torch.kiln.device(1):
        other = torch.kiln.Event(enable_timing=True)
        other.record()
    other.synchronize()
    with pytest.raises(RuntimeError, match="same device"):
        timed.elapsed_time(other)


def test_elapsed_time_names_the_event_that_was_never_recorded():
    start, end = torch.kiln.Event(enable_timing=True), torch.kiln.Event(enable_timing=True)
    start.record()
    with pytest.raises(RuntimeError, match=r"^Both events must be recorded before calculating "
                       r"elapsed time; the end event was never recorded"):
        start.elapsed_time(end)  # not "must be on the same device"
    with pytest.raises(RuntimeError, match="the start event was never recorded"):
        end.elapsed_time(start)
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0


def test_interprocess_events_are_rejected():
    with pytest.raises(RuntimeError, match="interprocess"):
        torch.kiln.Event(interprocess=True)

