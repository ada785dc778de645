"""Declared differences: tolerances and skips that kiln's design justifies.

Kiln runs CPU's kernels, so the default comparison is bit-exact. An entry
here says why an op may legitimately differ from CPU (it is not a kiln bug),
and what the harness does instead. Keys are (op, dtype, pass); None matches
any dtype or pass. Real kiln bugs do not belong here: they go in
known_failures.txt until fixed.
"""

from __future__ import annotations

from compare import Tolerance

_RNN_CPU_BRANCH = (
    "ATen's RNN layer (RNN.cpp FullLayer) precomputes the input projection for all time "
    "steps only when input.is_cpu(); kiln takes the per-step branch, so weight_ih/bias_ih "
    "gradients are summed in another order")
_RNN_FUSED_CELLS = (
    "ATen's LSTM/GRU layers and cells (RNN.cpp) hand every non-CPU device to the fused cells "
    "_thnn_fused_lstm_cell/_thnn_fused_gru_cell, which kiln implements with CUDA's math "
    "(RecurrentCells.cc): the biases are added after the matrix products, where CPU's unfused "
    "cell adds them inside, and the layers take the per-step branch (see the RNN reason): "
    "last-bit differences")
_LSTM_PROJECTIONS = (
    "A float32 LSTM takes CPU's oneDNN path on kiln (OneDnnLstm.cc) and gives CPU's bits, "
    "except with projections (proj_size), which CPU's oneDNN path does not take either: "
    "there ATen hands kiln to the fused cells (see the fused-cells reason)")
_LCE_AUTO_POLICY = (
    "F.linear_cross_entropy resolves acc_policy='auto' per device type "
    "(linear_cross_entropy_options._AUTO_DEFAULTS has 'accurate' for cpu, the 'compact' "
    "fallback elsewhere), so kiln computes float16/bfloat16 with another accumulation policy")

_LSTSQ_NONDETERMINISTIC = (
    "MKL's gelsy, CPU's default linalg.lstsq driver, is not deterministic on the CPU itself "
    "(the same call gives other last bits run to run, without kiln loaded)")

# (op, dtype name or None, pass or None) -> (tolerance, reason)
TOLERANCES: dict[tuple[str, str | None, str | None], tuple[Tolerance, str]] = {
    ("nn.RNN.train_mode", None, "modules"): (Tolerance(atol=1e-5, rtol=1e-5), _RNN_CPU_BRANCH),
    ("nn.RNN.eval_mode", None, "modules"): (Tolerance(atol=1e-5, rtol=1e-5), _RNN_CPU_BRANCH),
}
for _module in ("nn.LSTM.train_mode", "nn.LSTM.eval_mode", "nn.GRU.train_mode",
                "nn.GRU.eval_mode", "nn.LSTMCell", "nn.GRUCell"):
    for _dtype, _tol in (("float32", 1e-5), ("float64", 1e-12)):
        _reason = (_LSTM_PROJECTIONS if _module.startswith("nn.LSTM.") and _dtype == "float32"
                   else _RNN_FUSED_CELLS)
        TOLERANCES[(_module, _dtype, "modules")] = (Tolerance(atol=_tol, rtol=_tol), _reason)
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
