"""The compiled conformance pass's plumbing (tests/conformance/, issue 11),
without compiling anything (`make conformance-compiled` runs the pass).

Checks that the pass stays out of default and --quick runs, runs alone with
its own known-failures file, and that its report section and the eager
report never overwrite each other in docs/conformance.md.
"""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "conformance"))

import report  # noqa: E402
import run  # noqa: E402
import settings  # noqa: E402


def spec_for(*argv):
    return run.run_spec(run.parse_args(list(argv)))


def test_compiled_pass_is_opt_in():
    assert settings.COMPILED_PASS not in spec_for().passes
    assert settings.COMPILED_PASS not in spec_for("--quick").passes
    compiled = spec_for("--passes", "compiled")
    assert compiled.passes == ["compiled"] and compiled.quick and compiled.modules == []


def test_compiled_pass_runs_alone():
    with pytest.raises(SystemExit, match="runs alone"):
        spec_for("--passes", "forward,compiled")


def test_compiled_section_survives_the_eager_report():
    eager_v1 = "# Kiln conformance\n\nold eager totals\n"
    section = (f"{report.COMPILED_BEGIN}\n## Compiled pass\nrate 99%\n"
               f"{report.COMPILED_END}\n")
    page = report.with_compiled_section(eager_v1, section)
    assert page.startswith(eager_v1.rstrip("\n")) and page.endswith(section)
    # The eager run rewrites the page and carries the compiled section over.
    eager_v2 = "# Kiln conformance\n\nnew eager totals\n"
    rewritten = report.with_compiled_section(eager_v2, report.compiled_section_of(page))
    assert "new eager totals" in rewritten and "old eager totals" not in rewritten
    assert report.compiled_section_of(rewritten) == section
    # A new compiled run replaces only its own section.
    section_v2 = section.replace("99%", "98.5%")
    updated = report.with_compiled_section(rewritten, section_v2)
    assert "new eager totals" in updated and "98.5%" in updated and "rate 99%" not in updated
    assert report.with_compiled_section(eager_v2, "") == eager_v2


def test_failure_kinds_put_wrong_values_first():
    assert report.compiled_kind("wrong value: output: 3 of 9 values differ") == "wrong value"
    assert report.compiled_kind("Dynamo graph break: Dynamic shape operator") == (
        "Dynamo graph break")
    assert report.compiled_kind("Inductor lowering error: LoweringException: x") == (
        "Inductor lowering error")
    assert report.compiled_kind("worker killed by signal 11 (SIGSEGV)").startswith("other")
    assert report.COMPILED_KINDS[0][1] == "wrong value"


@pytest.mark.parametrize("op_name", ["bernoulli", "nn.functional.dropout", "nonzero"])
def test_compiled_case_settings(op_name, tmp_path, monkeypatch):
    """A random op (OpInfo seeds it inside a wrapper Dynamo never traces)
    and a data-dependent one compile as one graph with the pass's settings
    (compiled_cases.COMPILE_CONFIG, seeding outside the compiled function)
    and match eager kiln; the database's wrapper is restored afterwards."""
    import compiled_cases
    import samples
    from torch.testing._internal import common_methods_invocations
    from torch.testing._internal.common_methods_invocations import op_db

    import torch

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    wrapper = common_methods_invocations.wrapper_set_seed
    op = next(o for o in op_db if o.name == op_name and not o.variant_test_name)
    placed = samples.SampleSource(op, torch.float32, quick=True).for_pass(settings.COMPILED_PASS)[0]
    compiled_cases.compiled_case(op, placed, compiled_cases.default_tolerance("float32"))
    assert common_methods_invocations.wrapper_set_seed is wrapper
