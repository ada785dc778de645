"""Totals of a conformance run: the JSON summary and docs/conformance.md.

`Tally` takes every CaseResult as it arrives and keeps counts (by pass, by
dtype, by op), the failures, the per-op synchronization record of the
forward passes, and the Ledger that known_failures.judge() reads.
"""

from __future__ import annotations

import collections
import datetime
import subprocess
from dataclasses import dataclass, field

import torch

import settings
from known_failures import Ledger, Verdict
from outcomes import FAILED, PASSED, SKIPPED, STATUSES, XFAILED, CaseResult

# ATen ops whose output shape or returned value depends on tensor values:
# synchronizing for them is expected (issue 6: a forward case may force a
# synchronization only when the op's output shape depends on data).
DATA_DEPENDENT_OPS = {
    "aten::nonzero", "aten::nonzero_static", "aten::argwhere", "aten::masked_select",
    "aten::unique_consecutive", "aten::unique_dim", "aten::unique_dim_consecutive",
    "aten::_unique", "aten::_unique2", "aten::_local_scalar_dense", "aten::item",
    "aten::equal", "aten::is_nonzero", "aten::allclose", "aten::bincount",
    "aten::repeat_interleave.Tensor", "aten::repeat_interleave.self_Tensor",
    "aten::_assert_async", "aten::_assert_async.msg",
    # Indexing with a boolean mask (nonzero inside).
    "aten::index.Tensor", "aten::index.Tensor_out",
}


LAYOUT_CHECK_SUFFIX = " (layout check)"


def _tagged_data_dependent(aten_op: str) -> bool:
    """Whether PyTorch tags the overload dynamic_output_shape or
    data_dependent_output (torch/_C/_tags: its output shape or value depends
    on tensor data, e.g. linalg_lstsq's residuals)."""
    namespace, _, rest = aten_op.partition("::")
    base, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), base)
        tags = getattr(packet, overload or "default").tags
    except (AttributeError, RuntimeError):
        return False
    return torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags


def is_data_dependent(aten_op: str) -> bool:
    return (aten_op in DATA_DEPENDENT_OPS or aten_op.split(".")[0] in DATA_DEPENDENT_OPS
            or _tagged_data_dependent(aten_op))


def sync_verdict(aten_ops: collections.Counter) -> str:
    """Why an op synchronized: 'yes' (data-dependent output), 'layout check'
    (kiln verifying a meta kernel's layout on the first call with a given
    input kind, once per process), or '**no**' (a sync to look at)."""
    if all(is_data_dependent(a) for a in aten_ops):
        return "yes"
    if all(is_data_dependent(a) or a.endswith(LAYOUT_CHECK_SUFFIX) for a in aten_ops):
        return "layout check"
    return "**no**"


def skip_category(message: str) -> str:
    """A skip message without its sample-specific details."""
    if message.startswith("CPU rejects"):
        return "CPU rejects the sample (and so does kiln)"
    if message.startswith("eager kiln rejects"):
        return "eager kiln rejects the sample (and so does the compiled op)"
    if message.startswith("sample generation failed"):
        return "sample generation failed on CPU"
    return message[:120]


@dataclass
class SyncRecord:
    """Forward-pass synchronizations of one op."""

    cases: int = 0
    synced_cases: int = 0
    aten_ops: collections.Counter = field(default_factory=collections.Counter)


@dataclass
class Tally:
    """Everything the summary and the report need, built case by case."""

    by_pass: dict[str, collections.Counter] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    by_dtype: dict[tuple[str, str], collections.Counter] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    by_op: dict[str, collections.Counter] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    failures: list[CaseResult] = field(default_factory=list)
    skip_reasons: collections.Counter = field(default_factory=collections.Counter)
    sync: dict[str, SyncRecord] = field(default_factory=lambda: collections.defaultdict(SyncRecord))
    ledger: Ledger = field(default_factory=Ledger)
    tests: set[tuple[str, str]] = field(default_factory=set)

    def add(self, result: CaseResult) -> None:
        n = result.count
        self.by_pass[result.pass_name][result.status] += n
        self.by_dtype[(result.dtype, result.pass_name)][result.status] += n
        self.by_op[result.op][result.status] += n
        self.tests.add((result.op, result.dtype))
        self.ledger.add(result)
        if result.status in (FAILED, XFAILED):
            self.failures.append(result)
        elif result.status == SKIPPED:
            self.skip_reasons[(result.pass_name, skip_category(result.message))] += n
        if result.pass_name in ("forward", "noncontiguous") and result.status in (PASSED, FAILED):
            record = self.sync[result.op]
            record.cases += 1
            if result.sync_ops:
                record.synced_cases += 1
                record.aten_ops.update(result.sync_ops)


def pass_rate(counts: collections.Counter) -> float | None:
    """passed / (passed + failed + xfailed); None when nothing ran."""
    ran = counts[PASSED] + counts[FAILED] + counts[XFAILED]
    return counts[PASSED] / ran if ran else None


def summary(tally: Tally, verdict: Verdict, *, runtime_s: float, quick: bool) -> dict:
    """The JSON summary: per pass passed/failed/skipped (and xfailed), rates."""
    total: collections.Counter = collections.Counter()
    result: dict = {}
    for name in settings.ALL_PASSES:
        counts = tally.by_pass.get(name, collections.Counter())
        total.update(counts)
        result[name] = {status: counts[status] for status in STATUSES}
        result[name]["pass_rate"] = pass_rate(counts)
    result["pass_rate"] = pass_rate(total)
    result["ops"] = len(tally.by_op)
    result["op_dtype_tests"] = len(tally.tests)
    result["new_failures"] = len(verdict.new_failures)
    result["known_failures_fixed"] = len(verdict.stale)
    result["known_failed_cases"] = verdict.known_failed_cases
    result["quick"] = quick
    result["runtime_s"] = round(runtime_s, 1)
    return result


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.2f}%"


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=settings.REPO,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(tally: Tally, verdict: Verdict, summary_data: dict, *, command: str,
             rebuilt_by: str | None = None) -> str:
    """docs/conformance.md. `rebuilt_by`: the command that rebuilt it from
    the records of the run `command` made."""
    rebuilt = f" (this page rebuilt from its records by `{rebuilt_by}`)" if rebuilt_by else ""
    lines = [
        "# Kiln conformance: PyTorch's OpInfo and ModuleInfo databases",
        "",
        "Every OpInfo in `op_db` and every ModuleInfo in `module_db` of PyTorch "
        f"{torch.__version__}, run on kiln and compared with the CPU — bit-exact unless a "
        "tolerance is declared in `tests/conformance/declared.py`. How the harness works: "
        "`tests/conformance/op_cases.py` (passes) and `suites.py` (how the databases' own "
        "skips apply).",
        "",
        f"Generated {datetime.date.today().isoformat()} at commit {_git_commit()} by "
        f"`{command}` in {summary_data['runtime_s'] / 60:.1f} min "
        f"({'quick' if summary_data['quick'] else 'full'} run){rebuilt}.",
        "",
        "## Totals",
        "",
        f"- ops and modules: {summary_data['ops']} ({summary_data['op_dtype_tests']} "
        "op×dtype tests)",
        f"- samples (forward cases): {sum(tally.by_pass['forward'].values())}",
        f"- pass rate: **{_rate(summary_data['pass_rate'])}** "
        "(passed / (passed + failed + xfailed); skipped cases excluded)",
        f"- failures not in `tests/conformance/known_failures.txt`: "
        f"{summary_data['new_failures']}; listed failures that now pass: "
        f"{summary_data['known_failures_fixed']}",
        "",
        "| pass | cases | passed | failed | xfailed | skipped | pass rate |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in settings.PASSES:
        c = tally.by_pass.get(name, collections.Counter())
        lines.append(f"| {name} | {sum(c.values())} | {c[PASSED]} | {c[FAILED]} | "
                     f"{c[XFAILED]} | {c[SKIPPED]} | {_rate(pass_rate(c))} |")
    lines += _dtype_table(tally) + _failure_table(tally) + _sync_section(tally)
    lines += _skip_table(tally)
    return "\n".join(lines) + "\n"


def _dtype_table(tally: Tally) -> list[str]:
    lines = ["", "## By dtype", "", "passed / failed (+xfailed) / skipped cases.", "",
             "| dtype | " + " | ".join(settings.PASSES) + " |",
             "|---|" + "---:|" * len(settings.PASSES)]
    dtypes = [settings.dtype_name(d) for d in settings.DTYPES]
    for dtype in dtypes:
        cells = []
        for name in settings.PASSES:
            c = tally.by_dtype.get((dtype, name), collections.Counter())
            cells.append(f"{c[PASSED]} / {c[FAILED] + c[XFAILED]} / {c[SKIPPED]}" if c else "—")
        lines.append(f"| {dtype} | " + " | ".join(cells) + " |")
    return lines


def _failure_table(tally: Tally) -> list[str]:
    lines = ["", "## Failing ops", ""]
    if not tally.failures:
        return lines + ["None."]
    groups: dict[tuple[str, str], list[CaseResult]] = collections.defaultdict(list)
    for f in tally.failures:
        groups[(f.op, f.pass_name)].append(f)
    lines += ["| op | pass | dtypes | failed cases | first error |", "|---|---|---|---:|---|"]
    for (op, pass_name), failures in sorted(groups.items()):
        dtypes = ", ".join(sorted({f.dtype for f in failures}))
        first = min(failures, key=lambda f: (f.dtype, f.index)).message.replace("|", "\\|")
        lines.append(f"| `{op}` | {pass_name} | {dtypes} | {len(failures)} | {first} |")
    return lines


def _sync_section(tally: Tally) -> list[str]:
    synced = {op: r for op, r in tally.sync.items() if r.synced_cases}
    asynchronous = sorted(op for op, r in tally.sync.items() if not r.synced_cases and r.cases)
    lines = ["", "## Synchronization (forward passes)", "",
             f"{len(asynchronous)} ops ran every forward case asynchronously; "
             f"{len(synced)} forced a host-device synchronization in at least one case "
             "(`torch.kiln.get_sync_ops()` while the kiln call ran). A sync is expected only "
             "where the output shape or value depends on data; \"layout check\" marks kiln "
             "verifying a meta kernel's output layout against the CPU kernel on the first call "
             "with a given kind of input (once per process, so a long program pays it once).",
             ""]
    if synced:
        lines += ["| op | synced cases | ATen ops that synchronized | data-dependent? |",
                  "|---|---:|---|---|"]
        for op, r in sorted(synced.items()):
            names = ", ".join(f"`{a}`×{n}" for a, n in r.aten_ops.most_common())
            lines.append(f"| `{op}` | {r.synced_cases} / {r.cases} | {names} | "
                         f"{sync_verdict(r.aten_ops)} |")
    lines += ["", "<details><summary>Ops that ran asynchronously</summary>", "",
              ", ".join(f"`{op}`" for op in asynchronous), "", "</details>"]
    return lines


def _skip_table(tally: Tally) -> list[str]:
    lines = ["", "## Skipped cases", "", "| pass | reason | cases |", "|---|---|---:|"]
    for (pass_name, reason), n in sorted(tally.skip_reasons.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {pass_name} | {reason.replace('|', '/')} | {n} |")
    return lines


# ---------------------------------------------------------------- the compiled pass

COMPILED_BEGIN = "<!-- compiled pass: generated by run.py --passes compiled; begin -->"
COMPILED_END = "<!-- compiled pass: end -->"

# Kinds of compiled-pass failure (compiled_cases.py), most important first.
COMPILED_KINDS = (
    ("wrong value", "wrong value"),
    ("compiled accepted", "compiled accepted a sample eager kiln rejects"),
    ("compiled run error", "compiled run error"),
    ("Inductor lowering error", "Inductor lowering error"),
    ("Inductor compile error", "Inductor compile error"),
    ("Dynamo error", "Dynamo error"),
    ("Dynamo graph break", "Dynamo graph break"),
    ("not compiled", "not compiled"),
)


def compiled_kind(message: str) -> str:
    """The kind of a compiled-pass failure, from its message's prefix."""
    text = message.removeprefix("database expects failure: ")
    for prefix, kind in COMPILED_KINDS:
        if text.startswith(prefix):
            return kind
    return "other (worker crash, hang, harness)"


def compiled_section_of(page: str) -> str:
    """The compiled section of an existing docs/conformance.md ('' if none)."""
    begin, end = page.find(COMPILED_BEGIN), page.find(COMPILED_END)
    if begin < 0 or end < begin:
        return ""
    return page[begin:end + len(COMPILED_END)] + "\n"


def with_compiled_section(page: str, section: str) -> str:
    """`page` with its compiled section replaced by `section` (appended if the
    page has none; the page unchanged if `section` is empty)."""
    if not section:
        return page
    old = compiled_section_of(page)
    if old:
        return page.replace(old, section)
    return page.rstrip("\n") + "\n\n" + section


def compiled_markdown(tally: Tally, verdict: Verdict, summary_data: dict, *, command: str,
                      known_failures_file, rebuilt_by: str | None = None) -> str:
    """The compiled section of docs/conformance.md, between its markers."""
    from compiled_cases import TOLERANCE

    c = tally.by_pass.get(settings.COMPILED_PASS, collections.Counter())
    rebuilt = f" (rebuilt from its records by `{rebuilt_by}`)" if rebuilt_by else ""
    tolerances = ", ".join(f"{d} atol={t.atol:g} rtol={t.rtol:g}" for d, t in TOLERANCE.items()
                           if d in ("float32", "float64"))
    try:
        kf_name = known_failures_file.relative_to(settings.REPO)
    except ValueError:
        kf_name = known_failures_file
    lines = [
        COMPILED_BEGIN,
        "## Compiled pass: torch.compile on kiln against eager kiln",
        "",
        "Each OpInfo op (float32 and int64, or its first dtype; the first sample of "
        "`sample_inputs`) called as `torch.compile(lambda *a, **k: op(*a, **k), "
        "dynamic=False)` (default backend: Inductor for kiln) on one kiln copy of the sample "
        "and eagerly on another, `torch._dynamo.reset()` before each case; outputs and every "
        "input storage compared (structure, dtypes, shapes, significant strides, values). "
        "Values: integer and bool results exact; float results within "
        "torch.testing.assert_close's defaults for the result's dtype "
        f"({tolerances}; an int64 op with a float32 result is compared as float32), the "
        "defaults PyTorch's own Inductor OpInfo test uses: Inductor fuses and reorders float "
        "math and has its own vectorized math functions; unless `declared.py` declares a "
        "tolerance for the op. Settings a user would choose for what each case asks: random "
        "ops are seeded outside the compiled function (OpInfo's own seeding wrapper calls "
        "`torch.manual_seed` and `freeze_rng_state` inside the op, which Dynamo never traces "
        "on any device; PyTorch's Inductor OpInfo test replaces that wrapper too) and Inductor "
        "runs with `fallback_random=True` (backend=\"kiln\"'s default), so compiled random ops "
        "draw eager's numbers; Dynamo's `capture_scalar_outputs` and "
        "`capture_dynamic_output_shape_ops` are on, so data-dependent ops (nonzero, "
        "masked_select, `.item()`) compile into the graph. A graph "
        "break or a call Dynamo captured no graph for fails the case even when the values "
        "match. Harness: `tests/conformance/compiled_cases.py`; known failures with reasons: "
        f"`{kf_name}`.",
        "",
        f"Generated {datetime.date.today().isoformat()} at commit {_git_commit()} by "
        f"`{command}` in {summary_data['runtime_s'] / 60:.1f} min{rebuilt}.",
        "",
        f"- ops: {summary_data['ops']} ({summary_data['op_dtype_tests']} op×dtype cases, "
        "one sample each)",
        f"- passed {c[PASSED]}, failed {c[FAILED]}, xfailed {c[XFAILED]} (the database "
        f"expects the op to fail), skipped {c[SKIPPED]}",
        f"- pass rate: **{_rate(pass_rate(c))}** (passed / (passed + failed + xfailed))",
        f"- failures not in the known-failures file: {summary_data['new_failures']}; listed "
        f"failures that now pass: {summary_data['known_failures_fixed']}",
    ]
    failures = [f for f in tally.failures if f.pass_name == settings.COMPILED_PASS]
    by_kind: dict[str, list[CaseResult]] = collections.defaultdict(list)
    for f in failures:
        by_kind[compiled_kind(f.message)].append(f)
    order = [k for _, k in COMPILED_KINDS] + ["other (worker crash, hang, harness)"]
    wrong = len(by_kind.get("wrong value", []))
    lines += [f"- wrong values (compiled result differs from eager kiln beyond the tolerance): "
              f"**{wrong}**",
              "", "### Failures by kind", "",
              "Messages use compare.py's wording: \"kiln\" is the compiled result, \"CPU\" the "
              "eager kiln reference (copied to the host). The reason for each failure is in "
              "the known-failures file.", ""]
    if not failures:
        lines.append("None.")
    else:
        lines += ["| kind | cases | ops |", "|---|---:|---|"]
        for kind in order:
            if by_kind.get(kind):
                dtypes_of: dict[str, list[str]] = collections.defaultdict(list)
                for f in sorted(by_kind[kind], key=lambda f: (f.op, f.dtype)):
                    dtypes_of[f.op].append(f.dtype)
                ops = ", ".join(f"`{op}` ({', '.join(d)})" for op, d in dtypes_of.items())
                lines.append(f"| {kind} | {len(by_kind[kind])} | {ops} |")
        lines += ["", "### Failing cases (wrong values first)", "",
                  "| kind | op | dtype | status | message |", "|---|---|---|---|---|"]
        for kind in order:
            for f in sorted(by_kind.get(kind, []), key=lambda f: (f.op, f.dtype)):
                message = f.message.replace("|", "\\|")
                lines.append(f"| {kind} | `{f.op}` | {f.dtype} | {f.status} | {message} |")
    skipped = {reason: n for (p, reason), n in tally.skip_reasons.items()
               if p == settings.COMPILED_PASS}
    if skipped:
        lines += ["", "### Skipped cases", "", "| reason | cases |", "|---|---:|"]
        for reason, n in sorted(skipped.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {reason.replace('|', '/')} | {n} |")
    lines.append(COMPILED_END)
    return "\n".join(lines) + "\n"
