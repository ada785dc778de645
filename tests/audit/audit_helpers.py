"""Shared helpers of the audit tests (tests/audit/): run the audit command,
and read the ``# audit: <category>`` markers planted in the fixtures."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import tokenize

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures")
DEVPATH = os.path.join(HERE, "devpath")

# The import shim of tests/audit/devpath/sitecustomize.py, in this process too.
_spec = importlib.util.spec_from_file_location("_kiln_audit_devpath",
                                               os.path.join(DEVPATH, "sitecustomize.py"))
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))

RUNTIME_CATEGORIES = {"sync", "op-failure", "dtype-change", "graph-break", "recompilation",
                      "run-failure"}
_MARKER = re.compile(r"(?:#|//)\s*audit:\s*([a-z0-9, -]+)$")


def fixture(name: str) -> str:
    return os.path.realpath(os.path.join(FIXTURES, name))


def planted(*paths: str) -> set[tuple[str, int, str]]:
    """``(file, line, category)`` for every ``# audit: a, b`` marker (``//``
    in .cu files) in ``paths``, read with Python's tokenizer for .py files."""
    expected = set()
    for path in paths:
        path = os.path.realpath(path)
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        if path.endswith(".py"):
            comments = [(t.start[0], t.string) for t in
                        tokenize.generate_tokens(io.StringIO(text).readline)
                        if t.type == tokenize.COMMENT]
        else:
            comments = [(i, line[line.find("//"):].strip()) for i, line in
                        enumerate(text.splitlines(), 1) if "//" in line]
        for line, comment in comments:
            match = _MARKER.search(comment.strip())
            if match:
                for category in match.group(1).split(","):
                    expected.add((path, line, category.strip()))
    return expected


def found(findings, source: str | None = None) -> set[tuple[str, int, str]]:
    """``(file, line, category)`` of findings (dicts or Finding objects)."""
    result = set()
    for f in findings:
        f = f if isinstance(f, dict) else f.to_dict()
        if source is None or f["source"] == source:
            result.add((f["file"], f["line"], f["category"]))
    return result


def audit_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([DEVPATH] + [p for p in
                                         env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_audit(*args: str, timeout: float = 90, cwd: str | None = None):
    """``python -m torch_kiln.audit args...``; returns the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "torch_kiln.audit", *args], env=audit_env(),
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def run_audit_json(tmp_path, *args: str, timeout: float = 90):
    """Runs the audit with ``--json`` and returns ``(CompletedProcess, report dict)``."""
    path = os.path.join(str(tmp_path), "report.json")
    result = run_audit("--json", path, *args, timeout=timeout)
    assert os.path.exists(path), (result.returncode, result.stderr[-3000:])
    with open(path, encoding="utf-8") as handle:
        return result, json.load(handle)
