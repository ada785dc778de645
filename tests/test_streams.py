"""Streams: the torch.kiln stream API (mirroring torch.cuda), the generic
torch.Stream, and CUDA's ordering semantics, checked by values."""

import pytest
import torch

from conftest import KILN_ERROR_NOT_READY, assert_same, create_runtime_stream, kiln_runtime


def test_stream_objects_and_current_stream():
    default = torch.kiln.default_stream()
    assert torch.kiln.current_stream() == default and default.stream_id == 0
    s = torch.kiln.Stream()
    assert s.device == torch.device("kiln:0") and s != default
    assert isinstance(s, torch.Stream)
    with torch.kiln.stream(s):
        assert torch.kiln.current_stream() == s
        assert torch.accelerator.current_stream() == s
    assert torch.kiln.current_stream() == default
    with s:  # torch.Stream's own context manager
        assert torch.kiln.current_stream() == s
    torch.kiln.set_stream(s)
    assert torch.kiln.current_stream() == s
    torch.kiln.set_stream(default)
    assert torch.kiln.current_stream() == default


@pytest.mark.parametrize("not_a_stream", [123, "kiln:0", torch.device("kiln")])
def test_set_stream_of_something_else_is_a_type_error(not_a_stream):
    before = torch.kiln.current_stream()
    with pytest.raises(TypeError, match=r"expected a torch.kiln.Stream or torch.Stream.*but got "
                       + type(not_a_stream).__name__):
        torch.kiln.set_stream(not_a_stream)
    with pytest.raises(TypeError, match="expected a torch.kiln.Stream or torch.Stream"):
        torch.kiln.stream(not_a_stream)
    assert torch.kiln.current_stream() == before


def test_generic_torch_stream():
    s = torch.Stream(device="kiln")
    assert s.device_type == torch.kiln.current_stream().device_type
    x = torch.ones(1000, device="kiln")
    s.wait_stream(torch.kiln.current_stream())  # x is written on the default stream
    with s:
        y = x * 2
    s.synchronize()
    assert s.query()
    assert y.sum().item() == 2000.0


def test_priorities():
    high = torch.kiln.Stream(priority=-1)
    normal = torch.kiln.Stream(priority=0)
    assert high.priority == -1 and normal.priority == 0
    assert torch.kiln.Stream.priority_range() == (0, -1)


def test_stream_on_other_device_switches_device_inside_context():
    s1 = torch.kiln.Stream("kiln:1")
    with torch.kiln.stream(s1):
        assert torch.kiln.current_device() == 1
        assert torch.ones(1, device="kiln").device == torch.device("kiln:1")
        assert torch.kiln.current_stream() == s1
    assert torch.kiln.current_device() == 0
    assert torch.kiln.current_stream(1) == torch.kiln.default_stream(1)


def test_query_and_synchronize_follow_pending_work():
    s = torch.kiln.Stream()
    with torch.kiln.stream(s):
        torch.kiln._sleep(200)
    assert not s.query()
    s.synchronize()
    assert s.query()


def test_wait_stream_orders_work_by_values():
    src = torch.kiln.Stream()
    dst = torch.kiln.Stream()
    data = torch.zeros(1 << 16, device="kiln")
    torch.kiln.synchronize()
    with torch.kiln.stream(src):
        torch.kiln._sleep(100)
        data.fill_(7.0)
    dst.wait_stream(src)
    with torch.kiln.stream(dst):
        total = data.sum()
        assert total.item() == 7.0 * (1 << 16)  # item() waits for dst


def test_without_wait_the_streams_are_unordered():
    # The same program without wait_stream reads the old values: streams
    # really are independent queues.
    src = torch.kiln.Stream()
    dst = torch.kiln.Stream()
    data = torch.zeros(1 << 16, device="kiln")
    torch.kiln.synchronize()
    with torch.kiln.stream(src):
        torch.kiln._sleep(300)
        data.fill_(7.0)
    with torch.kiln.stream(dst):
        total = data.sum()
        assert total.item() == 0.0  # item() waits for dst only
    torch.kiln.synchronize()


def test_launch_blocking_runs_work_at_the_call():
    from conftest import run_python
    code = (
        "import torch, time\n"
        "t = time.perf_counter(); torch.kiln._sleep(300); elapsed = time.perf_counter() - t\n"
        "x = torch.arange(4.0, device='kiln')\n"
        "torch.index_select(x, 0, torch.tensor([1], device='kiln'))  # first call: a layout check\n"
        "try:\n"
        "    torch.index_select(x, 0, torch.tensor([0, 9], device='kiln'))\n"
        "    print('not raised')\n"
        "except IndexError as e:  # raised by the call itself, with CPU's type\n"
        "    print('raised at call', 'out of range' in str(e))\n"
        "print(elapsed >= 0.3, torch._C._get_privateuse1_backend_name())\n"
    )
    result = run_python(code, {"KILN_LAUNCH_BLOCKING": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["raised", "at", "call", "True", "True", "kiln"]


# --- torch.kiln.ExternalStream: runtime streams created outside PyTorch ------
# (runtime_stream, a conftest fixture, makes kilnStream_t handles as another
# library would.)

@pytest.mark.parametrize("device", [0, 1])
def test_external_stream_runs_kiln_work_on_the_runtime_stream(device, runtime_stream):
    handle = runtime_stream(device)
    ext = torch.kiln.ExternalStream(handle)
    assert isinstance(ext, torch.kiln.Stream) and isinstance(ext, torch.Stream)
    assert ext.device == torch.device(f"kiln:{device}")
    assert ext.kiln_stream == handle and ext.stream_id == handle
    assert ext.priority == 0
    x_cpu = torch.randn(1000)
    x = x_cpu.to(f"kiln:{device}")
    ext.wait_stream(torch.kiln.current_stream(device))
    with torch.kiln.stream(ext):
        assert torch.kiln.current_stream() == ext and torch.kiln.current_device() == device
        torch.kiln._sleep(300)
        y = x * 3 + 1
    torch.kiln.default_stream(device).synchronize()  # not behind the work queued above...
    lib = kiln_runtime()
    assert lib.kilnStreamQuery(handle) == KILN_ERROR_NOT_READY  # ...which is on that stream
    assert not ext.query()
    assert lib.kilnStreamSynchronize(handle) == 0
    assert ext.query()
    assert_same(y, x_cpu * 3 + 1)
    assert torch.kiln.current_stream(device) == torch.kiln.default_stream(device)


def test_external_stream_is_ordered_by_events_and_wait_stream(runtime_stream):
    ext = torch.kiln.ExternalStream(runtime_stream(0))
    data = torch.zeros(1 << 16, device="kiln")
    ext.wait_stream(torch.kiln.current_stream())
    with torch.kiln.stream(ext):
        torch.kiln._sleep(100)
        data.fill_(7.0)
        done = torch.kiln.Event()
        done.record()
    torch.kiln.current_stream().wait_event(done)
    assert data.sum().item() == 7.0 * (1 << 16)


def test_external_stream_device_argument(runtime_stream):
    handle = runtime_stream(1)
    assert torch.kiln.ExternalStream(handle, device=1).device == torch.device("kiln:1")
    assert torch.kiln.ExternalStream(handle, device="kiln:1").device_index == 1
    with pytest.raises(ValueError, match="belongs to kiln:1, not kiln:0"):
        torch.kiln.ExternalStream(handle, device=0)
    with pytest.raises(RuntimeError, match="Kiln has 2 devices"):
        torch.kiln.ExternalStream(handle, device=7)
    with pytest.raises(ValueError, match="Expected a kiln device"):
        torch.kiln.ExternalStream(handle, device="cuda:0")


def test_external_stream_priority(runtime_stream):
    assert torch.kiln.ExternalStream(runtime_stream(0, priority=-1)).priority == -1


def test_external_stream_of_a_kiln_stream_handle_is_that_stream():
    for device in (0, 1):
        side = torch.kiln.Stream(device)
        assert torch.kiln.ExternalStream(side.kiln_stream) == side
        default = torch.kiln.default_stream(device)
        assert torch.kiln.ExternalStream(default.kiln_stream) == default
    assert torch.kiln.ExternalStream(0) == torch.kiln.default_stream()  # NULL, as in the runtime
    with torch.kiln.device(1):
        assert torch.kiln.ExternalStream(0) == torch.kiln.default_stream(1)


@pytest.mark.parametrize("bad", [5, 12345, 0xDEADBEEF000, (1 << 64) - 8])
def test_external_stream_rejects_unknown_handles(bad):
    with pytest.raises(ValueError, match="is not a live kiln runtime stream"):
        torch.kiln.ExternalStream(bad)


@pytest.mark.parametrize("bad, error", [("0x1234", TypeError), (1.5, TypeError), (None, TypeError),
                                        (True, TypeError), (-8, ValueError), (1 << 64, ValueError)])
def test_external_stream_rejects_non_handles(bad, error):
    with pytest.raises(error, match="stream_ptr must be an int|not a kiln runtime stream handle"):
        torch.kiln.ExternalStream(bad)


def test_destroyed_external_stream_fails_cleanly_and_kiln_keeps_working():
    handle = create_runtime_stream(0)
    ext = torch.kiln.ExternalStream(handle)
    with torch.kiln.stream(ext):
        x = torch.ones(1000, device="kiln")
    x.record_stream(torch.kiln.default_stream())
    y = torch.ones(1000, device="kiln")
    y.record_stream(ext)  # freed after its stream is gone: nothing left to wait for
    ext.synchronize()
    assert kiln_runtime().kilnStreamDestroy(handle) == 0
    del y
    with pytest.raises(ValueError, match="is not a live kiln runtime stream"):
        torch.kiln.ExternalStream(handle)
    with pytest.raises(RuntimeError, match="destroyed"):
        with torch.kiln.stream(ext):
            torch.ones(4, device="kiln") + 1
    with pytest.raises(RuntimeError, match="destroyed"):
        ext.synchronize()
    assert x.sum().item() == 1000.0  # memory written on the stream before it went
    del x
    assert (torch.arange(4, device="kiln") * 2).tolist() == [0, 2, 4, 6]


def test_allocations_on_an_external_stream_are_reused_on_it(runtime_stream):
    ext = torch.kiln.ExternalStream(runtime_stream(0))
    with torch.kiln.stream(ext):
        a = torch.empty(1 << 20, device="kiln")
        address = a.data_ptr()
        del a
        b = torch.empty(1 << 20, device="kiln")  # same stream: the freed block at once
        assert b.data_ptr() == address
    c = torch.empty(1 << 20, device="kiln")  # default stream: not the external stream's block
    assert c.data_ptr() != b.data_ptr()
    del b
