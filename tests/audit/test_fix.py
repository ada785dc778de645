"""``--fix`` (torch_kiln/audit/fix.py): the diff applies with ``patch`` and
``git apply``, the patched CUDA-style fixtures run on kiln and on a CPU-only
PyTorch with the losses of the original under ``--map-cuda``, each rewrite
form gives the portable code, and bad input (a syntax error, a file outside
the user's tree, a --fix path that is a script) never patches anything."""

import ast
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from audit_helpers import FIXTURES, fixture, run_audit, run_audit_json

from torch_kiln.audit.fix import fix_source, make_fix
from torch_kiln.audit.static import scan_source

# A CPU-only PyTorch: kiln's backend entry point is not loaded, so
# torch.accelerator.current_accelerator() is None.
CPU_ONLY = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}


def python(script, *args, env=None, cwd=None, timeout=120):
    result = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                            timeout=timeout, cwd=cwd, env=dict(os.environ, **(env or {})))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def patched_copy(tmp_path, name, apply_with="patch"):
    """Copies the fixture ``name`` to tmp_path, writes its --fix diff (the
    script is not run) and applies it; returns (script path, diff text)."""
    shutil.copy(fixture(name), tmp_path / name)
    diff_path = tmp_path / "fix.diff"
    result = run_audit("--no-run", "--fix", str(diff_path), str(tmp_path / name))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "nothing was edited" in result.stderr
    assert (tmp_path / name).read_text() == open(fixture(name)).read()  # never in place
    if apply_with == "patch":
        subprocess.run(["patch", "-p1", "-s", "-i", str(diff_path)], cwd=tmp_path, check=True,
                       timeout=30)
    else:
        subprocess.run(["git", "init", "-q", "."], cwd=tmp_path, check=True, timeout=30)
        subprocess.run(["git", "apply", str(diff_path)], cwd=tmp_path, check=True, timeout=30)
    return str(tmp_path / name), diff_path.read_text()


def not_rewritten_at(diff, k):
    """Index in the diff's lines of the k-th item listed as not rewritten."""
    return [i for i, line in enumerate(diff.splitlines()) if line.startswith("#   ")][k]


def losses(output):
    return [float(line.split()[-1]) for line in output.splitlines() if " loss " in line]


def original_under_map_cuda(tmp_path, name):
    result, _ = run_audit_json(tmp_path, "--map-cuda", fixture(name))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_training_loop_patch_runs_on_kiln_and_cpu_with_the_original_losses(tmp_path):
    reference = original_under_map_cuda(tmp_path, "cuda_train.py")
    script, diff = patched_copy(tmp_path, "cuda_train.py", apply_with="git")
    # The branch on "cuda" is the first item of the header: the patch alone
    # leaves it CUDA-only, so on kiln the loop takes its CPU path ...
    not_rewritten = [line for line in diff.splitlines() if line.startswith("#   ")]
    assert not_rewritten[0].startswith('#   cuda_train.py:25: cuda-branch [needs a decision]: '
                                       'use_cuda = "cuda" in args.device')
    assert python(script) == reference
    # ... and once that decision is made as the header suggests, the patched
    # loop runs on kiln, with the same losses, bit for bit (the audit, without
    # --map-cuda, shows the kiln syncs of loss.item() at line 45 + 1: the diff
    # added a line).
    suggestion = 'for "any accelerator", write `args.device != "cpu"`'
    assert suggestion in diff.splitlines()[not_rewritten_at(diff, 0) + 1]
    text = open(script).read().replace('use_cuda = "cuda" in args.device',
                                       'use_cuda = args.device != "cpu"')
    open(script, "w").write(text)
    result, report = run_audit_json(tmp_path, script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == reference
    syncs = {(f["line"], f["count"]) for f in report["findings"] if f["category"] == "sync"}
    assert (46, 8) in syncs
    # No mechanical finding is left but the TF32/cuDNN flags (kept on purpose).
    left = {f["category"] for f in report["findings"] if f["source"] == "static"}
    assert left == {"cuda-setting"}
    # On a CPU-only PyTorch (no accelerator: device is the CPU), and with --device cpu.
    assert python(script, env=CPU_ONLY) == reference
    assert python(script, "--device", "cpu") == reference


def test_amp_patch_runs_on_kiln_bit_equal_and_on_cpu_within_float16(tmp_path):
    reference = original_under_map_cuda(tmp_path, "cuda_amp.py")
    script, diff = patched_copy(tmp_path, "cuda_amp.py")
    assert "torch.autocast(device_type=accelerator.type, dtype=torch.float16)" in open(script).read()
    assert "torch.amp.GradScaler(accelerator.type)" in open(script).read()
    assert python(script) == reference  # kiln: the same autocast, the same numbers
    cpu = python(script, env=CPU_ONLY)
    assert cpu.splitlines()[-1] == "logits torch.float16 scaler enabled True"
    # CPU's autocast casts another set of ops than CUDA's (and kiln's): the
    # losses agree within float16 rounding, not bit for bit.
    assert losses(cpu) == pytest.approx(losses(reference), rel=1e-3)
    assert len(losses(cpu)) == 4


def test_compiled_model_patch_runs_on_kiln_and_cpu(tmp_path):
    reference = original_under_map_cuda(tmp_path, "compiled_model.py")
    script, _ = patched_copy(tmp_path, "compiled_model.py")
    assert python(script) == reference
    assert python(script, env=CPU_ONLY) == reference


def test_patched_fixtures_are_still_cuda_code_in_principle(tmp_path):
    """The rewrites name only torch.accelerator / torch.amp / torch.device,
    nothing of kiln's; every rewritable finding is gone and the rest are listed."""
    for name in ("cuda_train.py", "cuda_amp.py", "compiled_model.py", "cuda_misc.py",
                 "audited_function.py"):
        text = open(fixture(name)).read()
        new, fixed, unfixed, reason = fix_source(text, fixture(name))
        assert reason == "" and new != text and fixed
        added = "".join(line for line in new.splitlines(True) if line not in text)
        assert "kiln" not in added.replace("kiln-audit --fix: CUDA, kiln, ... or the CPU", "")
        after, _ = scan_source(new, name)
        rewritten = {(f.category, f.message) for f in fixed}
        assert not rewritten & {(f.category, f.message) for f in after}
        # What was not rewritten is still there, to be found again.
        assert {(f.category, f.message) for f, _ in unfixed} <= {
            (f.category, f.message) for f in after}


def rewrite(code):
    new, fixed, unfixed, reason = fix_source(textwrap.dedent(code), "/prog.py")
    assert reason == "", reason
    return new, [(f.line, f.category, why) for f, why in unfixed]


DEFINITION = 'device = torch.accelerator.current_accelerator() or torch.device("cpu")  ' \
             '# kiln-audit --fix: CUDA, kiln, ... or the CPU\n'


def test_every_device_string_form():
    new, unfixed = rewrite('''\
        """Doc."""
        import torch
        a = torch.device("cuda")
        b = torch.zeros(2, device="cuda:0")
        c = b.to("cuda")
        d = torch.ones(1, device=f"cuda:{0}")
        e = b.cuda()
        f = b.cuda(non_blocking=True)
        g = b.cuda(0)
        h = b.cuda(device=0)
        i = torch.zeros(1, device="cuda:1").cuda(1)
        ''')
    assert new == textwrap.dedent('''\
        """Doc."""
        import torch
        ''') + DEFINITION + textwrap.dedent('''\
        a = torch.device(device.type)
        b = torch.zeros(2, device=f"{device.type}:0")
        c = b.to(device.type)
        d = torch.ones(1, device=f"{device.type}:{0}")
        e = b.to(device)
        f = b.to(device, non_blocking=True)
        g = b.to(torch.device(device.type, 0))
        h = b.to(device=torch.device(device.type, 0))
        i = torch.zeros(1, device=f"{device.type}:1").to(torch.device(device.type, 1))
        ''')
    assert unfixed == []
    scope = {}
    exec(new, scope)  # runs on kiln, the accelerator here
    assert {scope[n].device.type for n in "bcdefgh"} == {"kiln"} and scope["a"].type == "kiln"
    assert scope["i"].device == torch.device("kiln", 1)  # kiln:1, as cuda:1 would be


def test_torch_cuda_calls_amp_and_nccl_through_aliases():
    new, unfixed = rewrite('''\
        import torch as th
        import torch.distributed as dist
        from torch.cuda.amp import autocast, GradScaler
        th.cuda.synchronize()
        n = th.cuda.device_count()
        th.cuda.manual_seed(1)
        free = th.cuda.mem_get_info(device=0)
        with autocast(True, th.bfloat16):
            pass
        with th.cuda.amp.autocast(enabled=False):
            pass
        scaler = GradScaler(2.0 ** 10, enabled=True)
        dist.init_process_group(backend="nccl")
        ''')
    assert new.splitlines()[3:] == [
        'device = th.accelerator.current_accelerator() or th.device("cpu")  '
        '# kiln-audit --fix: CUDA, kiln, ... or the CPU',
        "th.accelerator.synchronize()",
        "n = th.accelerator.device_count()",
        "th.manual_seed(1)",
        "free = th.cuda.mem_get_info(device=0)",
        "with th.autocast(device_type=device.type, enabled=True, dtype=th.bfloat16):",
        "    pass",
        "with th.autocast(device_type=device.type, dtype=th.float16, enabled=False):",
        "    pass",
        "scaler = th.amp.GradScaler(device.type, 2.0 ** 10, enabled=True)",
        "dist.init_process_group(backend=dist.get_default_backend_for_device(device))"]
    assert unfixed == [(7, "torch-cuda",
                        "torch.accelerator.get_memory_info takes positional arguments only")]


def test_a_file_that_binds_device_gets_another_name_and_needs_import_torch():
    new, _ = rewrite('''\
        #!/usr/bin/env python
        # a script with no imports of its own at the top
        def run(device="cuda"):
            return device
        ''')
    assert new == textwrap.dedent('''\
        #!/usr/bin/env python
        # a script with no imports of its own at the top
        import torch
        accelerator = torch.accelerator.current_accelerator() or torch.device("cpu")  # kiln-audit --fix: CUDA, kiln, ... or the CPU
        def run(device=accelerator.type):
            return device
        ''')


def test_positions_are_characters_crlf_and_no_final_newline_are_kept(tmp_path):
    text = 'import torch\r\nx = ("\u00e9\u00e9", torch.ones(1).cuda())\r\ny = "cuda"'
    new, fixed, _, _ = fix_source(text, "/p.py")
    assert new == ('import torch\r\n' + DEFINITION.replace("\n", "\r\n")
                   + 'x = ("\u00e9\u00e9", torch.ones(1).to(device))\r\ny = device.type')
    (tmp_path / "p.py").write_bytes(text.encode())
    result = make_fix([str(tmp_path / "p.py")], str(tmp_path))
    (tmp_path / "fix.diff").write_bytes(result.diff.encode())
    subprocess.run(["patch", "-p1", "-s", "-i", "fix.diff"], cwd=tmp_path, check=True, timeout=30)
    assert (tmp_path / "p.py").read_bytes() == new.encode()


def test_decisions_are_listed_not_rewritten():
    new, unfixed = rewrite('''\
        import torch
        torch.backends.cuda.matmul.allow_tf32 = True
        if x.device.type == "cuda":
            torch.cuda.nvtx.range_push("a")
        ''')
    assert new == textwrap.dedent('''\
        import torch
        torch.backends.cuda.matmul.allow_tf32 = True
        if x.device.type == "cuda":
            torch.cuda.nvtx.range_push("a")
        ''')
    assert [(line, category) for line, category, _ in unfixed] == [
        (2, "cuda-setting"), (3, "cuda-branch"), (4, "nvtx")]
    assert unfixed[1][2].endswith('for "any accelerator", write `x.device.type != "cpu"`')


def test_syntax_error_script_is_reported_and_not_patched(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("import torch\nmodel = torch.nn.Linear(2, 2).cuda()\ndef oops(:\n    pass\n")
    diff_path = tmp_path / "fix.diff"
    result, report = run_audit_json(tmp_path, "--fix", str(diff_path), str(script))
    assert result.returncode == 1  # not run: a syntax error
    assert {(f["line"], f["category"]) for f in report["findings"]} == {
        (3, "syntax-error"), (2, "dot-cuda")}
    diff = diff_path.read_text()
    assert "\n--- " not in diff and "0 finding(s) rewritten in 0 file(s)" in diff
    assert ("# not patched: broken.py: SyntaxError at line 3 (invalid syntax): a file that "
            "does not parse cannot be rewritten safely") in diff
    assert "broken.py:2: dot-cuda" in diff


def test_files_outside_the_users_tree_are_never_patched(tmp_path):
    app, elsewhere = tmp_path / "app", tmp_path / "elsewhere"
    app.mkdir()
    elsewhere.mkdir()
    (elsewhere / "helper.py").write_text("import torch\nx = torch.ones(1).cuda()\n")
    os.symlink(elsewhere / "helper.py", app / "helper.py")  # a link out of the tree
    (app / "main.py").write_text("import helper\nimport torch\ny = torch.ones(1).cuda()\n")
    result = run_audit("--no-run", "--fix", "-", str(app / "main.py"))
    assert result.returncode == 0, result.stderr
    assert "+++ b/main.py" in result.stdout and "b/helper.py" not in result.stdout
    # A script given outside --root: read and reported, not patched.
    result = run_audit("--no-run", "--root", str(app), "--fix", "-", str(elsewhere / "helper.py"))
    assert result.returncode == 0, result.stderr
    assert "\n--- " not in result.stdout
    assert f"# not patched: {os.path.realpath(elsewhere / 'helper.py')}: outside the user's tree" \
        in result.stdout
    assert (elsewhere / "helper.py").read_text() == "import torch\nx = torch.ones(1).cuda()\n"


def test_a_fix_path_that_is_a_python_file_is_refused(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\nx = torch.ones(1).cuda()\n")
    for args in (["--fix", str(script)], ["--fix", str(tmp_path / "out.py"), str(script)]):
        result = run_audit(*args)
        assert result.returncode == 2
        assert ("overwrite a Python file" in result.stderr
                or "got the script" in result.stderr), result.stderr
    assert script.read_text() == "import torch\nx = torch.ones(1).cuda()\n"
    assert not (tmp_path / "out.py").exists()


@pytest.mark.parametrize("option", ["--output", "--json", "--html"])
def test_a_report_path_that_is_the_script_or_a_python_file_is_refused(tmp_path, option):
    """--output, --json and --html onto the script overwrote it with the
    report (found by a fresh user); refused as --fix is, before anything
    runs."""
    script = tmp_path / "train.py"
    source = "import torch\nx = torch.ones(1).cuda()\n"
    script.write_text(source)
    for path in (script, tmp_path / "report.py"):
        result = run_audit("--no-run", option, str(path), str(script))
        assert result.returncode == 2
        assert f"{option} {str(path)!r}: that would overwrite a Python file" in result.stderr, \
            result.stderr
    assert script.read_text() == source
    assert not (tmp_path / "report.py").exists()


def test_storage_cuda_in_map_location_and_autocast_without_dtype(tmp_path, monkeypatch):
    """Two rewrites a fresh user found wrong: a storage's .to takes the
    device by keyword only (storage.to(device) raised TypeError), and
    torch.autocast("cuda") without a dtype runs float16 on CUDA but would
    have run bfloat16 on kiln and the CPU once rewritten."""
    source = textwrap.dedent("""\
        import torch
        a = torch.load("m.pt", map_location=lambda storage, loc: storage.cuda())
        b = torch.load("m.pt", map_location=lambda s, loc: s.cuda(0, non_blocking=True))
        c = torch.ones(1).cuda()
        with torch.autocast(device_type="cuda"):
            pass
        with torch.amp.autocast("cuda", enabled=True):
            pass
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pass
        """)
    new, _, _, skip = fix_source(source, "train.py")
    assert not skip
    body = new.split("\n", 2)[2]  # after the import and the added device line
    assert body == textwrap.dedent("""\
        a = torch.load("m.pt", map_location=lambda storage, loc: storage.to(device=device))
        b = torch.load("m.pt", map_location=lambda s, loc: s.to(device=torch.device(device.type, 0), non_blocking=True))
        c = torch.ones(1).to(device)
        with torch.autocast(device_type=device.type, dtype=torch.float16):
            pass
        with torch.amp.autocast(device.type, dtype=torch.float16, enabled=True):
            pass
        with torch.autocast(device.type, dtype=torch.bfloat16):
            pass
        """)
    # The patched program runs (storage.to(device) raised TypeError) and
    # loads onto the accelerator.
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.arange(3.0)}, "m.pt")
    scope = {}
    exec(compile(new, "train.py", "exec"), scope)
    for loaded in (scope["a"], scope["b"]):
        assert loaded["w"].device.type == scope["device"].type
        assert loaded["w"].cpu().tolist() == [0.0, 1.0, 2.0]


def test_fix_of_a_portable_program_changes_nothing():
    result = make_fix([fixture("portable_train.py")], FIXTURES)
    assert result.files == [] and result.fixed == [] and result.unfixed == []
    assert result.diff.endswith("# nothing to rewrite: no mechanical findings\n")


def test_extension_tree_patches_the_imported_module_too(tmp_path):
    shutil.copytree(fixture("extension"), tmp_path / "extension")
    result = run_audit("--no-run", "--fix", "-", str(tmp_path / "extension" / "ext_train.py"),
                       cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "+++ b/ext_helpers.py" in result.stdout and "+++ b/ext_train.py" in result.stdout
    assert "#   add_kernel.cu:1: cuda-extension [needs a kernel rewrite]" in result.stdout


def test_strings_that_are_names_among_names_are_listed_not_rewritten():
    new, unfixed = rewrite('''\
        import torch
        suffix = {"cuda": ".cubin"}["cuda"]
        has = hasattr(torch.version, "cuda")
        kinds = ["cuda", "mps"]
        nccl = backend == "nccl"
        ''')
    assert "device" not in new
    assert [(line, why.split(":")[0]) for line, _, why in unfixed] == [
        (2, "a dict key"), (2, "an index"), (3, "an attribute name, not a device"),
        (4, "one of a list of names"), (5, "a test for NCCL")]


def test_edits_are_checked_against_the_source_at_their_position():
    """ast's positions inside f-strings are not exact before Python 3.12, so
    every replaced node's text is compared with the node first."""
    new, unfixed = rewrite('''\
        import torch
        msg = f"on {torch.cuda.current_device()} of {torch.cuda.device_count()}"
        ''')
    assert unfixed == [] and new.endswith(
        'msg = f"on {torch.accelerator.current_device_index()} of '
        '{torch.accelerator.device_count()}"\n')
    from torch_kiln.audit.fix import _Source, _Unfixable

    source = _Source('x = "cuda"; y = torch.cuda.synchronize\n')
    tree = ast.parse(source.text)
    string, name = tree.body[0].value, tree.body[1].value
    assert source.span(string) == (4, 10) and source.span(name) == (16, 38)
    string.col_offset += 1  # a position that is off by one
    name.end_col_offset -= 1
    for node in (string, name):
        with pytest.raises(_Unfixable, match="source position is not exact"):
            source.span(node)


def test_fix_with_a_run_follows_the_scripts_output_on_stdout(tmp_path):
    script = tmp_path / "small.py"
    script.write_text("import torch\nx = torch.ones(2).cuda()\nprint('sum', x.sum().item())\n")
    result, report = run_audit_json(tmp_path, "--map-cuda", "--fix", "-", str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    output, diff = result.stdout.split("# kiln-audit --fix:", 1)
    assert output == "sum 2.0\n"
    assert "+x = torch.ones(2).to(device)\n" in diff
    assert report["run"]["exit_status"] == 0  # the report covers the run as before
    assert "kiln-audit --fix: wrote the diff to stdout: 1 finding(s) rewritten" in result.stderr


def test_a_file_not_in_plain_utf8_is_not_patched(tmp_path):
    script = tmp_path / "latin.py"
    script.write_bytes(b"# -*- coding: latin-1 -*-\nimport torch\nname = '\xe9'\n"
                       b"x = torch.ones(1).cuda()\n")
    result = make_fix([str(script)], str(tmp_path))
    assert result.files == [] and result.skipped == [
        (str(script), "encoded as iso-8859-1, not plain UTF-8: not patched")]
    assert "# not patched: latin.py: encoded as iso-8859-1" in result.diff


def test_an_output_path_in_a_missing_directory_is_a_usage_error_before_the_run(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    for option in ("--fix", "--json", "--html", "--output"):
        result = run_audit(option, str(tmp_path / "nope" / "out.txt"), str(script))
        assert result.returncode == 2 and result.stdout == ""  # not run
        assert f"{option} " in result.stderr and "does not exist" in result.stderr


def test_form_feeds_and_final_lines_survive_patch(tmp_path):
    text = "import torch\n\x0c\nx = torch.ones(1).cuda()  # \x0c page\ny = 'cuda'"
    (tmp_path / "ff.py").write_text(text)
    result = make_fix([str(tmp_path / "ff.py")], str(tmp_path))
    (tmp_path / "fix.diff").write_text(result.diff)
    subprocess.run(["patch", "-p1", "-s", "-i", "fix.diff"], cwd=tmp_path, check=True, timeout=30)
    assert (tmp_path / "ff.py").read_text() == fix_source(text, "ff.py")[0]
    assert (tmp_path / "ff.py").read_text().endswith("# \x0c page\ny = device.type")


def test_rewritten_calls_that_need_an_accelerator_are_named_and_behave_like_cudas(tmp_path):
    script = tmp_path / "sync.py"
    script.write_text("import torch\nprint(torch.cuda.is_available())\ntorch.cuda.synchronize()\n"
                      "print('synced')\n")
    result = make_fix([str(script)], str(tmp_path))
    assert result.diff.splitlines()[2:4] == [
        "# rewritten, but raise without an accelerator, as the torch.cuda calls do without CUDA "
        "(guard them with torch.accelerator.is_available() to run on a CPU-only PyTorch too):",
        "#   sync.py:3 torch.accelerator.synchronize"]
    (tmp_path / "fix.diff").write_text(result.diff)
    subprocess.run(["patch", "-p1", "-s", "-i", "fix.diff"], cwd=tmp_path, check=True, timeout=30)
    assert python(str(script)) == "True\nsynced\n"  # kiln
    cpu = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, **CPU_ONLY))
    # As torch.cuda.synchronize() fails without CUDA, with a clear error.
    assert cpu.returncode == 1 and cpu.stdout == "False\n"
    assert "Cannot access accelerator device when none is available" in cpu.stderr
