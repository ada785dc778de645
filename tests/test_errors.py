"""Bad input gets PyTorch's standard errors, never an internal assert."""

import re

import pytest
import torch

from conftest import assert_same


def test_mixing_cpu_and_kiln_tensors():
    k = torch.ones(3, device="kiln")
    c = torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device") as info:
        k + c
    assert "INTERNAL ASSERT" not in str(info.value)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.mm(k.reshape(1, 3), c.reshape(3, 1))
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        c + k


def test_mixing_kiln_devices():
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(3, device="kiln:0") + torch.ones(3, device="kiln:1")


def test_zero_dim_cpu_tensors_act_as_scalars():
    k = torch.arange(3.0, device="kiln")
    assert_same(k * torch.tensor(2.0), torch.arange(3.0) * 2)
    assert_same(k + torch.tensor(1, dtype=torch.int64), torch.arange(3.0) + 1)
    assert_same(torch.tensor(2.0) * k, torch.arange(3.0) * 2)
    assert (k * torch.tensor(2.0)).device.type == "kiln"


def test_kernel_warnings_become_python_warnings():
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.ones(1, device="kiln").std()
        torch.kiln.synchronize()
    assert any("degrees of freedom" in str(w.message) for w in caught)


def test_kiln_generator_with_cpu_tensors_is_named():
    with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator but found 'kiln'"):
        torch.randn(3, generator=torch.Generator(device="kiln"))


def test_reading_past_a_shrunk_storage_is_a_clear_error():
    x = torch.ones(2, device="kiln")
    x.untyped_storage().resize_(4)
    with pytest.raises(RuntimeError, match="extend past its storage"):
        x.cpu()


@pytest.mark.parametrize("reduction", [
    lambda e: torch.max(e),
    lambda e: torch.aminmax(e),
    lambda e: torch.linalg.vector_norm(e, ord=float("inf")),
])
def test_reduction_of_an_empty_tensor_raises_at_the_call_without_a_sync(reduction):
    empty = torch.empty(0, device="kiln")
    torch.kiln.synchronize()
    torch.kiln.clear_op_tracking()
    with pytest.raises(RuntimeError) as on_kiln:
        reduction(empty)
    with pytest.raises(RuntimeError) as on_cpu:
        reduction(torch.empty(0))
    assert str(on_kiln.value) == str(on_cpu.value)
    assert torch.kiln.get_sync_ops() == {}


_SAME_BAD_INDEX_TWICE = """
import json, torch
x = torch.arange(4.0, device='kiln')
bad = torch.tensor([0, 9], device='kiln')
seen = []
def attempt():
    where = 'call'
    try:
        torch.index_select(x, 0, bad)
        where = 'synchronize'
        torch.kiln.synchronize()
        seen.append(['none', '', ''])
    except Exception as e:
        seen.append([where, type(e).__name__, str(e)])
attempt()  # the first call of its kind: run at once (a layout check)
torch.index_select(x, 0, torch.tensor([1], device='kiln'))  # a good one: later calls are asynchronous
torch.kiln.synchronize()
attempt()
try:
    torch.index_select(x.cpu(), 0, bad.cpu())
except Exception as e:
    seen.append(['cpu', type(e).__name__, str(e)])
print(json.dumps(seen))
"""


@pytest.mark.parametrize("launch_blocking", ["0", "1"])
def test_a_bad_index_raises_the_same_error_at_the_first_call_and_at_synchronization(launch_blocking):
    import json
    from conftest import run_python
    result = run_python(_SAME_BAD_INDEX_TWICE, {"KILN_LAUNCH_BLOCKING": launch_blocking})
    assert result.returncode == 0, result.stderr
    (first_where, first_type, first), (later_where, later_type, later), (_, cpu_type, cpu) = \
        json.loads(result.stdout)
    assert first_where == "call"  # the synchronous layout check
    assert later_where == ("call" if launch_blocking == "1" else "synchronize")
    assert first_type == later_type == cpu_type == "IndexError"
    assert first == later  # same type and message whichever way the kernel ran
    assert "aten::index_select: inputs (Float[4], Long[2])" in first and cpu in first


@pytest.mark.parametrize("op", [
    lambda d: torch.ones(3, 3, dtype=torch.bool, device=d) @ torch.ones(3, 3, dtype=torch.bool, device=d),
    lambda d: torch.ones(3, device=d).bitwise_and(torch.ones(3, device=d)),
    lambda d: torch.zeros(3, dtype=torch.int64, device=d).normal_(),
    lambda d: torch.ones(2, 3, dtype=torch.int64, device=d).softmax(-1),
    lambda d: torch.zeros(4, device=d).to(torch.bits8),  # a conversion copy_ lacks
    # A plain RuntimeError, and PyTorch's meta kernel of the out= form lacks
    # the check (the functional and in-place forms had it already).
    lambda d: torch.sub(torch.ones(33, device=d), True, out=torch.zeros(33, device=d)),
    # Ops with a dtype= argument (an int in the schema) are probed too.
    lambda d: torch.cumsum(torch.ones(3, dtype=torch.bool, device=d), 0,
                           out=torch.empty(3, dtype=torch.bool, device=d)),
    lambda d: torch.ones(2, 3, dtype=torch.bool, device=d).cumprod(1, dtype=torch.bool),
], ids=["bool_matmul", "float_bitwise_and", "int_normal_", "int_softmax", "float_to_bits8",
        "sub_bool_scalar_out", "bool_cumsum_out", "bool_cumprod_dtype"])
def test_an_unsupported_dtype_raises_cpu_error_at_the_call(op):
    with pytest.raises(Exception) as on_cpu:
        op("cpu")
    torch.kiln.synchronize()
    for _ in range(2):  # the first call of its kind and a later one
        before = torch.arange(3.0, device="kiln") * 2  # queued ahead of the bad op
        with pytest.raises(type(on_cpu.value)) as on_kiln:
            op("kiln")
        assert str(on_kiln.value) == str(on_cpu.value)  # e.g. "... not implemented for 'Bool'"
        torch.kiln.synchronize()  # nothing left to raise; earlier work was not skipped
        assert before.tolist() == [0.0, 2.0, 4.0]



@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_an_unsupported_dtype_with_the_input_as_its_out_keeps_the_input(device):
    """cumsum(x, 0, out=x): a full overlap CPU's kernel accepts for int32
    (learned once per op and argument) must not let a bool x through to the
    device, where the kernel's dtype error came at synchronization and x
    read as never computed."""
    for dtype in (torch.int32, torch.bool):  # int32 first: the full overlap is learned
        x = torch.tensor([1, 0, 1], dtype=dtype, device=device)
        on_cpu = torch.tensor([1, 0, 1], dtype=dtype)
        try:
            expected = torch.cumsum(on_cpu, 0, out=on_cpu).tolist()
        except NotImplementedError as e:
            with pytest.raises(NotImplementedError, match=str(e)):
                torch.cumsum(x, 0, out=x)
        else:
            assert torch.cumsum(x, 0, out=x) is x
        torch.kiln.synchronize()  # nothing left to raise
        assert x.tolist() == (expected if dtype == torch.int32 else [True, False, True])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_strided_nested_tensors_on_kiln_move_back_and_refuse_ops_clearly(device):
    parts = [torch.arange(6.0).view(2, 3), torch.arange(12.0).view(4, 3)]
    nt = torch.nested.nested_tensor(parts, device=device)  # made by PyTorch's own copy
    assert nt.is_nested and nt.device == torch.device(device)
    back = nt.cpu()  # what the user had is not lost
    assert [t.tolist() for t in back.unbind()] == [p.tolist() for p in parts]
    as_double = nt.to(torch.float64)
    assert as_double.device == torch.device(device) and as_double.dtype == torch.float64
    assert [t.tolist() for t in as_double.cpu().unbind()] == [p.tolist() for p in parts]
    for op, name in ((lambda: nt * 2, "aten::mul.Tensor"), (lambda: str(nt), "aten::unbind.int"),
                     (lambda: nt.sum(), "aten::sum"),
                     # composite on kiln (nested kernels on CPU and CUDA only): they read
                     # sizes() and raised "NestedTensorImpl doesn't support sizes"
                     (lambda: torch.nn.functional.linear(nt, torch.ones(2, 3, device=device)),
                      "aten::linear"),
                     (lambda: torch.matmul(nt, torch.ones(3, 2, device=device)), "aten::matmul"),
                     (lambda: torch.matmul(nt, torch.ones(3, 2, device=device),
                                           out=torch.empty(0, device=device)),
                      "aten::matmul.out")):
        with pytest.raises(NotImplementedError) as info:
            op()
        message = str(info.value)
        assert message.startswith(f"Kiln does not support strided nested tensors: {name}")
        assert "layout=torch.jagged" in message and "Could not run" not in message
    jagged = torch.nested.nested_tensor(parts, layout=torch.jagged, device=device)  # the way out
    assert (jagged * 2).values().cpu().tolist() == (torch.cat(parts) * 2).tolist()


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions.*deprecated")
@pytest.mark.parametrize("make, what", [
    (lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8).to("kiln"),
     r"aten::empty_quantized was asked for a torch\.qint8 tensor \(per_tensor_affine\)"),
    (lambda: torch.quantize_per_channel(torch.randn(4, 2), torch.full((4,), 0.1),
                                        torch.zeros(4, dtype=torch.long), 0, torch.quint8).kiln(),
     r"torch\.quint8 tensor \(per_channel_affine\)"),
    (lambda: torch.quantize_per_tensor(torch.randn(4, device="kiln"), 0.1, 0, torch.qint8),
     r"aten::quantize_per_tensor was asked for a torch\.qint8 tensor"),
    (lambda: torch.empty(3, dtype=torch.qint32, device="kiln"), r"torch\.qint32 tensor"),
], ids=["to_kiln", "per_channel", "quantize_on_kiln", "empty"])
def test_quantized_tensors_on_kiln_raise_a_clear_error_at_the_call(make, what):
    with pytest.raises(NotImplementedError) as info:
        make()
    message = str(info.value)
    assert message.startswith("Kiln does not support quantized tensors: ")
    assert re.search(what + " on a kiln device", message)
    assert "t.dequantize()" in message and "on the CPU" in message  # what to do instead
    assert "Could not run" not in message
    dequantized = torch.quantize_per_tensor(torch.arange(4.0), 0.5, 0, torch.qint8).dequantize()
    assert_same(dequantized.to("kiln"), dequantized)  # the workaround works
