"""Declared differences: tolerances and skips that kiln's design justifies.

Kiln runs CPU's kernels, so the default comparison is bit-exact. An entry
here says why an op may legitimately differ from CPU (it is not a kiln bug),
and what the harness does instead. Keys are (op, dtype, pass); None matches
any dtype or pass. Real kiln bugs do not belong here: they go in
known_failures.txt until fixed.
"""

from __future__ import annotations

from compare import Tolerance

_LCE_AUTO_POLICY = (
    "F.linear_cross_entropy resolves acc_policy='auto' per device type "
    "(linear_cross_entropy_options._AUTO_DEFAULTS has 'accurate' for cpu, the 'compact' "
    "fallback elsewhere), so kiln computes float16/bfloat16 with another accumulation policy")

_LSTSQ_NONDETERMINISTIC = (
    "MKL's gelsy, CPU's default linalg.lstsq driver, is not deterministic on the CPU itself "
    "(the same call gives other last bits run to run, without kiln loaded)")

# (op, dtype name or None, pass or None) -> (tolerance, reason)
TOLERANCES: dict[tuple[str, str | None, str | None], tuple[Tolerance, str]] = {}
for _op in ("linalg.lstsq", "linalg.lstsq.grad_oriented"):
    for _dtype, _tol in (("float32", 1e-4), ("complex64", 1e-4), ("float64", 1e-10)):
        TOLERANCES[(_op, _dtype, None)] = (Tolerance(atol=_tol, rtol=_tol),
                                           _LSTSQ_NONDETERMINISTIC)
for _variant in ("chunked", "chunked_none"):
    for _pass in ("forward", "noncontiguous"):
        TOLERANCES[(f"nn.functional.linear_cross_entropy.{_variant}", "float16", _pass)] = (
            Tolerance(atol=1e-2, rtol=1e-2), _LCE_AUTO_POLICY)
        TOLERANCES[(f"nn.functional.linear_cross_entropy.{_variant}", "bfloat16", _pass)] = (
            Tolerance(atol=5e-2, rtol=5e-2), _LCE_AUTO_POLICY)

# (op, dtype name or None, pass or None) -> reason
SKIPS: dict[tuple[str, str | None, str | None], str] = {
    ("nn.functional.grid_sample", "float16", None): (
        "CPU's own grid_sampler_2d is non-deterministic for float16/bfloat16 in torch 2.13 "
        "(two CPU calls on the same inputs differ, without kiln loaded)"),
    ("nn.functional.grid_sample", "bfloat16", None): (
        "CPU's own grid_sampler_2d is non-deterministic for float16/bfloat16 in torch 2.13 "
        "(two CPU calls on the same inputs differ, without kiln loaded)"),
    ("normal", None, "out"): (
        "CPU's normal(Tensor mean, float std, out=empty) fails to resize the empty out "
        "(size mismatch error) where kiln resizes it from the meta kernel first, as the "
        "meta kernel says it should"),
}

# Ops PyTorch's database skips in TestCommon.test_compare_cpu as
# "non-deterministic" because they draw random numbers. Kiln's generator is
# CPU's Mersenne Twister and both sides are seeded alike before every call,
# so their results must match CPU's exactly: the harness runs them anyway.
# (empty, empty_like, new_empty, ... stay skipped: their values really are
# undefined.)
RANDOM_OPS_RUN_DESPITE_DATABASE_SKIP = frozenset({
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial",
    "normal", "normal.in_place", "uniform", "rand_like", "randint_like", "randn_like",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.feature_alpha_dropout.with_train", "nn.functional.rrelu",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
    "nn.functional.multi_head_attention_forward", "nn.functional.scaled_dot_product_attention",
    "pca_lowrank", "svd_lowrank",
})
RANDOM_OPS_REASON = ("kiln's generator reproduces CPU's sequence, so the database's "
                     "non-determinism skip is overridden")


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


def runs_despite_database_skip(op: str) -> bool:
    """True for random ops the harness compares although the database skips them."""
    return op in RANDOM_OPS_RUN_DESPITE_DATABASE_SKIP


def declared_skip(op: str, dtype: str, pass_name: str) -> str | None:
    """The reason this op, dtype and pass is skipped, if it is."""
    return _lookup(SKIPS, op, dtype, pass_name)
