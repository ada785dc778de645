"""The audit's data model: one :class:`Finding` per place that ties a program
to CUDA, and the :class:`Report` that collects them with the run's outcome.

Every finding carries four judgements, each from a closed vocabulary so that
reports from different programs can be compared and summed:

- ``severity``: how much it matters for a move off CUDA (:data:`SEVERITIES`).
- ``on_kiln``: what the unmodified line does on a machine with kiln and no
  CUDA (:data:`ON_KILN`): ``works``, ``slower``, ``silently different`` (runs,
  but not what the CUDA run did: a branch not taken, a setting ignored), or
  ``fails``.
- ``effort``: what making it portable costs (:data:`EFFORTS`): ``mechanical``
  (a rewrite a tool could do), ``needs a decision`` (someone has to choose the
  portable behaviour), ``needs a kernel rewrite`` (hand-written device code).
- ``category``: which kind of tie it is (a key of
  :data:`torch_kiln.audit.catalog.CATEGORIES`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Finding", "Report", "SEVERITIES", "ON_KILN", "EFFORTS", "SCHEMA"]

SEVERITIES = ("high", "medium", "low")
ON_KILN = ("works", "slower", "silently different", "fails")
EFFORTS = ("mechanical", "needs a decision", "needs a kernel rewrite")
SOURCES = ("static", "runtime")

# The version of the JSON document written by --json (docs/audit.md).
SCHEMA = "kiln-audit/1"


@dataclasses.dataclass
class Finding:
    """One place that ties the program to CUDA (or, for run-time findings,
    one thing the run on kiln showed).

    ``file`` is a path as given to or found by the audit (absolute for files
    it found itself); ``line`` is 1-based, or ``None`` when no line of the
    user's code is known (e.g. a crash of the interpreter). ``count`` is how
    many times the item happened (run-time findings) or 1.
    """

    category: str
    file: str | None
    line: int | None
    message: str
    replacement: str
    severity: str
    on_kiln: str
    effort: str
    source: str = "static"
    code: str = ""
    count: int = 1
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, allowed in (("severity", SEVERITIES), ("on_kiln", ON_KILN),
                              ("effort", EFFORTS), ("source", SOURCES)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"Finding.{name} is {value!r}; allowed: {', '.join(allowed)}")

    @property
    def location(self) -> str:
        """``file:line`` (or just ``file``, or ``"?"``)."""
        if self.file is None:
            return "?"
        return f"{self.file}:{self.line}" if self.line is not None else self.file

    def to_dict(self) -> dict[str, Any]:
        """The finding as the JSON object documented in docs/audit.md."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Finding":
        """Inverse of :meth:`to_dict` (unknown keys are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclasses.dataclass
class Report:
    """Everything one audit found, and how the audited run went.

    ``run`` is ``None`` when the program was not run (``--no-run``, a syntax
    error); otherwise a dict with ``exit_status`` (int, or ``None`` after a
    timeout), ``timed_out`` (bool), ``seconds`` (float, wall time),
    ``map_cuda`` (bool) and ``signal`` (the signal's name if the program
    died of one, else ``None``).
    """

    target: str
    argv: list[str]
    findings: list[Finding] = dataclasses.field(default_factory=list)
    run: dict[str, Any] | None = None
    files_scanned: list[str] = dataclasses.field(default_factory=list)
    not_run_reason: str = ""
    # audit(callable) only: the call's return value and the exception it raised.
    result: Any = dataclasses.field(default=None, repr=False, compare=False)
    error: BaseException | None = dataclasses.field(default=None, repr=False, compare=False)

    def by_category(self) -> dict[str, list[Finding]]:
        """Findings grouped by category, in catalog order."""
        from torch_kiln.audit.catalog import CATEGORIES

        order = {name: i for i, name in enumerate(CATEGORIES)}
        groups: dict[str, list[Finding]] = {}
        for finding in sorted(self.findings, key=lambda f: (order.get(f.category, len(order)),
                                                             f.file or "", f.line or 0)):
            groups.setdefault(finding.category, []).append(finding)
        return groups

    def summary(self) -> dict[str, Any]:
        """Counts of findings: total, by category, by effort, by on_kiln."""
        def count(key: str) -> dict[str, int]:
            counts: dict[str, int] = {}
            for finding in self.findings:
                counts[getattr(finding, key)] = counts.get(getattr(finding, key), 0) + 1
            return counts

        return {"findings": len(self.findings), "by_category": count("category"),
                "by_effort": count("effort"), "by_on_kiln": count("on_kiln"),
                "by_severity": count("severity")}

    def to_dict(self) -> dict[str, Any]:
        """The whole report as the JSON document documented in docs/audit.md."""
        return {"schema": SCHEMA, "target": self.target, "argv": list(self.argv),
                "run": self.run, "not_run_reason": self.not_run_reason,
                "files_scanned": list(self.files_scanned),
                "summary": self.summary(),
                "findings": [f.to_dict() for f in self.by_category_flat()]}

    def by_category_flat(self) -> list[Finding]:
        """All findings in report order (by category, then file and line)."""
        return [f for group in self.by_category().values() for f in group]
