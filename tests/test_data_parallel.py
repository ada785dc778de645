"""nn.DataParallel over kiln devices, and torch.nn.parallel.comm's
broadcast / broadcast_coalesced / scatter / gather on kiln tensors
(torch_kiln/kiln/_parallel_comm.py).

The reference for DataParallel is CPU running the same replicas by hand:
the batch split as DataParallel's scatter splits it, the module on each
chunk, the outputs concatenated; CPU autograd then sums the chunks'
parameter gradients as DataParallel's ReduceAddCoalesced does (a + b == b +
a in floating point), so losses, outputs and gradients match bit for bit.
"""

import copy
import warnings

import pytest
import torch
from conftest import assert_same
from torch.nn.parallel import comm


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _cpu_reference(model, x, chunks):
    return torch.cat([model(c) for c in x.chunk(chunks)])


@pytest.mark.parametrize("device_ids,output_device", [([0, 1], None), ([1, 0], 1), (None, 0)])
def test_data_parallel_training_matches_the_replicas_run_on_cpu(device_ids, output_device):
    cpu_model = _model()
    kiln_model = copy.deepcopy(cpu_model).to(f"kiln:{(device_ids or [0])[0]}")
    dp = torch.nn.DataParallel(kiln_model, device_ids=device_ids, output_device=output_device)
    assert dp.device_ids == (device_ids or [0, 1])
    opt_cpu = torch.optim.SGD(cpu_model.parameters(), lr=0.1)
    opt_kiln = torch.optim.SGD(kiln_model.parameters(), lr=0.1)
    torch.manual_seed(1)
    for step in range(3):
        x, y = torch.randn(10, 8), torch.randn(10, 4)
        expected = _cpu_reference(cpu_model, x, 2)
        loss_cpu = torch.nn.functional.mse_loss(expected, y)
        opt_cpu.zero_grad()
        loss_cpu.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # comm.reduce_add: "not compiled with NCCL"
            out = dp(x)  # a CPU batch: scattered to the kiln devices
            want = dp.output_device
            assert out.device == torch.device("kiln", want), (out.device, want)
            loss_kiln = torch.nn.functional.mse_loss(out, y.to(out.device))
            opt_kiln.zero_grad()
            loss_kiln.backward()
        assert_same(out, expected)
        assert_same(loss_kiln, loss_cpu)
        for p_cpu, p_kiln in zip(cpu_model.parameters(), kiln_model.parameters()):
            assert_same(p_kiln.grad, p_cpu.grad)
        opt_cpu.step()
        opt_kiln.step()
    for p_cpu, p_kiln in zip(cpu_model.parameters(), kiln_model.parameters()):
        assert_same(p_kiln, p_cpu)


def test_data_parallel_scatters_kwargs_and_nested_inputs_from_a_kiln_batch():
    class TwoInputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 3)

        def forward(self, pair, scale=None):
            a, b = pair
            return {"out": self.linear(a + b) * scale, "device": torch.tensor([a.get_device()], device=a.device)}

    torch.manual_seed(0)
    module = TwoInputs()
    a, b, scale = torch.randn(6, 4), torch.randn(6, 4), torch.randn(6, 1)
    dp = torch.nn.DataParallel(copy.deepcopy(module).to("kiln"), device_ids=[0, 1])
    result = dp((a.to("kiln"), b.to("kiln")), scale=scale.to("kiln"))
    expected = torch.cat([module((ca, cb), scale=cs)["out"]
                          for ca, cb, cs in zip(a.chunk(2), b.chunk(2), scale.chunk(2))])
    assert_same(result["out"], expected)
    assert result["device"].cpu().tolist() == [0, 1]  # each replica ran on its own device


def test_autocast_inside_the_module_forward_runs_in_every_replica():
    # (Autocast entered around the DataParallel call does not reach the
    # replicas' threads on kiln: PyTorch's parallel_apply reads
    # torch.is_autocast_enabled(), CUDA's state. README, known gaps.)
    class Autocast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 4)

        def forward(self, x):
            with torch.autocast(x.device.type, dtype=torch.bfloat16):
                return self.linear(x)

    torch.manual_seed(0)
    module = Autocast()
    x = torch.randn(6, 8)
    out = torch.nn.DataParallel(copy.deepcopy(module).to("kiln"), device_ids=[0, 1])(x)
    assert out.dtype == torch.bfloat16
    assert_same(out, torch.cat([module(c) for c in x.chunk(2)]))


def test_functional_data_parallel():
    model = _model()
    x = torch.randn(8, 8)
    out = torch.nn.parallel.data_parallel(copy.deepcopy(model).to("kiln"), x.to("kiln"),
                                          device_ids=[0, 1])
    assert_same(out, _cpu_reference(model, x, 2))


@pytest.mark.parametrize("source", ["kiln:0", "cpu"])
def test_broadcast(source):
    t = torch.arange(6.0).reshape(2, 3).to(source)
    copies = comm.broadcast(t, [0, 1])
    assert [c.device for c in copies] == [torch.device("kiln", 0), torch.device("kiln", 1)]
    if source != "cpu":
        assert copies[0] is t  # the source itself, as on CUDA
    for c in copies:
        assert_same(c, t.cpu())
    out = [torch.empty(2, 3, device="kiln:1"), torch.empty(2, 3, device="kiln:0")]
    comm.broadcast(t, out=out)
    for o in out:
        assert_same(o, t.cpu())


def test_broadcast_coalesced_keeps_the_order_of_mixed_dtypes_and_separate_versions():
    tensors = [torch.randn(3, device="kiln:0"), torch.arange(4, device="kiln:0"),
               torch.randn(2, 2, device="kiln:0"), torch.ones(5, dtype=torch.int32,
                                                              device="kiln:0")]
    outputs = comm.broadcast_coalesced(tensors, [0, 1], buffer_size=16)
    assert all(a is b for a, b in zip(outputs[0], tensors))
    for t, c in zip(tensors, outputs[1]):
        assert c.device == torch.device("kiln", 1)
        assert_same(c, t.cpu())
    before = outputs[1][2]._version
    outputs[1][0].add_(1)  # its own version counter, not its buffer-mates'
    assert outputs[1][2]._version == before


def test_scatter_with_chunk_sizes_and_streams_and_gather():
    x = torch.randn(7, 3)
    streams = [torch.kiln.Stream(1), torch.kiln.Stream(0)]  # one per target device
    chunks = comm.scatter(x.to("kiln:0"), [1, 0], chunk_sizes=[3, 4], streams=streams)
    assert [c.device for c in chunks] == [torch.device("kiln", 1), torch.device("kiln", 0)]
    streams[0].synchronize()
    streams[1].synchronize()
    assert_same(chunks[0], x[:3])
    assert_same(chunks[1], x[3:])
    assert_same(comm.gather(chunks, dim=0, destination=0), x)
    assert comm.gather(chunks, destination=1).device == torch.device("kiln", 1)
    on_cpu = comm.gather(chunks, destination="cpu")
    assert on_cpu.device.type == "cpu"
    assert_same(on_cpu, x)
    with pytest.warns(FutureWarning, match="Using -1 to represent CPU tensor is deprecated"):
        assert_same(comm.gather(chunks, destination=-1), x)
    outs = [torch.empty(2, 3, device="kiln:0"), torch.empty(5, 3, device="kiln:1")]
    comm.scatter(x, out=outs)
    assert_same(outs[0], x[:2])
    assert_same(outs[1], x[2:])
    into = torch.empty(7, 3, device="kiln:1")
    comm.gather(outs, out=into)
    assert_same(into, x)


def test_scatter_with_fewer_streams_than_devices_and_an_empty_chunk():
    # comm.cpp uses streams[i] only where given; a chunk of size 0 is allowed
    x = torch.randn(5, 3)
    stream = torch.kiln.Stream(0)
    chunks = comm.scatter(x, [0, 1], chunk_sizes=[5, 0], streams=[stream])
    stream.synchronize()
    assert [tuple(c.shape) for c in chunks] == [(5, 3), (0, 3)]
    assert_same(chunks[0], x)
    outs = [torch.empty(0, 3, device="kiln:0"), torch.empty(5, 3, device="kiln:1")]
    comm.scatter(x, out=outs, streams=[None])
    assert_same(outs[1], x)


def test_broadcast_coalesced_gives_a_tensor_given_twice_two_copies():
    a = torch.randn(3, device="kiln:0")
    copies = comm.broadcast_coalesced([a, a], [0, 1])[1]
    assert copies[0] is not copies[1]
    copies[0].add_(1)
    assert_same(copies[1], a.cpu())


def test_gather_along_dim_1():
    parts = [torch.randn(2, 3, device="kiln:0"), torch.randn(2, 5, device="kiln:1")]
    assert_same(comm.gather(parts, dim=1, destination=1),
                torch.cat([p.cpu() for p in parts], dim=1))


def test_channels_last_is_kept_by_scatter_gather_and_data_parallel():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3)
    x = torch.randn(4, 3, 10, 10).to(memory_format=torch.channels_last)
    chunks = comm.scatter(x, [0, 1])
    assert all(c.is_contiguous(memory_format=torch.channels_last) for c in chunks)
    gathered = comm.gather(chunks, destination=0)
    assert gathered.is_contiguous(memory_format=torch.channels_last)
    assert_same(gathered, x)
    out = torch.nn.DataParallel(copy.deepcopy(conv).to("kiln"), device_ids=[0, 1])(x)
    assert_same(out, torch.cat([conv(c) for c in x.chunk(2)]))


def test_bad_input_gets_clear_errors():
    source = torch.randn(4)
    t = source.to("kiln:1")
    with pytest.raises(RuntimeError, match="must appear as the first on the devices list"):
        comm.broadcast(t, [0, 1])
    with pytest.raises(RuntimeError, match="kiln device index 5 is out of range; this process "
                                           "has kiln devices 0 to 1"):
        comm.broadcast(t, [1, 5])
    with pytest.raises(RuntimeError, match="all tensors must be on devices\\[0\\]"):
        comm.broadcast_coalesced([t], [0, 1])
    with pytest.raises(RuntimeError, match="don't sum up to the tensor's size"):
        comm.scatter(t, [0, 1], chunk_sizes=[1, 2])
    with pytest.raises(RuntimeError, match="expected at least one device"):
        comm.broadcast(t, ())
    with pytest.raises(RuntimeError, match="expected at least one device"):
        comm.broadcast_coalesced([t], ())
    with pytest.raises(RuntimeError, match="3 chunk sizes for 2 devices"):
        comm.scatter(t, [0, 1], chunk_sizes=[1, 1, 2])
    with pytest.raises(RuntimeError, match="at least one device \\(or output tensor\\)"):
        comm.scatter(t, out=[])
    with pytest.raises(RuntimeError, match="chunk sizes must not be negative"):
        comm.scatter(t, [0, 1], chunk_sizes=[5, -1])
    with pytest.raises(IndexError, match=r"Dimension out of range \(expected to be in range "
                                         r"of \[-2, 1\], but got -3\)"):
        comm.gather([torch.randn(2, 3, device="kiln:0"), torch.randn(2, 3, device="kiln:1")],
                    dim=-3, destination=0)
    with pytest.raises(TypeError, match="out must be a list or tuple of tensors, got Tensor"):
        comm.broadcast(t, out=torch.zeros(2, 4, device="kiln:1"))
    with pytest.raises(RuntimeError, match="kiln device index True is out of range"):
        comm.broadcast(t, [True, False])
    with pytest.raises(RuntimeError, match="stream at index 0 .* to match the device"):
        comm.scatter(t, [0, 1], streams=[torch.kiln.Stream(1), None])
    with pytest.raises(RuntimeError, match="invalid size"):
        comm.gather([torch.randn(2, 3, device="kiln:0"), torch.randn(2, 4, device="kiln:1")])
    with pytest.raises(RuntimeError, match="expects all inputs on kiln devices"):
        comm.gather([torch.randn(2, device="kiln:0"), torch.randn(2)])
    with pytest.raises(RuntimeError, match="at least one tensor"):
        torch._C._gather([], 0, 0)
    # outputs of broadcast and scatter must be on kiln, as CUDA's must be on CUDA,
    # and nothing is written before that is checked
    kept = torch.full((2,), 7.0, device="kiln:0")
    whole = torch.full((4,), 7.0, device="kiln:0")
    with pytest.raises(RuntimeError, match="output tensor at index 1 has device 'cpu'"):
        comm.broadcast(t, out=[whole, torch.empty(4)])
    with pytest.raises(RuntimeError, match="output tensor at index 1 has device 'cpu'"):
        comm.scatter(t, out=[kept, torch.empty(2)])
    with pytest.raises(RuntimeError, match=r"same shape as the source tensor \(4,\), but output "
                                           r"tensor at index 1 has shape \(3,\)"):
        comm.broadcast(t, out=[whole, torch.zeros(3, device="kiln:1")])
    with pytest.raises(RuntimeError, match=r"Output tensor at index 1 has incorrect shape: "
                                           r"\(2, 2\)"):
        comm.scatter(t, out=[kept, torch.zeros(2, 2, device="kiln:1")])
    assert_same(kept, torch.full((2,), 7.0))
    assert_same(whole, torch.full((4,), 7.0))
    # nothing the user had is lost: the source is intact
    assert_same(t, source)


@pytest.mark.parametrize("batch_device", ["cpu", "kiln:0"])
def test_data_parallel_on_a_device_that_does_not_exist_is_a_clear_error(batch_device):
    # A CPU batch meets PyTorch's _get_stream before kiln's scatter (it was a
    # bare IndexError there); a kiln batch meets kiln's scatter.
    model = _model().to("kiln:0")
    with pytest.raises(RuntimeError, match="kiln device index 5 is out of range; this process "
                                           "has kiln devices 0 to 1"):
        torch.nn.DataParallel(model, device_ids=[0, 5])(torch.randn(4, 8, device=batch_device))
    x = torch.randn(4, 8)
    assert_same(torch.nn.DataParallel(model, device_ids=[0, 1])(x).cpu(),
                _cpu_reference(_model(), x, 2))
