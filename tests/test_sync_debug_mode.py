"""torch.kiln.set_sync_debug_mode: in "warn" mode an operation that makes the
host wait for the device warns, in "error" mode it raises, naming the op, as
torch.cuda.set_sync_debug_mode; what is not covered; bad modes."""

import warnings

import pytest
import torch

from conftest import assert_same, run_python


@pytest.fixture(autouse=True)
def default_mode_after():
    yield
    torch.kiln.set_sync_debug_mode("default")


def no_sync_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    assert [str(w.message) for w in caught if "synchronizing kiln" in str(w.message)] == []
    return result


def warm_up(device):
    """First calls may run kiln's one-time layout checks; run them first."""
    x = torch.arange(10, device=device)
    torch.nonzero(x > 4)
    x.sum().item()
    x.cpu()
    torch.ones(3).to(device)
    torch.kiln.synchronize(device)


def test_modes_by_name_and_number():
    assert torch.kiln.get_sync_debug_mode() == 0
    for name, number in (("warn", 1), ("error", 2), ("default", 0)):
        torch.kiln.set_sync_debug_mode(name)
        assert torch.kiln.get_sync_debug_mode() == number
    for number in (2, 1, 0):
        torch.kiln.set_sync_debug_mode(number)
        assert torch.kiln.get_sync_debug_mode() == number


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("side_stream", [False, True])
def test_warn_mode_names_each_synchronizing_op(device, side_stream):
    warm_up(device)
    stream = torch.kiln.Stream(device) if side_stream else torch.kiln.current_stream(device)
    with torch.kiln.stream(stream):
        x = torch.arange(10, device=device)
        torch.kiln.set_sync_debug_mode("warn")
        with pytest.warns(UserWarning, match="synchronizing kiln operation: aten::nonzero"):
            nz = torch.nonzero(x > 4)
        with pytest.warns(UserWarning, match="synchronizing kiln operation: aten::_local_scalar_dense"):
            total = x.sum().item()
        with pytest.warns(UserWarning, match="synchronizing kiln operation: aten::_copy_from"):
            host = x.cpu()
        with pytest.warns(UserWarning, match="synchronizing kiln operation: aten::_copy_from"):
            torch.ones(3).to(device)  # a blocking copy from pageable memory waits too
    torch.kiln.set_sync_debug_mode("default")
    assert total == 45
    assert_same(nz, torch.nonzero(torch.arange(10) > 4))
    assert_same(host, torch.arange(10))


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_error_mode_raises_before_waiting_and_leaves_tensors_intact(device):
    warm_up(device)
    x = torch.arange(10, device=device)
    host = torch.full((10,), -1)
    torch.kiln.set_sync_debug_mode("error")
    with pytest.raises(RuntimeError, match="synchronizing kiln operation: aten::_local_scalar_dense"):
        x.sum().item()
    with pytest.raises(RuntimeError, match="set_sync_debug_mode\\(\"error\"\\) forbids that"):
        torch.nonzero(x > 4)
    with pytest.raises(RuntimeError, match="synchronizing kiln operation"):
        host.copy_(x)  # refused before the copy was queued: the host tensor is unchanged
    target = torch.zeros(10, dtype=torch.int64, device=device)
    with pytest.raises(RuntimeError, match="synchronizing kiln operation: aten::_copy_from"):
        target.copy_(torch.arange(10))
    # Asynchronous work is allowed.
    y = no_sync_warnings(lambda: (x * 2 + 1).relu())
    torch.kiln.set_sync_debug_mode("default")
    assert_same(host, torch.full((10,), -1))
    assert_same(target, torch.zeros(10, dtype=torch.int64))
    assert_same(y, (torch.arange(10) * 2 + 1).relu())
    assert x.sum().item() == 45


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_non_blocking_copies_to_pinned_memory_and_async_ops_do_not_warn(device):
    warm_up(device)
    x = torch.randn(64, device=device)
    pinned = torch.empty(64).pin_memory()
    (x * 2).sum()
    pinned.copy_(x, non_blocking=True)
    torch.kiln.synchronize(device)
    torch.kiln.set_sync_debug_mode("error")

    def work():
        y = (x * 2 + 1).sum(0)
        pinned.copy_(x, non_blocking=True)
        x.to(device, copy=True)
        return y

    y = no_sync_warnings(work)
    torch.kiln.set_sync_debug_mode("default")
    torch.kiln.synchronize(device)
    assert_same(pinned, x.cpu())
    assert_same(y, (x.cpu() * 2 + 1).sum(0))


@pytest.mark.parametrize("device", [0, 1])
def test_stream_synchronize_is_covered_and_device_synchronize_is_not(device):
    side = torch.kiln.Stream(device)
    with torch.kiln.stream(side):
        torch.ones(8, device=f"kiln:{device}").sum()
    torch.kiln.set_sync_debug_mode("warn")
    with pytest.warns(UserWarning, match=r"torch.kiln.Stream.synchronize\(\)"):
        side.synchronize()
    with pytest.warns(UserWarning, match=r"torch.kiln.Stream.synchronize\(\)"):
        torch.Stream(device="kiln:%d" % device).synchronize()
    torch.kiln.set_sync_debug_mode("error")
    with pytest.raises(RuntimeError, match=r"torch.kiln.Stream.synchronize\(\)"):
        torch.kiln.current_stream(device).synchronize()
    event = torch.kiln.Event()
    event.record(side)

    def explicit_waits():  # as on CUDA: explicit device and event waits are allowed
        torch.kiln.synchronize(device)
        torch.accelerator.synchronize(device)
        event.synchronize()

    no_sync_warnings(explicit_waits)


def test_layout_checks_are_not_reported():
    code = (
        "import warnings, torch\n"
        "x = torch.arange(6.0, device='kiln')\n"
        "torch.kiln.set_sync_debug_mode('error')\n"
        "y = torch.flip(x, (0,))  # first call: kiln checks the op's meta kernel once\n"
        "torch.kiln.set_sync_debug_mode('default')\n"
        "print([k for k in torch.kiln.get_sync_ops() if 'flip' in k], y.cpu().tolist())\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['aten::flip (layout check)'] [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]"


@pytest.mark.parametrize("mode, error, match", [
    ("loud", RuntimeError, "invalid value of debug_mode 'loud'"),
    ("WARN", RuntimeError, "expected one of `default`, `warn`, `error`"),
    (3, RuntimeError, "invalid value of debug_mode 3"),
    (-1, RuntimeError, "expected one of 0, 1, 2"),
    (1.0, TypeError, "debug_mode must be"),
    (None, TypeError, "debug_mode must be"),
    (True, TypeError, "debug_mode must be"),
])
def test_bad_modes_raise_and_keep_the_current_mode(mode, error, match):
    torch.kiln.set_sync_debug_mode("warn")
    with pytest.raises(error, match=match):
        torch.kiln.set_sync_debug_mode(mode)
    assert torch.kiln.get_sync_debug_mode() == 1


def test_binding_rejects_bad_numbers():
    from torch_kiln import _C
    with pytest.raises(ValueError, match="invalid sync debug mode 5"):
        _C._set_sync_debug_mode(5)
