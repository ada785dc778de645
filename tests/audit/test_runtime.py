"""The audit's run on kiln: --map-cuda runs CUDA-style programs unchanged and
they give CPU's losses; syncs, graph breaks and recompilations are reported
at the user's line; the mapping is undone afterwards."""

import subprocess
import sys

import torch

from audit_helpers import fixture, found, planted, run_audit_json

import torch_kiln.audit as kiln_audit
from torch_kiln.audit.mapping import CudaMapping


def test_cuda_training_loop_runs_unchanged_with_cpu_losses(tmp_path):
    script = fixture("cuda_train.py")
    result, report = run_audit_json(tmp_path, "--map-cuda", script)
    assert result.returncode == 0, result.stderr[-3000:]
    cpu = subprocess.run([sys.executable, script, "--device", "cpu"], capture_output=True,
                         text=True, timeout=60)
    assert cpu.returncode == 0, cpu.stderr
    # The script's own output passes through unchanged: the same losses, bit for bit.
    assert result.stdout == cpu.stdout
    assert result.stdout.count(" loss ") == 8
    assert report["run"]["exit_status"] == 0 and report["run"]["complete"]
    assert planted(script) <= found(report["findings"])
    assert found(report["findings"], "static") == {p for p in planted(script) if p[2] != "sync"}
    (item,) = [f for f in report["findings"] if f["category"] == "sync"
               and f["line"] == 45]
    assert item["count"] == 8 and item["detail"]["aten"] == ["aten::_local_scalar_dense"]
    # The text report (stderr) is grouped by category, with counts and effort.
    assert "dot-cuda: .cuda() call (2)" in result.stderr
    assert "cuda_train.py:45  [medium; slower; needs a decision, 8 times]" in result.stderr


def test_without_map_cuda_the_failure_is_the_finding_and_status_is_kept(tmp_path):
    script = fixture("cuda_train.py")
    result, report = run_audit_json(tmp_path, script)
    assert result.returncode == 1
    failures = [f for f in report["findings"] if f["category"] == "run-failure"]
    assert [(f["line"], f["message"]) for f in failures] == [
        (34, "the script raised AssertionError: Torch not compiled with CUDA enabled")]
    assert "run with --map-cuda" in failures[0]["replacement"]
    # The script's own traceback, as Python prints it: no frames of the audit.
    assert "Traceback" in result.stderr and "torch_kiln/audit" not in result.stderr


def test_amp_and_grad_scaler_program_runs_with_map_cuda(tmp_path):
    script = fixture("cuda_amp.py")
    result, report = run_audit_json(tmp_path, "--map-cuda", script)
    assert result.returncode == 0, result.stderr[-3000:]
    # autocast and the GradScaler are on, on kiln (without the mapping both
    # would be disabled with a warning: "silently different").
    assert result.stdout.endswith("logits torch.float16 scaler enabled True\n")
    assert result.stdout.count(" loss ") == 4
    assert planted(script) <= found(report["findings"])


def test_compiled_model_graph_break_and_recompilation_at_the_users_lines(tmp_path):
    script = fixture("compiled_model.py")
    result, report = run_audit_json(tmp_path, "--map-cuda", script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert planted(script) <= found(report["findings"])
    compile_items = {(f["line"], f["category"]) for f in report["findings"]
                     if f["category"] in ("graph-break", "recompilation")}
    # Only the program's own: the audit's TorchFunctionMode adds no breaks.
    assert compile_items == {(17, "graph-break"), (15, "recompilation")}
    assert report["run"]["compile"]["graph_break_count"] == 2


def test_audit_of_a_callable_in_process():
    sys.path.insert(0, fixture("."))
    try:
        import audited_function
    finally:
        sys.path.pop(0)
    report = kiln_audit.audit(audited_function.train_step, 3, map_cuda=True)
    assert report.result == 3 * 0.0 + (4 * 4 * 1.5) + (4 * 4 * 1.75) + (4 * 4 * 1.875)
    expected = planted(fixture("audited_function.py"))
    assert found(report.findings, "static") == {p for p in expected if p[2] != "sync"}
    assert expected <= found(report.findings)
    (sync,) = [f for f in report.findings if f.category == "sync" and f.line == 12]
    assert sync.count == 3
    assert torch.cuda.is_available() is False  # the mapping was undone


def test_mapping_is_scoped_and_restored():
    before = (torch.cuda.is_available, torch.cuda.synchronize, torch.nn.Module.cuda,
              torch.amp.autocast.__init__, torch.cuda.amp.GradScaler)
    with CudaMapping():
        assert torch.cuda.is_available() and torch.cuda.device_count() == torch.kiln.device_count()
        model = torch.nn.Linear(2, 2).cuda()
        assert model.weight.device.type == "kiln"
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.is_autocast_enabled("kiln")
            assert torch.get_autocast_dtype("kiln") == torch.bfloat16
        with torch.cuda.amp.autocast():  # CUDA's default dtype, float16
            assert torch.is_autocast_enabled("kiln")
            assert torch.get_autocast_dtype("kiln") == torch.float16
        assert torch.cuda.amp.GradScaler().is_enabled()
    after = (torch.cuda.is_available, torch.cuda.synchronize, torch.nn.Module.cuda,
             torch.amp.autocast.__init__, torch.cuda.amp.GradScaler)
    assert before == after and torch.cuda.is_available() is False


def test_mapping_covers_torch_load_map_location_and_generators():
    import io

    buffer = io.BytesIO()
    torch.save({"w": torch.arange(3.0)}, buffer)
    before = (torch.load, torch.Generator)
    with CudaMapping():
        for location, expected in (("cuda", "kiln:0"), ("cuda:1", "kiln:1"),
                                   (torch.device("cuda", 1), "kiln:1"),
                                   ({"cpu": "cuda:1"}, "kiln:1")):
            buffer.seek(0)
            loaded = torch.load(buffer, map_location=location)["w"]
            assert str(loaded.device) == expected, location
            assert loaded.cpu().tolist() == [0.0, 1.0, 2.0]
        generator = torch.Generator(device="cuda")
        assert generator.device == torch.device("kiln", 0)
        assert isinstance(generator, torch.Generator)
        assert torch.Generator().device.type == "cpu"
        generator.manual_seed(5)
        drawn = torch.randn(3, device="kiln", generator=generator)
        assert drawn.cpu().tolist() == torch.randn(
            3, device="kiln", generator=torch.Generator(device="kiln").manual_seed(5)).cpu().tolist()
    assert (torch.load, torch.Generator) == before


def test_mapping_makes_cuda_graphs_kiln_graphs_and_restores_them():
    before = (torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.nvtx.range_push)
    with CudaMapping():
        assert torch.cuda.CUDAGraph is torch.kiln.KilnGraph
        assert torch.cuda.graph is torch.kiln.graph
        assert torch.cuda.graph_pool_handle is torch.kiln.graph_pool_handle
        assert torch.cuda.make_graphed_callables is torch.kiln.make_graphed_callables
        assert torch.cuda.MemPool is torch.kiln.MemPool
        static = torch.ones(64, device="kiln")  # (arguments are the tracer's job, not mapped here)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up, as CUDA's recipe
            static * 3 + 1
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
            torch.cuda.nvtx.range_push("captured")
            out = static * 3 + 1
            torch.cuda.nvtx.range_pop()
        static.fill_(2.0)
        graph.replay()
        assert out.device.type == "kiln" and out.cpu().tolist() == [7.0] * 64
        assert torch.cuda.nvtx.range_pop() == -1  # kiln's nvtx: the pushed range was popped
    assert (torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.nvtx.range_push) == before


def test_inductor_compiled_program_runs_with_map_cuda(tmp_path):
    """@torch.compile with the default backend under --map-cuda failed in
    Inductor's cache key, which reads torch.cuda.get_device_properties(...)
    .gcnArchName when torch.version.cuda is None (found by a fresh user; the
    fixtures compile with backend="eager")."""
    script = tmp_path / "compiled.py"
    script.write_text(
        "import torch\n"
        "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
        "@torch.compile\n"
        "def f(x):\n"
        "    return (x * 2).sin().sum()\n"
        "x = torch.arange(8, dtype=torch.float32, device=device)\n"
        "print('f', f(x).item(), x.device.type)\n")
    result, report = run_audit_json(tmp_path, "--map-cuda", str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    expected = torch.compile(lambda x: (x * 2).sin().sum())(torch.arange(8.0)).item()
    assert result.stdout == f"f {expected} kiln\n"


def test_nccl_backend_becomes_kccl_with_map_cuda(tmp_path):
    """init_process_group("nccl") under --map-cuda failed with "Distributed
    package doesn't have NCCL built in" (found by a fresh user)."""
    from torch_kiln.audit.mapping import _kiln_backend

    assert [_kiln_backend(b) for b in ("nccl", "NCCL", "cpu:gloo,cuda:nccl", "gloo", None)] == \
        ["kccl", "kccl", "cpu:gloo,kiln:kccl", "gloo", None]
    script = tmp_path / "ddp.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        f"dist.init_process_group('nccl', init_method='file://{tmp_path / 'store'}',\n"
        "                        rank=0, world_size=1)\n"
        "t = torch.ones(3, device='cuda')\n"
        "dist.all_reduce(t)\n"
        "print(dist.get_backend(), t.device.type, t.tolist())\n"
        "dist.destroy_process_group()\n")
    result, _ = run_audit_json(tmp_path, "--map-cuda", str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "kccl kiln [1.0, 1.0, 1.0]\n"


def test_cuda_graph_program_runs_with_map_cuda(tmp_path):
    script = tmp_path / "cuda_graph.py"
    script.write_text(
        "import torch\n"
        "x = torch.zeros(8, device='cuda')\n"
        "s = torch.cuda.Stream()\n"
        "s.wait_stream(torch.cuda.current_stream())\n"
        "with torch.cuda.stream(s):\n"
        "    x * 2\n"
        "torch.cuda.current_stream().wait_stream(s)\n"
        "g = torch.cuda.CUDAGraph()\n"
        "with torch.cuda.graph(g):\n"
        "    y = x * 2\n"
        "for step in range(3):\n"
        "    x.fill_(step)\n"
        "    g.replay()\n"
        "    print('step', step, y.sum().item())\n")
    result, report = run_audit_json(tmp_path, "--map-cuda", str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:3] == ["step 0 0.0", "step 1 16.0", "step 2 32.0"]
    graphs = [f for f in report["findings"] if f["category"] == "cuda-graphs"]
    assert sorted(f["line"] for f in graphs) == [8, 9]  # still listed: a decision to make


def test_mapping_is_restored_when_the_body_raises():
    try:
        with CudaMapping():
            raise KeyError("x")
    except KeyError:
        pass
    assert torch.cuda.is_available() is False
    assert "cuda" not in vars(torch.nn.Module) or torch.nn.Module.cuda.__name__ == "cuda"


def test_an_operator_that_fails_on_kiln_is_reported_at_its_line(tmp_path):
    script = tmp_path / "quantized.py"
    script.write_text(
        "import torch\n"
        "x = torch.ones(2, device='kiln')\n"
        "try:\n"
        "    torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)\n"
        "except NotImplementedError:\n"
        "    print('caught')\n")
    result, report = run_audit_json(tmp_path, str(script))
    assert result.returncode == 0 and result.stdout == "caught\n"
    (failure,) = report["findings"]
    assert (failure["category"], failure["line"], failure["detail"]["op"]) == (
        "op-failure", 4, "torch.quantize_per_tensor")
    assert failure["detail"]["error"].startswith("NotImplementedError: Kiln does not support "
                                                 "quantized tensors")
    assert "1 finding: 1 needs a decision" in result.stderr


def test_failed_ops_are_replayed_on_cpu_and_dtype_changes_reported(tmp_path):
    script = tmp_path / "changes.py"
    script.write_text(
        "import numpy as np\n"
        "import torch\n"
        "x = torch.ones(2, device='cuda')\n"
        "a = torch.from_numpy(np.arange(3.0)).cuda()\n"  # float64 enters the device
        "b = a * 2\n"                                     # already float64 there: not again
        "with torch.autocast('cuda', dtype=torch.float64):\n"
        "    y = x @ x\n"
        "try:\n"
        "    torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)\n"
        "except NotImplementedError:\n"
        "    pass\n"
        "for _ in range(3):\n"
        "    try:\n"
        "        x + torch.ones(3, device='cuda')\n"
        "    except RuntimeError:\n"
        "        pass\n"
        "print(b.dtype, y.dtype)\n")
    result, report = run_audit_json(tmp_path, "--map-cuda", str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "torch.float64 torch.float32\n"
    runtime = {(f["line"], f["category"]): f for f in report["findings"]
               if f["source"] == "runtime" and f["category"] != "sync"}
    assert set(runtime) == {(4, "dtype-change"), (6, "dtype-change"), (9, "op-failure"),
                            (14, "op-failure")}
    wide, autocast = runtime[(4, "dtype-change")], runtime[(6, "dtype-change")]
    assert (wide["detail"]["dtype"], wide["on_kiln"]) == ("float64", "works")
    assert "float64 crept in" in wide["message"]
    assert autocast["on_kiln"] == "silently different"
    assert autocast["message"].startswith("autocast(dtype=float64) was disabled on kiln: "
                                          "kiln's autocast supports float16, bfloat16, float32")
    quantize, add = runtime[(9, "op-failure")], runtime[(14, "op-failure")]
    assert quantize["detail"]["cpu_replay"] == "unsupported on kiln"
    assert "unsupported on kiln: the same call runs on the CPU" in quantize["message"]
    assert quantize["replacement"].startswith("a kiln gap")
    assert (add["detail"]["cpu_replay"], add["count"]) == ("fails on CPU too", 3)
    assert add["detail"]["cpu_error"].startswith("RuntimeError: The size of tensor a (2) must "
                                                 "match the size of tensor b (3)")
    assert add["replacement"].startswith("the program's own error")
    # The replay's copies to the CPU are not counted as the program's syncs.
    assert report["run"]["unattributed_syncs"] == 0


def test_replay_outcomes_in_process():
    from torch_kiln.audit.replay import FAILS_ON_CPU, NOT_REPLAYED, UNSUPPORTED, replay_on_cpu

    x = torch.ones(2, device="kiln")
    assert replay_on_cpu(torch.quantize_per_tensor, (x, 0.1, 0, torch.qint8), {}) == (
        UNSUPPORTED, "")
    outcome, error = replay_on_cpu(torch.add, (x, torch.ones(3, device="kiln")), {})
    assert outcome == FAILS_ON_CPU and error.startswith("RuntimeError: The size of tensor a")
    assert replay_on_cpu(torch.add, (torch.ones(2), torch.ones(3)), {})[0] == NOT_REPLAYED
    x1 = torch.ones(2, device="kiln:1")  # kiln:1 tensors and devices map to the CPU too
    assert replay_on_cpu(torch.quantize_per_tensor, (x1, 0.1, 0, torch.qint8), {}) == (
        UNSUPPORTED, "")
    assert replay_on_cpu(torch.add, (x1, torch.ones(3, device=torch.device("kiln", 1))),
                         {})[0] == FAILS_ON_CPU
    # In-place ops replay on copies; autograd's own errors replay too.
    leaf = torch.ones(2, device="kiln", requires_grad=True)
    outcome, error = replay_on_cpu(torch.Tensor.add_, (leaf, 1), {})
    assert outcome == FAILS_ON_CPU and "leaf Variable that requires grad" in error
    assert torch.equal(leaf.detach().cpu(), torch.ones(2))
    # A replay draws nothing from the program's CPU random stream.
    torch.manual_seed(0)
    expected = torch.randn(3)
    torch.manual_seed(0)
    def draws(x):  # a call that runs on the CPU and draws from its generator
        return x + torch.randn(5).sum()

    assert replay_on_cpu(draws, (torch.ones(1, device="kiln"),), {}) == (UNSUPPORTED, "")
    assert torch.equal(torch.randn(3), expected)
    # Nothing big is allocated again on the CPU.
    outcome, why = replay_on_cpu(torch.zeros, (1 << 20, 1 << 20), {"device": "kiln"})
    assert (outcome, why) == (NOT_REPLAYED, f"a call that may allocate {1 << 40} elements")
    oom = torch.OutOfMemoryError("kiln: out of memory")
    assert replay_on_cpu(torch.ones, (4,), {"device": "kiln"}, oom)[0] == NOT_REPLAYED


def test_tracer_restores_autocast_after_an_in_process_audit():
    before = torch.amp.autocast.__init__
    report = kiln_audit.audit(lambda: torch.ones(1, device="kiln").double())
    assert torch.amp.autocast.__init__ is before
    # (The lambda's file, this test file, is read too: only the run's findings here.)
    assert [f.category for f in report.findings if f.source == "runtime"] == ["dtype-change"]


def test_pytorchs_own_float64_is_not_a_dtype_change(tmp_path):
    # GradScaler keeps its scale's reciprocal in float64 (torch/amp/
    # grad_scaler.py): that is PyTorch's arithmetic, not the program's data.
    script = tmp_path / "scaler.py"
    script.write_text(
        "import torch, torch.nn as nn\n"
        "model = nn.Linear(8, 2).cuda()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "scaler = torch.amp.GradScaler('cuda')\n"
        "x = torch.randn(16, 8, device='cuda')\n"
        "for _ in range(2):\n"
        "    with torch.autocast('cuda', dtype=torch.float16):\n"
        "        loss = model(x).square().mean()\n"
        "    opt.zero_grad()\n"
        "    scaler.scale(loss).backward()\n"
        "    scaler.step(opt)\n"
        "    scaler.update()\n"
        "w = torch.ones(2, device='cuda', dtype=torch.float64)\n"  # the program's own float64
        "print('done')\n")
    result, report = run_audit_json(tmp_path, "--map-cuda", str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    changes = [f["line"] for f in report["findings"] if f["category"] == "dtype-change"]
    assert changes == [13], report["findings"]
