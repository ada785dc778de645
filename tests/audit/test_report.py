"""The report writers (torch_kiln/audit/report.py): text grouped by category
with counts and effort, JSON round trip, one-page HTML with everything
escaped."""

import html.parser
import json

from audit_helpers import fixture

from torch_kiln.audit.findings import Finding, Report
from torch_kiln.audit.report import format_html, format_text, write_json
from torch_kiln.audit.static import scan_program, scan_source


def static_report(name):
    findings, scanned = scan_program(fixture(name))
    return Report(target=fixture(name), argv=[], findings=findings, files_scanned=scanned,
                  not_run_reason="--no-run")


def test_text_groups_by_category_with_counts_and_effort():
    text = format_text(static_report("cuda_misc.py"))
    assert "13 findings: 7 mechanical, 5 need a decision, 1 needs a kernel rewrite" in text
    assert "\ncuda-graphs: CUDA graphs (2)\n" in text
    assert "cuda_misc.py:29  [high; fails; needs a decision]" in text
    assert text.index("\ndevice-string:") < text.index("\ncuda-library:")  # catalog order


def test_text_for_a_portable_program():
    assert "No findings: nothing in this program ties it to CUDA." in format_text(
        static_report("portable_train.py"))


def test_json_round_trip(tmp_path):
    report = static_report("cuda_amp.py")
    write_json(report, str(tmp_path / "r.json"))
    data = json.loads((tmp_path / "r.json").read_text())
    assert [Finding.from_dict(f) for f in data["findings"]] == report.by_category_flat()
    assert data["summary"]["findings"] == len(report.findings) == 4


def test_html_is_one_page_with_every_finding_escaped():
    findings, _ = scan_source('import torch\nif "<b>" and x.device.type == "cuda": pass\n',
                              "/p<1>.py")
    page = format_html(Report(target="/p<1>.py", argv=[], findings=findings))
    assert "<b>" not in page and "&lt;b&gt;" in page and "/p&lt;1&gt;.py" in page
    assert "cuda-branch" in page and "<script" not in page
    html.parser.HTMLParser().feed(page)  # parses
