"""Which cases of a large parametrized test run in `make test` (the quick
shard) and which only in `make test-full` (marker `slow`).

`make test` should stay near 15 minutes on the 2-core CI machine. A test
parametrized over cases x dtypes x devices runs every combination in
`make test-full`; in `make test` each case runs once, with the dtype and
device combinations taken in turn, so every case, every dtype and every
device still runs there.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Sequence

import pytest


def rotate(cases: Iterable[Any], *axes: Sequence[Any], per_case: int = 1) -> list[Any]:
    """``pytest.param(*case, *combination)`` for every case and every
    combination of ``axes`` (a case is a value or a tuple of values). All
    but ``per_case`` combinations per case are marked slow; the kept ones
    advance from case to case (case i keeps combinations i * per_case to
    i * per_case + per_case - 1, modulo their number). Use with
    ``parametrize("case_args..., axis_args...")``."""
    combinations = list(itertools.product(*axes))
    params = []
    for i, case in enumerate(cases):
        values = case if isinstance(case, tuple) else (case,)
        kept = {(i * per_case + k) % len(combinations) for k in range(per_case)}
        for j, combination in enumerate(combinations):
            marks = () if j in kept else (pytest.mark.slow,)
            params.append(pytest.param(*values, *combination, marks=marks))
    return params
