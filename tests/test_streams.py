"""Streams: the torch.kiln stream API (mirroring torch.cuda), the generic
torch.Stream, and CUDA's ordering semantics, checked by values."""

import pytest
import torch

from conftest import assert_same


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
