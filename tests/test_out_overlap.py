"""out= arguments that share memory with an input (Note [Out= arguments that
overlap inputs] in KilnOpExecutor.cc): CPU's kernels reject partial overlap,
overlap within the out= tensor, and (for non-elementwise ops) any overlap,
at the call. Kiln must raise the same error at the call and keep the user's
tensor readable; where CPU accepts the aliasing, kiln computes CPU's values.
"""

import pytest
import torch

from conftest import assert_same

DEVICES = ["kiln:0", "kiln:1"]

# Each case writes through out= into views of one tensor `x` (arange(6.)).
REJECTED = {
    "partial overlap, elementwise": lambda x: torch.mul(x[:-1], 2, out=x[1:]),
    "partial overlap, scan": lambda x: torch.cumsum(x[:-1], 0, out=x[1:]),
    "expanded out=": lambda x: torch.add(x[:3], 1, out=x[1:2].expand(3)),
    "full overlap, index_select": lambda x: torch.index_select(
        x[:3], 0, torch.tensor([1, 0, 2], device=x.device), out=x[:3]),
    "partial overlap, cat": lambda x: torch.cat([x[:2], x[:2]], out=x[:4]),
    # out= overlaps its input only once resized (found by a helper)
    "overlap after the resize, cat": lambda x: torch.cat([x[3:5], x[5:6]], out=x[2:3]),
}

ACCEPTED = {
    "full overlap, elementwise": lambda x: torch.add(x, 1, out=x),
    "full overlap, two inputs": lambda x: torch.addcmul(x, x, x, value=0.5, out=x),
    "full overlap, where": lambda x: torch.where(x > 2, x, -x, out=x),
    "full overlap, mm": lambda x: torch.mm(x[:4].view(2, 2), x[:4].view(2, 2),
                                           out=x[:4].view(2, 2)),
    "disjoint views of one tensor": lambda x: torch.mul(x[:3], 2, out=x[3:]),
    # Accepted by CPU because its checks run before the resize; a full or no
    # overlap before the resize, a partial one after it. These run
    # synchronously (the resize changes the overlap).
    "overlap after the resize, add": lambda x: torch.add(x[2:4], 1, out=x[1:2]),
    "full overlap then resized, add": lambda x: torch.add(
        x[:2], torch.ones(2, 2, device=x.device), out=x[:2]),
    # The resize outgrows x's storage: the storage grows first, contents
    # kept, as CPU's resize_ grows it (found by a helper: kiln raised "Trying
    # to resize storage that is not resizable" where CPU succeeds).
    "full overlap, resize grows the storage, add": lambda x: torch.add(
        x[:], torch.ones(6, 1, device=x.device), out=x),
    "full overlap, resize grows the storage, mm": lambda x: torch.mm(
        x.view(2, 3), torch.ones(3, 4, device=x.device), out=x),
    "dtype view, resize grows the storage, polar": lambda x: torch.polar(
        torch.ones(6, device=x.device), x, out=x.view(torch.complex64)),
    "full overlap, sort values": lambda x: torch.sort(
        x.flip(0).contiguous(), out=(x, torch.empty(6, dtype=torch.long, device=x.device))),
}


def _cpu_error(case):
    with pytest.raises(RuntimeError) as info:
        case(torch.arange(6.0))
    return str(info.value)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("side_stream", [False, True], ids=["default_stream", "side_stream"])
@pytest.mark.parametrize("name", list(REJECTED))
def test_rejected_overlap_raises_cpus_error_at_the_call_and_keeps_the_tensor(
        device, side_stream, name):
    case = REJECTED[name]
    expected = _cpu_error(case)
    x = torch.arange(6.0, device=device)
    stream = torch.kiln.Stream(device=device) if side_stream else None
    with torch.kiln.stream(stream) if stream is not None else torch.kiln.device(device):
        if stream is not None:
            stream.wait_stream(torch.kiln.default_stream(device))
        with pytest.raises(RuntimeError) as info:
            case(x)
    assert str(info.value) == expected  # CPU's message, unchanged, at the call
    torch.kiln.synchronize(device)      # nothing left to fail later
    assert_same(x, torch.arange(6.0))   # and x is intact and readable
    assert_same(x + 1, torch.arange(6.0) + 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(ACCEPTED))
def test_accepted_overlap_computes_cpus_values(device, name):
    case = ACCEPTED[name]
    expected = torch.arange(6.0)
    case(expected)
    for _ in range(2):  # the first call learns; the second takes the asynchronous path
        x = torch.arange(6.0, device=device)
        case(x)
        assert_same(x, expected)


@pytest.mark.parametrize("name", [n for n in ACCEPTED if "resize" not in n])
def test_accepted_overlap_never_synchronizes(name):
    # The op's verdict comes from CPU's kernel on tiny images, not from a
    # synchronous run of the real call. An op's first call in the process may
    # still run kiln's one-time layout check ("<op> (layout check)"; e.g. the
    # flip that prepares the sort case, when no earlier test on this worker
    # flipped): that is not the overlap verdict, which would show as the op.
    x = torch.arange(6.0, device="kiln")
    torch.kiln.synchronize()
    torch.kiln.clear_op_tracking()
    for _ in range(3):
        ACCEPTED[name](x)
    syncs = {op: n for op, n in torch.kiln.get_sync_ops().items()
             if not op.endswith(" (layout check)")}
    assert syncs == {}


def test_accepted_overlap_is_captured_in_a_kiln_graph():
    x = torch.arange(6.0, device="kiln")
    g = torch.kiln.KilnGraph()
    s = torch.kiln.Stream()
    s.wait_stream(torch.kiln.current_stream())
    with torch.kiln.stream(s):
        with torch.kiln.graph(g):
            torch.addcmul(x, x, x, value=0.25, out=x)
    torch.kiln.current_stream().wait_stream(s)
    expected = torch.arange(6.0)
    for _ in range(3):
        g.replay()
        torch.addcmul(expected, expected, expected, value=0.25, out=expected)
        assert_same(x, expected)


def test_rejected_full_overlap_is_not_learned():
    x = torch.arange(6.0, device="kiln")
    idx = torch.tensor([1, 0, 2], device="kiln")
    for _ in range(3):
        with pytest.raises(RuntimeError, match="unsupported operation"):
            torch.index_select(x[:3], 0, idx, out=x[:3])
    assert_same(x, torch.arange(6.0))


def test_out_overlap_errors_inside_a_failed_call_lose_nothing_queued():
    # Work queued before the rejected call still runs and stays readable.
    x = torch.arange(6.0, device="kiln")
    y = x * 3
    with pytest.raises(RuntimeError, match="unsupported operation"):
        torch.mul(x[:-1], 2, out=x[1:])
    assert_same(y, torch.arange(6.0) * 3)


def test_resizing_an_out_that_is_an_input_raises_at_the_call_and_keeps_it():
    x = torch.arange(2.0, device="kiln")
    torch.add(x, 1, out=x)  # the op learns that out=x is accepted
    on_cpu = torch.arange(2.0)
    with pytest.raises(RuntimeError) as cpu_error:
        torch.add(on_cpu, torch.ones(2, 1), out=on_cpu)
    for _ in range(2):  # also once the op's layouts are cached
        with pytest.raises(RuntimeError) as kiln_error:
            torch.add(x, torch.ones(2, 1, device="kiln"), out=x)
        assert str(kiln_error.value) == str(cpu_error.value)  # x is the same tensor twice
    torch.kiln.synchronize()
    assert_same(x, torch.arange(2.0) + 1)
