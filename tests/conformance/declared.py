"""Declared differences: tolerances and skips that kiln's design justifies.

Kiln runs CPU's kernels, so the default comparison is bit-exact. An entry
here says why an op may legitimately differ from CPU (it is not a kiln bug),
and what the harness does instead. Keys are (op, dtype, pass); None matches
any dtype or pass. Real kiln bugs do not belong here: they go in
known_failures.txt until fixed.
"""

from __future__ import annotations

from compare import Tolerance

# (op, dtype name or None, pass or None) -> (tolerance, reason)
TOLERANCES: dict[tuple[str, str | None, str | None], tuple[Tolerance, str]] = {}

# (op, dtype name or None, pass or None) -> reason
SKIPS: dict[tuple[str, str | None, str | None], str] = {}


def _lookup(table: dict, op: str, dtype: str, pass_name: str):
    for key in ((op, dtype, pass_name), (op, dtype, None), (op, None, pass_name),
                (op, None, None)):
        if key in table:
            return table[key]
    return None


def declared_tolerance(op: str, dtype: str, pass_name: str) -> Tolerance | None:
    """The tolerance declared for this op, dtype and pass, if any."""
    entry = _lookup(TOLERANCES, op, dtype, pass_name)
    return entry[0] if entry else None


def declared_skip(op: str, dtype: str, pass_name: str) -> str | None:
    """The reason this op, dtype and pass is skipped, if it is."""
    return _lookup(SKIPS, op, dtype, pass_name)
