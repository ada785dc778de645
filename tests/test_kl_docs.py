"""docs/kernels.md's kl.op example runs as written (a fresh user found the
earlier one called kernels it never defined): the snippet is cut from the
document, saved as a file (kl reads kernel source) and run in a fresh
process, then its gradient is checked against PyTorch's.
"""

import os
import re
import subprocess
import sys
import textwrap

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                   "kernels.md")


def section_snippet(heading: str) -> str:
    """The first ```python block after ``heading`` in docs/kernels.md."""
    with open(DOC) as f:
        text = f.read()
    start = text.index(heading)
    match = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert match, f"no python block after {heading!r}"
    return match.group(1)


def test_the_kl_op_example_runs_as_written(tmp_path):
    snippet = section_snippet("## Autograd for kl kernels")
    check = textwrap.dedent("""
        expected = 1.5 * (1 - torch.tanh(1.5 * x.detach().cpu()) ** 2)
        torch.testing.assert_close(x.grad.cpu(), expected)
        print("ok")
    """)
    path = tmp_path / "snippet.py"
    path.write_text(snippet + check)
    env = dict(os.environ, KILN_KERNELS_CACHE_DIR=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                            timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
