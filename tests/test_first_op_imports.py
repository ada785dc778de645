"""A program's first eager ops on kiln do not import torch._dynamo, as on the
CPU (Note [Meta kernels without importing Dynamo] in
torch_kiln/_lazy_dynamo_disable.py), and torch.compile still works
afterwards, and before. Each case runs in a fresh interpreter, since the
import happens once per process."""

import pytest
from quick_shard import rotate

from conftest import run_python

# Eager work a training step does: elementwise ops of every type-promotion
# kind, reductions, matmul, softmax, a loss, backward, indexing, on kiln:N
# and on a side stream; every result checked against the CPU.
EAGER_OPS = """
import sys, torch

def step(device):
    torch.manual_seed(0)
    x = torch.randn(4, 5, device=device, requires_grad=True)
    i = torch.arange(20, device=device).reshape(4, 5)
    y = x + x * 2 - 1
    y = torch.where(y > 0, y.relu().sigmoid(), y.abs().exp())
    y = y + i / 3 + (i % 2 == 0)
    out = y @ y.T
    loss = torch.nn.functional.cross_entropy(out.softmax(-1), torch.tensor([0, 1, 2, 3], device=device))
    loss.backward()
    return [loss.detach(), out.detach(), x.grad, y[1:, ::2].sum(0), torch.cat([y, y]).mean()]

expected = step("cpu")
assert {check} is False or "torch._dynamo" not in sys.modules  # the CPU does not import it
for index in (0, 1):
    device = f"kiln:{{index}}"
    with torch.kiln.device(index):
        got = step(device)
        side = torch.kiln.Stream()
        with torch.kiln.stream(side):
            got_side = step(device)
        torch.kiln.synchronize()
    for a, b, c in zip(got, got_side, expected):
        assert a.device == torch.device(device), a.device
        torch.testing.assert_close(a.cpu(), c, rtol=0, atol=0)
        torch.testing.assert_close(b.cpu(), c, rtol=0, atol=0)
assert {check} is False or "torch._dynamo" not in sys.modules, "an eager op imported torch._dynamo"
print("EAGER_OK")
"""

COMPILE = """
import torch

def f(a, b):
    return (a + b).relu() * a.sigmoid() - b / 3

a = torch.randn(8, device="kiln:{index}")
b = torch.randn(8, device="kiln:{index}")
compiled = torch.compile(f, backend="{backend}")
torch.testing.assert_close(compiled(a, b).cpu(), f(a.cpu(), b.cpu()))
assert "torch._dynamo" in sys.modules
# The references' deferred Dynamo disable became PyTorch's own once Dynamo
# loaded, so eager ops from now on run exactly as without kiln's deferral.
from torch_kiln._lazy_dynamo_disable import _DisableOnceDynamoIsLoaded
inner = torch._refs.add.__wrapped__
fn = inner.__closure__[inner.__code__.co_freevars.index("fn")].cell_contents
torch.testing.assert_close((a + b).cpu(), a.cpu() + b.cpu())
assert not isinstance(fn.__dynamo_disable, _DisableOnceDynamoIsLoaded), fn.__dynamo_disable
print("COMPILE_OK")
"""


def test_the_references_are_patched():
    # What the subprocess tests rely on: the wrapper's shape is the one
    # _lazy_dynamo_disable knows, and torch._refs.add's cache is pre-filled.
    r = run_python(
        "import torch\n"
        "from torch_kiln import _lazy_dynamo_disable as m\n"
        "inner = torch._refs.add.__wrapped__\n"
        "fn = inner.__closure__[inner.__code__.co_freevars.index('fn')].cell_contents\n"
        "assert isinstance(fn.__dynamo_disable, m._DisableOnceDynamoIsLoaded)\n"
        "assert m.install() == 0  # idempotent: everything was patched at import\n"
    )
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("launch_blocking", ["0", "1"])
def test_eager_ops_do_not_import_dynamo(launch_blocking):
    r = run_python(EAGER_OPS.format(check=True), {"KILN_LAUNCH_BLOCKING": launch_blocking})
    assert r.returncode == 0, r.stderr
    assert "EAGER_OK" in r.stdout


@pytest.mark.parametrize("backend,index", rotate(["kiln", "inductor"], [0, 1]))
def test_compile_after_eager_ops(backend, index):
    r = run_python(EAGER_OPS.format(check=True) + COMPILE.format(index=index, backend=backend), timeout=600)
    assert r.returncode == 0, r.stderr
    assert "EAGER_OK" in r.stdout and "COMPILE_OK" in r.stdout


def test_compile_before_any_eager_op():
    r = run_python("import sys\n" + COMPILE.format(index=0, backend="kiln")
                   + EAGER_OPS.format(check=False), timeout=600)
    assert r.returncode == 0, r.stderr
    assert "COMPILE_OK" in r.stdout and "EAGER_OK" in r.stdout
