"""Events: record, wait, query, synchronize and elapsed_time, across streams
and devices."""

import re

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



@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("side", [False, True])
def test_stream_record_event_takes_a_kiln_event(device, side):
    """CUDA's timing idiom, `s.record_event(torch.cuda.Event(enable_timing=
    True))`, raised "expected event to be a torch.Event object" on kiln
    (torch.Stream's C++ method takes only exact torch.Event objects); the
    kiln stream's record_event, wait_event and wait_stream are Python, as
    torch.cuda.Stream's are (found by a fresh user)."""
    with torch.kiln.device(device):
        stream = torch.kiln.Stream() if side else torch.kiln.current_stream()
        start = stream.record_event(torch.kiln.Event(enable_timing=True))
        assert isinstance(start, torch.kiln.Event)
        with torch.kiln.stream(stream):
            torch.kiln._sleep(20)
        end = stream.record_event(torch.kiln.Event(enable_timing=True))
        plain_end = torch.Event(device=device, enable_timing=True)
        assert stream.record_event(plain_end) is plain_end
        new = stream.record_event()
        assert type(new) is torch.kiln.Event and new.device == torch.device(device)
        torch.kiln.current_stream().wait_event(end)
        torch.kiln.current_stream().wait_stream(stream)
        end.synchronize()
        plain_end.synchronize()
        assert start.elapsed_time(end) >= 19.0
        assert start.elapsed_time(plain_end) >= 19.0  # a torch.Event as the end event


def test_stream_and_event_methods_reject_what_is_not_a_stream_or_event():
    stream, event = torch.kiln.Stream(), torch.kiln.Event(enable_timing=True)
    cases = [(lambda: stream.wait_stream(3), "Stream.wait_stream() expected a torch.kiln.Stream or "
              "torch.Stream, but got int: 3"),
             (lambda: stream.wait_stream(None), "but got NoneType"),
             (lambda: stream.wait_event("x"), "Stream.wait_event() expected a torch.kiln.Event or "
              "torch.Event, but got str"),
             (lambda: stream.record_event(5), "Stream.record_event() expected a torch.kiln.Event"),
             (lambda: event.record(5), "Event.record() expected a torch.kiln.Stream or "
              "torch.Stream (or None), but got int: 5"),
             (lambda: event.wait(3), "Event.wait() expected a torch.kiln.Stream"),
             (lambda: event.elapsed_time(3), "Event.elapsed_time() expected a torch.kiln.Event")]
    for call, message in cases:
        with pytest.raises(TypeError, match=re.escape(message)):
            call()
    cpu_event = torch.Event(device="cpu")
    with pytest.raises(ValueError, match="expected a kiln event, got an event on cpu"):
        stream.wait_event(cpu_event)
    untimed = torch.Event(device="kiln")
    event.record()
    untimed.record()
    untimed.synchronize()
    with pytest.raises(RuntimeError, match=r"^Both events must be created with argument "
                       r"'enable_timing=True'\.$"):
        event.elapsed_time(untimed)
