"""Inductor's caches for kiln graphs across processes:
torch.compiler.save_cache_artifacts() in one process,
load_cache_artifacts() in a fresh one with an empty cache directory, which
then hits the AOTAutograd and FX graph caches instead of compiling."""

import json

from conftest import run_python

PROGRAM = """
import json, sys, torch
from torch._dynamo.utils import counters
mode, blob = sys.argv[1], sys.argv[2]
if mode == "load":
    assert torch.compiler.load_cache_artifacts(open(blob, "rb").read()) is not None
def f(x, w):
    return (x @ w).relu().sum(1).sin() * 2
x = torch.randn(8, 16, device="kiln"); w = torch.randn(16, 4, device="kiln")
torch.testing.assert_close(torch.compile(f)(x, w), f(x, w))
if mode == "save":
    data, _ = torch.compiler.save_cache_artifacts()
    open(blob, "wb").write(data)
print(json.dumps({k: dict(counters[k]) for k in ("aot_autograd", "inductor")}))
"""


def test_cache_artifacts_move_kiln_graphs_to_a_fresh_process(tmp_path):
    blob = str(tmp_path / "artifacts.bin")
    outcomes = {}
    for mode in ("save", "load"):
        code = "import sys; sys.argv = ['x', %r, %r]\n" % (mode, blob) + PROGRAM
        result = run_python(code, {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"cache-{mode}")},
                            timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
        outcomes[mode] = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcomes["save"]["inductor"].get("fxgraph_cache_miss") == 1
    assert outcomes["load"]["aot_autograd"].get("autograd_cache_hit") == 1
    assert outcomes["load"]["inductor"].get("fxgraph_cache_hit") == 1
    assert "fxgraph_cache_miss" not in outcomes["load"]["inductor"]
