"""torch_kiln.compiler.get_metrics() / reset_metrics(): graphs compiled,
graph breaks with their reasons, recompilations and compile seconds; and
backend="kiln"'s failure policy (KILN_COMPILE_FALLBACK)."""

import warnings

import pytest
import torch
import torch._dynamo

import torch_kiln.compiler as kiln_compiler


def _with_a_graph_break(x):
    y = x.sin()
    torch._dynamo.graph_break()
    return y.cos()


def test_counts_graphs_breaks_and_recompilations():
    torch._dynamo.reset()
    kiln_compiler.reset_metrics()
    assert kiln_compiler.get_metrics() == {
        "graphs_compiled": 0, "frames_compiled": 0, "graph_breaks": {}, "graph_break_count": 0,
        "recompilations": 0, "recompilation_reasons": [], "compile_seconds": 0.0,
        "kiln_graphs": {"graphs_captured": 0, "graph_replays": 0, "warmup_runs": 0,
                        "eager_runs": 0, "skips": {}}}

    broken = torch.compile(_with_a_graph_break, backend="eager")
    x = torch.randn(3, device="kiln")
    torch.testing.assert_close(broken(x), x.sin().cos(), rtol=0, atol=0)
    metrics = kiln_compiler.get_metrics()
    assert metrics["graphs_compiled"] == 2  # the pieces before and after the break
    assert metrics["graph_break_count"] == 1
    (reason,) = metrics["graph_breaks"]
    assert "graph_break" in reason.lower() or "graph break" in reason.lower()
    assert metrics["recompilations"] == 0
    assert metrics["compile_seconds"] > 0

    static = torch.compile(lambda t: t * 2, backend="eager", dynamic=False)
    static(torch.ones(2, device="kiln"))
    static(torch.ones(3, device="kiln"))  # a new static shape: one recompilation
    metrics = kiln_compiler.get_metrics()
    assert metrics["recompilations"] == 1
    assert "size mismatch" in metrics["recompilation_reasons"][0]

    kiln_compiler.reset_metrics()
    assert kiln_compiler.get_metrics()["graphs_compiled"] == 0
    assert kiln_compiler.get_metrics()["recompilations"] == 0


def test_fullgraph_frames_are_counted():
    """Dynamo's counters["frames"] leaves out fullgraph=True compiles."""
    torch._dynamo.reset()
    kiln_compiler.reset_metrics()
    torch.compile(lambda t: t.cos() * 3, backend="eager", fullgraph=True)(
        torch.randn(3, device="kiln"))
    torch.compile(_with_a_graph_break, backend="eager")(torch.randn(3, device="kiln"))
    metrics = kiln_compiler.get_metrics()
    assert metrics["frames_compiled"] == 3  # the fullgraph frame, then two around the break
    assert metrics["graphs_compiled"] == 3


# ---------------------------------------------------------------- failure policy

def _failing_compile_fx(gm, example_inputs, **kwargs):
    raise RuntimeError("lowering aten.fake_op failed (node fake_op_1)")


def test_a_graph_that_cannot_compile_raises_naming_the_graph(monkeypatch):
    import torch._inductor.compile_fx

    monkeypatch.delenv("KILN_COMPILE_FALLBACK", raising=False)
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", _failing_compile_fx)
    torch._dynamo.reset()
    f = torch.compile(lambda t: t.sin() + 1, backend="kiln")
    with pytest.raises(Exception) as error:
        f(torch.ones(3, device="kiln"))
    assert "lowering aten.fake_op failed" in str(error.value)  # BackendCompilerFailed's text
    # The compiler's own error, chained below Dynamo's, carries the note (the
    # traceback prints it).
    chained, notes = error.value, ""
    while chained is not None and not notes:
        notes = "".join(getattr(chained, "__notes__", []))
        chained = chained.__cause__ or chained.__context__
    assert "kiln: while compiling graph [0/0]" in notes and "KILN_COMPILE_FALLBACK=eager" in notes


def test_fallback_eager_runs_the_graph_with_one_warning(monkeypatch):
    import torch._inductor.compile_fx

    monkeypatch.setenv("KILN_COMPILE_FALLBACK", "eager")
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", _failing_compile_fx)
    torch._dynamo.reset()
    f = torch.compile(lambda t: t.sin() + 1, backend="kiln")
    x = torch.ones(3, device="kiln")
    with pytest.warns(UserWarning, match=r"graph \[0/0\] .* could not be compiled .*running "
                                         r"it eagerly because KILN_COMPILE_FALLBACK=eager"):
        result = f(x)
    torch.testing.assert_close(result, x.sin() + 1, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the compiled (eager) graph is reused: no new warning
        torch.testing.assert_close(f(x), x.sin() + 1, rtol=0, atol=0)


def test_an_unknown_fallback_policy_is_rejected(monkeypatch):
    monkeypatch.setenv("KILN_COMPILE_FALLBACK", "sometimes")
    torch._dynamo.reset()
    f = torch.compile(lambda t: t * 2, backend="kiln")
    with pytest.raises(Exception, match="KILN_COMPILE_FALLBACK='sometimes' is not a policy; "
                                        "use one of error, eager"):
        f(torch.ones(2, device="kiln"))


def test_kiln_backend_random_ops_give_eager_numbers():
    # backend="kiln" keeps random ops on kiln's generator (fallback_random):
    # the same seed gives eager kiln's numbers, dropout masks included.
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)).to("kiln")
    x = torch.randn(4, 8, device="kiln")
    torch.manual_seed(3)
    eager = model(x)
    compiled = torch.compile(model, backend="kiln")
    torch.manual_seed(3)
    torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)
    torch.manual_seed(4)
    again = compiled(x)
    torch.manual_seed(4)
    torch.testing.assert_close(again, model(x), rtol=0, atol=0)
