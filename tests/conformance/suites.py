"""PyTorch's device-type test machinery, pointed at kiln.

The op test is `TestCommon.test_compare_cpu` and the module test is
`TestModule.test_cpu_gpu_parity`: the names PyTorch's own suites use for
"compare this device with the CPU". OpInfo and ModuleInfo entries attach
skips and expected failures to (test class, test name, device type, dtype)
through DecorateInfo, so with these names the database's own entries (random
ops skipped as non-deterministic, ...) apply to kiln automatically.
`instantiate_device_type_tests(..., only_for="kiln")` instantiates them for
the PrivateUse1 device through `PrivateUse1TestBase`, one test per op (or
module and mode) and dtype, named like `test_compare_cpu_add_kiln_float32`.

A test's body runs every case of its op and dtype and reports each through
`TestRun.emit`; the test itself never fails. What the database says reaches
the run this way:
- a skip decorator skips the test: its cases are reported as skipped with
  the decorator's reason;
- `unittest.expectedFailure`: the cases run, and failing ones are reported
  as "xfailed" instead of "failed" (passing ones as passed).
Random ops the database skips as non-deterministic run anyway: kiln's
generator reproduces CPU's (see declared.py).
"""

from __future__ import annotations

import unittest
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch.testing._internal.common_device_type import instantiate_device_type_tests, ops
from torch.testing._internal.common_modules import ModuleInfo, modules
from torch.testing._internal.common_utils import TestCase
from torch.testing._internal.opinfo.core import OpInfo

import settings
from declared import runs_despite_database_skip
from module_cases import count_module_cases, module_key, run_module
from op_cases import count_cases, run_op
from outcomes import FAILED, SKIPPED, XFAILED, CaseResult, Emit, first_line
from samples import op_key


@dataclass
class TestRun:
    """What the running tests do: passes, quick mode, where results go."""

    op_passes: tuple[str, ...]
    run_modules: bool
    quick: bool
    emit: Emit
    begin: Callable[[str, str, str, int], None] = lambda *_: None


_run: TestRun | None = None


def _emit_for(test: unittest.TestCase) -> Emit:
    """`emit`, turning failures into xfails where the database expects the
    test to fail."""
    expecting_failure = getattr(getattr(test, "_outcome", None), "expecting_failure", False)

    def emit(result: CaseResult) -> None:
        if expecting_failure and result.status == FAILED:
            result.status = XFAILED
            result.message = f"database expects failure: {result.message}"
        _run.emit(result)
    return emit


def _define_test_common(op_list: list[OpInfo], scope: dict[str, Any]) -> None:
    class TestCommon(TestCase):
        """OpInfo ops on kiln compared with CPU (see op_cases.py)."""

        @ops(op_list, allowed_dtypes=settings.DTYPES)
        def test_compare_cpu(self, device, dtype, op):
            run_op(op, dtype, passes=_run.op_passes, quick=_run.quick, emit=_emit_for(self),
                   begin=_run.begin)

    scope["TestCommon"] = TestCommon
    instantiate_device_type_tests(TestCommon, scope, only_for=settings.DEVICE)


def _define_test_module(module_list: list[ModuleInfo], scope: dict[str, Any]) -> None:
    class TestModule(TestCase):
        """ModuleInfo modules on kiln compared with CPU (see module_cases.py)."""

        @modules(module_list, allowed_dtypes=settings.MODULE_DTYPES)
        def test_cpu_gpu_parity(self, device, dtype, module_info, training):
            run_module(module_info, dtype, training, quick=_run.quick, emit=_emit_for(self),
                       begin=_run.begin)

    scope["TestModule"] = TestModule
    instantiate_device_type_tests(TestModule, scope, only_for=settings.DEVICE)


@dataclass
class PlannedTest:
    """One instantiated test: its class and method, and what it covers."""

    test_class: type
    method: str
    key: str
    dtype: torch.dtype
    count_cases: Callable[[], dict[str, int]] = field(repr=False)
    # Runs the test's cases outside unittest (for a database skip overridden).
    run_cases: Callable[[Emit], None] = field(repr=False)

    @property
    def dtype_name(self) -> str:
        return settings.dtype_name(self.dtype)


def op_dtypes(op: OpInfo, quick: bool) -> list[torch.dtype]:
    """The dtypes an op runs in: those it supports on CPU among DTYPES; in
    quick mode float32 and int64, or else its first supported dtype."""
    supported = [d for d in settings.DTYPES if d in op.supported_dtypes("cpu")]
    if not quick:
        return supported
    picked = [d for d in supported if d in settings.QUICK_DTYPES]
    return picked or supported[:1]


def _plan_op_tests(op_list: list[OpInfo], run: TestRun, scope: dict[str, Any],
                   device_type: str) -> list[PlannedTest]:
    _define_test_common(op_list, scope)
    test_class = next(v for k, v in scope.items() if k.startswith("TestCommon"))
    planned = []
    for op in op_list:
        for dtype in op_dtypes(op, run.quick):
            method = (f"test_compare_cpu_{op.formatted_name}_{device_type}_"
                      f"{settings.dtype_name(dtype)}")
            planned.append(PlannedTest(
                test_class, method, op_key(op), dtype,
                lambda op=op, dtype=dtype: count_cases(op, dtype, run.op_passes, run.quick),
                lambda emit, op=op, dtype=dtype: run_op(
                    op, dtype, passes=run.op_passes, quick=run.quick, emit=emit,
                    begin=run.begin)))
    return planned


def _plan_module_tests(module_list: list[ModuleInfo], run: TestRun, scope: dict[str, Any],
                       device_type: str) -> list[PlannedTest]:
    _define_test_module(module_list, scope)
    test_class = next(v for k, v in scope.items() if k.startswith("TestModule"))
    dtypes = settings.MODULE_DTYPES[:1] if run.quick else settings.MODULE_DTYPES
    planned = []
    for info in module_list:
        modes = (True, False) if info.train_and_eval_differ else (True,)
        for training in modes:
            suffix = (f"_{'train_mode' if training else 'eval_mode'}"
                      if info.train_and_eval_differ else "")
            for dtype in [d for d in dtypes if d in info.supported_dtypes("cpu")]:
                method = (f"test_cpu_gpu_parity_{info.formatted_name}{suffix}_{device_type}_"
                          f"{settings.dtype_name(dtype)}")
                planned.append(PlannedTest(
                    test_class, method, module_key(info, training), dtype,
                    lambda i=info, d=dtype, t=training: {
                        "modules": count_module_cases(i, d, t, run.quick)},
                    lambda emit, i=info, d=dtype, t=training: run_module(
                        i, d, t, quick=run.quick, emit=emit, begin=run.begin)))
    return planned


def plan_tests(op_list: list[OpInfo], module_list: list[ModuleInfo],
               run: TestRun) -> list[PlannedTest]:
    """Instantiates the kiln tests for these ops and modules, and lists the
    ones this run executes: ops then modules, each in dtype order."""
    scope: dict[str, Any] = {}
    device_type = torch._C._get_privateuse1_backend_name()
    planned = []
    if op_list and run.op_passes:
        planned += _plan_op_tests(op_list, run, scope, device_type)
    if module_list and run.run_modules:
        planned += _plan_module_tests(module_list, run, scope, device_type)
    for test in planned:
        if not hasattr(test.test_class, test.method):
            raise RuntimeError(f"harness bug: no instantiated test {test.method}")
    return planned


class _Result(unittest.TestResult):
    """Keeps what unittest says about one test: a skip, or an error raised
    outside the cases (a harness problem)."""

    def __init__(self):
        super().__init__()
        self.skip_reason: str | None = None
        self.error: str | None = None

    def addSkip(self, test, reason):
        self.skip_reason = reason or "skipped"

    def addError(self, test, err):
        self.error = first_line("".join(self._exc_info_to_string(err, test).splitlines()[-1:]))

    addFailure = addError


def run_tests(planned: Iterable[PlannedTest], run: TestRun,
              started: Callable[[PlannedTest], None] = lambda _: None) -> None:
    """Runs the planned tests one by one; results go to `run.emit`."""
    global _run
    _run = run
    set_up: set[type] = set()
    for test in planned:
        if test.test_class not in set_up:
            test.test_class.setUpClass()
            set_up.add(test.test_class)
        started(test)
        result = _Result()
        test.test_class(test.method).run(result)
        if result.skip_reason is not None and runs_despite_database_skip(test.key):
            test.run_cases(run.emit)
        elif result.skip_reason is not None:
            for pass_name, count in test.count_cases().items():
                run.emit(CaseResult(test.key, test.dtype_name, pass_name, 0, SKIPPED,
                                    f"database: {first_line(result.skip_reason)}", count=count))
        elif result.error is not None:
            run.emit(CaseResult(test.key, test.dtype_name, "forward", -1, FAILED,
                                f"test error: {result.error}"))
    for test_class in set_up:
        test_class.tearDownClass()
