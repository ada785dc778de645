"""known_failures.txt: the checked-in list of cases that fail today.

One entry a line, fields separated by whitespace, the reason last:

    op                dtype    pass      samples  reason
    nn.functional.foo float32  forward   0-2,5    BUG: kiln ... (see ...)

`dtype`, `pass` and `samples` may be `*` (any). `samples` lists sample
indices (ranges allowed). Lines starting with # are comments.

A run fails on a failing case no entry lists (a new failure) and on an entry
that no longer fails (a listed sample that ran and passed or was skipped;
for `samples *`, an entry whose cases all ran without failing), so the list
only shrinks. Cases the run did not execute (other ops, quick mode's later
samples) say nothing about an entry.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

from outcomes import FAILED, CaseResult

ANY = "*"
Group = tuple[str, str, str]  # (op, dtype, pass)


@dataclass
class Entry:
    """One line of known_failures.txt."""

    op: str
    dtype: str
    pass_name: str
    samples: frozenset[int] | None  # None: any sample
    reason: str
    line: int = 0

    def matches_group(self, group: Group) -> bool:
        op, dtype, pass_name = group
        return (self.op == op and self.dtype in (ANY, dtype)
                and self.pass_name in (ANY, pass_name))

    def matches(self, group: Group, index: int) -> bool:
        return self.matches_group(group) and (self.samples is None or index in self.samples)

    def format(self) -> str:
        samples = ANY if self.samples is None else format_indices(self.samples)
        return f"{self.op}  {self.dtype}  {self.pass_name}  {samples}  {self.reason}"


def parse_indices(text: str) -> frozenset[int] | None:
    """'0-2,5' -> {0, 1, 2, 5}; '*' -> None."""
    if text == ANY:
        return None
    indices: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        indices.update(range(int(low), int(high or low) + 1))
    return frozenset(indices)


def format_indices(indices: frozenset[int] | set[int]) -> str:
    """{0, 1, 2, 5} -> '0-2,5'."""
    ordered = sorted(indices)
    parts, start = [], None
    for i, value in enumerate(ordered):
        if start is None:
            start = value
        if i + 1 == len(ordered) or ordered[i + 1] != value + 1:
            parts.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ",".join(parts)


def load(path: pathlib.Path) -> list[Entry]:
    """The entries of a known-failures file (none if it does not exist)."""
    if not path.exists():
        return []
    entries = []
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split(None, 4)
        if len(fields) < 5:
            raise ValueError(f"{path}:{number}: expected 'op dtype pass samples reason'")
        op, dtype, pass_name, samples, reason = fields
        entries.append(Entry(op, dtype, pass_name, parse_indices(samples), reason, number))
    return entries


@dataclass
class Ledger:
    """Which cases ran and which failed, per (op, dtype, pass) group."""

    ran: dict[Group, set[int]] = field(default_factory=dict)
    failed: dict[Group, dict[int, CaseResult]] = field(default_factory=dict)

    def add(self, result: CaseResult) -> None:
        group = (result.op, result.dtype, result.pass_name)
        indices = range(result.index, result.index + result.count)
        self.ran.setdefault(group, set()).update(indices)
        if result.status == FAILED:
            self.failed.setdefault(group, {})[result.index] = result


@dataclass
class Verdict:
    """New failures (no entry lists them) and stale entries (fixed)."""

    new_failures: list[CaseResult]
    stale: list[tuple[Entry, str]]  # entry, why it is stale
    known_failed_cases: int

    @property
    def ok(self) -> bool:
        return not self.new_failures and not self.stale


def judge(entries: list[Entry], ledger: Ledger) -> Verdict:
    """Compares the run with the list."""
    new, known = [], 0
    for group, failures in ledger.failed.items():
        for index, result in sorted(failures.items()):
            if any(e.matches(group, index) for e in entries):
                known += 1
            else:
                new.append(result)
    stale = []
    for entry in entries:
        groups = [g for g in ledger.ran if entry.matches_group(g)]
        if entry.samples is None:
            ran = sum(len(ledger.ran[g]) for g in groups)
            failing = sum(len(ledger.failed.get(g, {})) for g in groups)
            if ran and not failing:
                stale.append((entry, f"all {ran} cases ran without failing"))
            continue
        fixed = set()
        for g in groups:
            fixed |= (entry.samples & ledger.ran[g]) - set(ledger.failed.get(g, {}))
        if fixed:
            stale.append((entry, f"samples {format_indices(fixed)} no longer fail"))
    return Verdict(new, stale, known)


def updated(entries: list[Entry], ledger: Ledger) -> list[Entry]:
    """The list rewritten for this run: failing cases no entry lists are
    added (reason "TODO classify" unless an entry of the same op, dtype and
    pass has one), samples that ran without failing are removed, and what
    the run did not execute is kept as it was. Entries with a `*` are kept
    whole while they still match a failure, and dropped once stale."""
    stale = {id(entry) for entry, _ in judge(entries, ledger).stale}
    result: list[Entry] = []
    for entry in entries:
        group = (entry.op, entry.dtype, entry.pass_name)
        if ANY in group or entry.samples is None or group not in ledger.ran:
            if id(entry) not in stale:
                result.append(entry)
            continue
        failing = set(ledger.failed.get(group, {}))
        kept = (entry.samples - ledger.ran[group]) | (entry.samples & failing)
        if kept:
            result.append(Entry(*group, frozenset(kept), entry.reason))
    reasons = {(e.op, e.dtype, e.pass_name): e.reason for e in entries}
    for group, failures in sorted(ledger.failed.items()):
        missing = [i for i in failures if not any(e.matches(group, i) for e in result)]
        if missing:
            reason = reasons.get(group) or f"TODO classify: {failures[min(missing)].message}"
            result.append(Entry(*group, frozenset(missing), reason))
    return merge_groups(result)


def merge_groups(entries: list[Entry]) -> list[Entry]:
    """One entry per (op, dtype, pass, reason), sorted."""
    merged: dict[tuple[str, str, str, str], Entry] = {}
    for e in entries:
        key = (e.op, e.dtype, e.pass_name, e.reason)
        if key in merged and merged[key].samples is not None and e.samples is not None:
            merged[key].samples = merged[key].samples | e.samples
        elif key not in merged:
            merged[key] = Entry(e.op, e.dtype, e.pass_name, e.samples, e.reason)
    return sorted(merged.values(), key=lambda e: (e.op, e.pass_name, e.dtype))


def write(path: pathlib.Path, entries: list[Entry]) -> None:
    """Rewrites the file: its leading comment block, then the entries."""
    header = []
    if path.exists():
        for line in path.read_text().splitlines():
            if line.startswith("#") or not line.strip():
                header.append(line)
            else:
                break
    while header and not header[-1].strip():
        header.pop()
    body = [e.format() for e in entries]
    path.write_text("\n".join(header + [""] + body) + "\n")
