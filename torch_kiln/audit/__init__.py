"""The CUDA lock-in audit (issue 15): run a program written for CUDA on kiln
and get the inventory of what ties it to CUDA, with the portable fixes.

From the shell::

    python -m torch_kiln.audit [--map-cuda] [--timeout S] [--json PATH] [--html PATH] script.py [args]
    kiln-audit ...                                  # the same, as a console script
    kiln-audit --no-run --fix fix.diff train.py     # a patch for the mechanical findings

From Python::

    from torch_kiln.audit import audit, audit_script
    report = audit(train_one_epoch, model, loader)      # in this process
    report = audit_script("train.py", ["--epochs", "1"], map_cuda=True)
    for finding in report.findings:
        print(finding.location, finding.category, finding.on_kiln, finding.replacement)
    diff = make_fix(report.files_scanned, "project/", report.findings).diff   # --fix

The package: :mod:`.findings` (the data model), :mod:`.catalog` (categories
and known CUDA APIs), :mod:`.static` (the ``ast`` reader), :mod:`.mapping`
(``--map-cuda``), :mod:`.tracer` (run-time recording), :mod:`.runner` and
:mod:`.child` (the script's own process), :mod:`.replay` (a failed op
replayed on the CPU), :mod:`.fix` (``--fix``'s diff), :mod:`.report` (text,
JSON, HTML), :mod:`.cli`. The JSON schema and a worked example: docs/audit.md.
"""

from torch_kiln.audit.api import AuditError, audit, audit_script
from torch_kiln.audit.findings import Finding, Report
from torch_kiln.audit.fix import FixResult, make_fix

__all__ = ["audit", "audit_script", "make_fix", "AuditError", "Finding", "FixResult", "Report"]
