"""Report writers: the text report (grouped by category, with counts and
each item's effort), the JSON document (schema in docs/audit.md) and a
one-page HTML report."""

from __future__ import annotations

import json
import os

from torch_kiln.audit import catalog
from torch_kiln.audit.findings import EFFORTS, ON_KILN, Report

__all__ = ["format_text", "write_json", "format_html", "write_html"]


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


_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .6em 0; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } code, pre { font: 13px ui-monospace, monospace; }
.fails { color: #a00; } .silently { color: #a60; } .slower { color: #666; } .works { color: #070; }
"""


def format_html(report: Report) -> str:
    """The report as one self-contained HTML page (no scripts, no external
    files): the run, the totals, then each category's items in a table."""
    from html import escape

    summary = report.summary()
    rows = [f"<h1>Kiln lock-in audit of <code>{escape(_display(report.target))}</code></h1>",
            f"<p>{escape(_run_line(report))}</p>"]
    if report.files_scanned:
        rows.append("<p>Files read: " + ", ".join(
            f"<code>{escape(_display(f))}</code>" for f in report.files_scanned) + "</p>")
    if not report.findings:
        rows.append("<p>No findings: nothing in this program ties it to CUDA.</p>")
    else:
        rows.append("<table><tr><th>category</th><th>items</th>" + "".join(
            f"<th>{escape(e)}</th>" for e in EFFORTS) + "</tr>")
        for name, findings in report.by_category().items():
            efforts = [sum(f.effort == e for f in findings) for e in EFFORTS]
            rows.append(f"<tr><td><a href='#{escape(name)}'>{escape(name)}</a></td>"
                        f"<td>{len(findings)}</td>" + "".join(
                            f"<td>{n or ''}</td>" for n in efforts) + "</tr>")
        rows.append(f"<tr><th>total</th><th>{summary['findings']}</th>" + "".join(
            f"<th>{summary['by_effort'].get(e, '')}</th>" for e in EFFORTS) + "</tr></table>")
        for name, findings in report.by_category().items():
            title = catalog.CATEGORIES[name].title if name in catalog.CATEGORIES else name
            rows.append(f"<h2 id='{escape(name)}'>{escape(name)}: {escape(title)} "
                        f"({len(findings)})</h2>")
            rows.append("<table><tr><th>where</th><th>severity</th><th>on kiln</th>"
                        "<th>effort</th><th>count</th><th>what</th><th>fix</th></tr>")
            for f in findings:
                where = _display(f.file) + (f":{f.line}" if f.line is not None else "")
                code = f"<br><code>{escape(f.code)}</code>" if f.code else ""
                rows.append(
                    f"<tr><td><code>{escape(where)}</code></td><td>{escape(f.severity)}</td>"
                    f"<td class='{escape(f.on_kiln.split()[0])}'>{escape(f.on_kiln)}</td>"
                    f"<td>{escape(f.effort)}</td><td>{f.count}</td>"
                    f"<td>{escape(f.message)}{code}</td><td>{escape(f.replacement)}</td></tr>")
            rows.append("</table>")
    body = "\n".join(rows)
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>Kiln lock-in audit: {escape(os.path.basename(report.target))}</title>"
            f"<style>{_CSS}</style></head><body>\n{body}\n</body></html>\n")


def write_html(report: Report, path: str) -> None:
    """Writes :func:`format_html` to ``path``."""
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(format_html(report))
