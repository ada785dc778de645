"""The result of one conformance case, and helpers to produce it.

A case is one sample of one op (or module) in one dtype and one pass. Its
status is "passed", "failed", "skipped" or "xfailed" (failed where PyTorch's
own database expects this test to fail). Workers stream results as JSON
lines; the driver aggregates them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

PASSED, FAILED, SKIPPED, XFAILED = "passed", "failed", "skipped", "xfailed"
STATUSES = (PASSED, FAILED, SKIPPED, XFAILED)


@dataclass
class CaseResult:
    """One case: `op` (op or module key), dtype name, pass, sample index."""

    op: str
    dtype: str
    pass_name: str
    index: int
    status: str
    message: str = ""
    # Forward passes: ATen ops that forced a host-device synchronization.
    sync_ops: dict[str, int] = field(default_factory=dict)
    # Failures only: a description of the sample, for reproducing.
    sample: str = ""
    # Cases reported as a block (a skipped test): how many cases this is.
    count: int = 1

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v or k in ("index", "status")}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "CaseResult":
        return cls(**data)


Emit = Callable[[CaseResult], None]


class CaseFailed(Exception):
    """Ends a case as failed with the given one-line message."""


class CaseSkipped(Exception):
    """Ends a case as skipped with the given one-line reason."""


def first_line(text: str, limit: int = 300) -> str:
    """The first non-blank line of `text`, at most `limit` characters."""
    for line in str(text).splitlines():
        if line.strip():
            line = line.strip()
            return line if len(line) <= limit else line[:limit - 3] + "..."
    return ""


def describe_error(error: BaseException) -> str:
    """'TypeName: first line of the message'."""
    return f"{type(error).__name__}: {first_line(str(error))}"
