"""Report writers: the text report (grouped by category, with counts and
each item's effort) and the JSON document (schema in docs/audit.md)."""

from __future__ import annotations

import json
import os

from torch_kiln.audit import catalog
from torch_kiln.audit.findings import EFFORTS, ON_KILN, Report

__all__ = ["format_text", "write_json"]


def _display(path: str | None) -> str:
    if path is None:
        return "?"
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _run_line(report: Report) -> str:
    run = report.run
    if run is None:
        return "not run" + (f" ({report.not_run_reason})" if getattr(report, "not_run_reason", "")
                            else "")
    mode = "with --map-cuda" if run.get("map_cuda") else "as written (no --map-cuda)"
    if run.get("interrupted"):
        outcome = "interrupted (Ctrl-C), ended"
    elif run.get("timed_out"):
        outcome = f"timed out after {run.get('timeout')} s, ended"
    elif run.get("signal"):
        outcome = f"killed by {run['signal']}"
    else:
        outcome = f"exit status {run.get('exit_status')}"
    return f"ran on kiln {mode}: {outcome}, {run.get('seconds', 0):.1f} s"


def format_text(report: Report) -> str:
    """The human-readable report, as printed after the run."""
    out = [f"Kiln lock-in audit of {_display(report.target)}", f"  {_run_line(report)}"]
    if report.files_scanned:
        out.append("  files read: " + ", ".join(_display(f) for f in report.files_scanned))
    if report.run and report.run.get("sync_ops"):
        ops = ", ".join(f"{op} x{n}" for op, n in report.run["sync_ops"].items())
        out.append(f"  kiln sync ops in the run: {ops}")
    summary = report.summary()
    out.append("")
    if not report.findings:
        out.append("No findings: nothing in this program ties it to CUDA.")
        return "\n".join(out) + "\n"
    effort = summary["by_effort"]
    plural = {"mechanical": "mechanical", "needs a decision": "need a decision",
              "needs a kernel rewrite": "need a kernel rewrite"}
    out.append(f"{_plural(summary['findings'], 'finding')}: " + ", ".join(
        f"{effort[e]} {e if effort[e] == 1 else plural[e]}" for e in EFFORTS if e in effort))
    on_kiln = summary["by_on_kiln"]
    out.append("  on kiln today: " + ", ".join(f"{on_kiln[o]} {o}" for o in ON_KILN
                                               if o in on_kiln))
    for name, findings in report.by_category().items():
        title = catalog.CATEGORIES[name].title if name in catalog.CATEGORIES else name
        out.append("")
        out.append(f"{name}: {title} ({len(findings)})")
        for f in findings:
            times = f", {f.count} times" if f.count > 1 else ""
            where = _display(f.file) + (f":{f.line}" if f.line is not None else "")
            out.append(f"  {where}  [{f.severity}; {f.on_kiln}; {f.effort}{times}]")
            if f.code:
                out.append(f"      {f.code}")
            out.append(f"      {f.message}")
            out.append(f"      fix: {f.replacement}")
    return "\n".join(out) + "\n"


def write_json(report: Report, path: str) -> None:
    """Writes :meth:`Report.to_dict` to ``path`` (``-`` for stdout)."""
    text = json.dumps(report.to_dict(), indent=2, default=str) + "\n"
    if path == "-":
        import sys

        sys.stdout.write(text)
        return
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
