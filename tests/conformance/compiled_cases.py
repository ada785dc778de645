"""The compiled pass: each OpInfo op under torch.compile on kiln, compared
with eager kiln (issue 11's acceptance).

For one sample, the op runs eagerly on one kiln copy of the sample and as
`torch.compile(lambda *a, **k: op(*a, **k), dynamic=False)` (the default
backend, Inductor for kiln) on another; Dynamo's caches are reset first, so
no case reuses another's graph (Inductor's on-disk caches stay on: the
driver points TORCHINDUCTOR_CACHE_DIR under the run's log dir). Compared:
outputs (after the sample's output_process_fn_grad) and every input storage
(mutations), with the comparison of compare.py: structure, devices, dtypes,
shapes, significant strides, and values within TOLERANCE below unless
declared.py declares one for the op.

A failing case says what kind of failure it is, first word(s) of its
message (report.py groups by them):
- "wrong value: ..."           compiled result differs from eager kiln
- "Dynamo graph break: ..."    the op did not compile as one graph
                               (results were still compared: a wrong value wins)
- "not compiled: ..."          Dynamo captured no graph for the call
- "Inductor lowering error: ..." / "Inductor compile error: ..." /
  "Dynamo error: ..."          compilation raised
- "compiled run error: ..."    the compiled code raised where eager did not
- "compiled accepted a sample eager kiln rejects: ..."
A sample eager kiln rejects and compiled code rejects too is skipped.

Settings that differ from a bare `torch.compile` call, each the one a user
sets for what the case asks (see COMPILE_CONFIG and _unseeded):
- Random ops are seeded *outside* the compiled function and Inductor runs
  with `fallback_random=True` (the default of backend="kiln"), so compiled
  random ops draw eager's numbers from kiln's generator. OpInfo's own
  wrapper_set_seed seeds inside the op with freeze_rng_state() and
  torch.manual_seed(), which Dynamo never traces on any device (a graph
  break that says nothing about the op); PyTorch's own Inductor OpInfo test
  (test/inductor/test_torchinductor_opinfo.py) replaces the wrapper too.
- Dynamo's capture_scalar_outputs and capture_dynamic_output_shape_ops are
  on, so ops whose result depends on the data (nonzero, masked_select,
  .item(), ...) are compiled into the graph with unbacked symbolic sizes
  instead of breaking it: the case then tests kiln's compiled path for them.
"""

from __future__ import annotations

import contextlib
import unittest.mock
from typing import Any

import torch
from torch.testing._internal.opinfo.core import OpInfo

import settings
from calls import KilnCall
from compare import Mismatch, Tolerance, assert_same
from outcomes import CaseFailed, CaseSkipped, describe_error, first_line
from samples import PlacedSample
from transfer import copy_value

DEVICE = settings.DEVICE

# Inductor fuses and reorders float arithmetic and uses its own vectorized
# math functions (sin, atan, exp ... in the generated C++ are not ATen's), so
# float results need not be bit-identical to eager: each result tensor is
# compared with torch.testing.assert_close's defaults for *its* dtype (an
# int64 op with a float32 result, like sin, is compared as float32), the
# defaults PyTorch's own test/inductor/test_torchinductor_opinfo.py checks
# Inductor against eager with. Integer and bool results must be exact.
TOLERANCE = {
    "float32": Tolerance(atol=1e-5, rtol=1.3e-6),
    "float64": Tolerance(atol=1e-7, rtol=1e-7),
    "float16": Tolerance(atol=1e-5, rtol=1e-3),
    "bfloat16": Tolerance(atol=1e-5, rtol=1.6e-2),
    "complex64": Tolerance(atol=1e-5, rtol=1.3e-6),
}


# Dynamo and Inductor settings for every compiled case (see the module
# docstring).
COMPILE_CONFIG = {
    "torch._inductor.config": {"fallback_random": True},
    "torch._dynamo.config": {"capture_scalar_outputs": True,
                             "capture_dynamic_output_shape_ops": True},
}
RANDOM_SEED = 42  # OpInfo's wrapper_set_seed's


def _unseeded(op, *args, **kwargs):
    """Stands in for common_methods_invocations.wrapper_set_seed during a
    case: the caller seeds (with RANDOM_SEED) before each call instead."""
    return op(*args, **kwargs)


@contextlib.contextmanager
def _compile_settings():
    import importlib

    from torch.testing._internal import common_methods_invocations

    with contextlib.ExitStack() as stack:
        for module_name, values in COMPILE_CONFIG.items():
            stack.enter_context(importlib.import_module(module_name).patch(values))
        stack.enter_context(unittest.mock.patch.object(
            common_methods_invocations, "wrapper_set_seed", _unseeded))
        yield


def default_tolerance(dtype_name: str) -> Tolerance:
    """The compiled pass's tolerance: exact, with TOLERANCE for float and
    complex result tensors (the case's dtype does not matter)."""
    return Tolerance(per_dtype=tuple((getattr(torch, name), tolerance)
                                     for name, tolerance in TOLERANCE.items()))


def _classify_compile_error(error: BaseException) -> str:
    """'Inductor lowering error: ...' etc. for an exception torch.compile raised."""
    from torch._dynamo import exc as dynamo_exc

    inner = error
    # BackendCompilerFailed wraps the backend's exception (inner_exception).
    wrapped = getattr(error, "inner_exception", None)
    if wrapped is not None:
        inner = wrapped
    name = type(inner).__name__
    module = type(inner).__module__
    text = describe_error(inner)
    if "LoweringException" in name or "lowering" in text.lower():
        return f"Inductor lowering error: {text}"
    if isinstance(error, dynamo_exc.BackendCompilerFailed) or module.startswith("torch._inductor"):
        if "CppCompileError" in name or "g++" in text or "c++" in text.lower():
            return f"Inductor compile error (C++): {text}"
        return f"Inductor compile error: {text}"
    if isinstance(error, (dynamo_exc.Unsupported, dynamo_exc.TorchRuntimeError,
                          dynamo_exc.InternalTorchDynamoError, dynamo_exc.UserError)):
        return f"Dynamo error: {text}"
    if "from user code:" in str(error):  # Dynamo appends this to errors while tracing
        return f"Dynamo error (while tracing): {text}"
    return f"compiled run error: {text}"


def compiled_case(op: OpInfo, placed: PlacedSample, tolerance: Tolerance) -> None:
    """op(sample) compiled on kiln matches op(sample) eager on kiln."""
    import torch._dynamo
    import torch_kiln.compiler

    sample = placed.sample
    eager, compiled = placed.on(DEVICE), placed.on(DEVICE)
    eager_error = compiled_error = None
    eager_out = compiled_out = None
    with _compile_settings():
        try:
            torch.manual_seed(RANDOM_SEED)
            eager_out = KilnCall()(lambda s: op(s.input, *s.args, **s.kwargs), eager.sample)
        except Exception as error:  # noqa: BLE001 - eager rejects the sample
            eager_error = error

        torch._dynamo.reset()
        torch_kiln.compiler.reset_metrics()
        fn = torch.compile(lambda *a, **k: op(*a, **k), dynamic=False)
        try:
            torch.manual_seed(RANDOM_SEED)
            compiled_out = KilnCall()(lambda s: fn(s.input, *s.args, **s.kwargs),
                                      compiled.sample)
        except Exception as error:  # noqa: BLE001 - classified below
            compiled_error = error
        metrics = torch_kiln.compiler.get_metrics()
        torch._dynamo.reset()

    if eager_error is not None and compiled_error is not None:
        raise CaseSkipped(f"eager kiln rejects the sample ({describe_error(eager_error)}); "
                          "compiled too")
    if eager_error is not None:
        raise CaseFailed("compiled accepted a sample eager kiln rejects: "
                         f"{describe_error(eager_error)}")
    if compiled_error is not None:
        raise CaseFailed(_classify_compile_error(compiled_error))

    # Values first: a wrong value is the failure that matters most.
    try:
        assert_same(sample.output_process_fn_grad(compiled_out),
                    _host(sample.output_process_fn_grad(eager_out)),
                    device_type=eager.result_device_type, tolerance=tolerance)
        for i, (c, e) in enumerate(zip(compiled.storages, eager.storages)):
            assert_same(c, _host(e), device_type=c.device.type, tolerance=tolerance,
                        path=f"input storage {i}")
    except Mismatch as mismatch:
        raise CaseFailed(f"wrong value: {first_line(str(mismatch))}") from None
    if metrics["graph_break_count"]:
        reason = next(iter(metrics["graph_breaks"]))
        raise CaseFailed(f"Dynamo graph break: {first_line(reason, limit=200)}")
    if metrics["graphs_compiled"] == 0:
        raise CaseFailed("not compiled: Dynamo captured no graph for the call")


def _host(value: Any) -> Any:
    """A layout-preserving CPU copy of an eager kiln result (the reference),
    so compare.py's 'kiln result vs CPU reference' checks apply unchanged."""
    if isinstance(value, torch.Tensor) or (
            isinstance(value, (list, tuple, dict)) and _has_tensor(value)):
        return copy_value(value, "cpu")
    return value


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False
