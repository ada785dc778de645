"""The audit's static reader (torch_kiln/audit/static.py): every planted
lock-in in the CUDA-style fixtures at its file:line and category, nothing on
the portable fixtures, and names resolved through the file's imports."""

import os
import textwrap

import pytest
import torch

from audit_helpers import RUNTIME_CATEGORIES, fixture, found, planted

from torch_kiln.audit.static import scan_program, scan_source

CUDA_STYLE = {
    "cuda_train.py": ["cuda_train.py"],
    "cuda_amp.py": ["cuda_amp.py"],
    "compiled_model.py": ["compiled_model.py"],
    "cuda_misc.py": ["cuda_misc.py"],
    "audited_function.py": ["audited_function.py"],
    # Reads the module it imports from its own tree, and the .cu file next to it.
    "extension/ext_train.py": ["extension/ext_train.py", "extension/ext_helpers.py",
                               "extension/add_kernel.cu"],
}


@pytest.mark.parametrize("script", sorted(CUDA_STYLE))
def test_every_planted_item_and_nothing_else(script):
    findings, scanned = scan_program(fixture(script))
    expected = {item for item in planted(*map(fixture, CUDA_STYLE[script]))
                if item[2] not in RUNTIME_CATEGORIES}
    assert found(findings) == expected
    assert fixture(script) in scanned


@pytest.mark.parametrize("script", ["portable_train.py", "portable_distributed.py"])
def test_portable_programs_have_no_findings(script):
    findings, _ = scan_program(fixture(script))
    assert findings == []


def scan(code: str):
    findings, tree = scan_source(textwrap.dedent(code), "/prog.py")
    return [(f.line, f.category) for f in findings]


def test_names_resolve_through_imports():
    assert scan("""
        import torch as th
        from torch.cuda.amp import autocast as ac
        from torch import cuda
        import torch.backends.cudnn as cudnn
        th.cuda.synchronize()
        with ac():
            pass
        cuda.empty_cache()
        cudnn.deterministic = True
        """) == [(6, "torch-cuda"), (7, "cuda-amp"), (9, "torch-cuda"), (10, "cuda-setting")]


def test_lookalikes_are_not_findings():
    assert scan("""
        import torch
        class Box:
            cuda = None
        b = Box()
        b.cuda_ready = "cuda is fast"       # prose and other names
        torch.device(name)                  # chosen at run time
        print("use the nccl backend on GPUs")
        torch.set_float32_matmul_precision("high")
        """) == []


def test_each_finding_carries_its_judgements_and_code():
    findings, _ = scan_source('x = y.cuda()\n', "/prog.py")
    (f,) = findings
    assert (f.file, f.line, f.category, f.severity, f.on_kiln, f.effort) == (
        "/prog.py", 1, "dot-cuda", "high", "fails", "mechanical")
    assert f.code == "x = y.cuda()" and "torch.accelerator" in f.replacement


def test_catching_torch_cuda_out_of_memory_error_works_on_kiln():
    """torch.cuda.OutOfMemoryError is torch.OutOfMemoryError, which kiln
    raises: it was reported as [high; fails; needs a decision]."""
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError
    findings, _ = scan_source("import torch\ntry:\n    pass\n"
                              "except torch.cuda.OutOfMemoryError:\n    pass\n", "/prog.py")
    (f,) = findings
    assert (f.line, f.category, f.severity, f.on_kiln) == (4, "torch-cuda", "low", "works")
    assert f.replacement == "torch.OutOfMemoryError (the same class)"


def test_device_strings_completed_by_format_percent_or_plus():
    """Found by a fresh user: only f"cuda:{rank}" was reported; these were
    missed, and the script looked portable. --fix lists them (not rewritten)."""
    from torch_kiln.audit.fix import fix_source

    code = textwrap.dedent("""\
        import torch
        rank = 0
        a = torch.device("cuda:%d" % rank)
        b = "cuda:{}".format(rank)
        c = "cuda:" + str(rank)
        d = "cuda:{r}".format(r=rank)
        e = "total: %d" % rank + "cuda" * 0
        """)
    findings, _ = scan_source(code, "/prog.py")
    assert [(f.line, f.category) for f in findings] == [
        (3, "device-string"), (4, "device-string"), (5, "device-string"), (6, "device-string"),
        (7, "device-string")]  # line 7: the bare "cuda", as before
    assert findings[0].message == "hard-coded device built from 'cuda:%d'"
    _, fixed, unfixed, _ = fix_source(code, "/prog.py")
    assert sorted(f.line for f, why in unfixed if "completed by %, .format or +" in why) == \
        [3, 4, 5, 6]


def test_cuda_environment_variables_and_build_queries():
    """Missed before (found by a fresh user): CUDA's environment variables,
    and branches on torch.version.cuda or torch.backends.cuda.is_built()."""
    code = textwrap.dedent("""\
        import os, torch
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if torch.version.cuda is not None:
            pass
        if torch.backends.cuda.is_built():
            pass
        os.environ["MY_CUDA_FLAG"] = "1"
        """)
    findings, _ = scan_source(code, "/prog.py")
    assert [(f.line, f.category) for f in findings] == [
        (2, "cuda-setting"), (3, "cuda-setting"), (4, "cuda-branch"), (6, "cuda-branch")]
    assert "KILN_VISIBLE_DEVICES" in findings[0].message


def test_syntax_error_is_a_finding_and_tokens_still_report():
    findings, tree = scan_source('import torch\nx = torch.ones(2).cuda()\ndef f(:\n'
                                 'y = torch.zeros(1, device="cuda")\n', "/bad.py")
    assert tree is None
    assert [(f.line, f.category) for f in findings] == [
        (3, "syntax-error"), (2, "dot-cuda"), (4, "device-string")]
    assert findings[0].message.startswith("SyntaxError")
    assert all(f.detail.get("from") == "tokens" for f in findings[1:])


def test_imports_outside_the_tree_are_not_read(tmp_path):
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "main.py").write_text("import helper\nimport os\nimport torch\n")
    (tmp_path / "app" / "helper.py").write_text("import torch\ntorch.cuda.synchronize()\n")
    (tmp_path / "other.py").write_text("x.cuda()\n")
    findings, scanned = scan_program(str(tmp_path / "app" / "main.py"))
    assert [os.path.basename(p) for p in scanned] == ["main.py", "helper.py"]
    assert [(os.path.basename(f.file), f.line, f.category) for f in findings] == [
        ("helper.py", 2, "torch-cuda")]


def test_missing_script_raises_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such script"):
        scan_program(str(tmp_path / "nope.py"))
