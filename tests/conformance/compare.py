"""Exact comparison of a kiln result with the CPU result.

Kiln runs ATen's CPU kernels, so a result must match CPU's bit for bit: same
structure, devices (kiln where CPU has cpu), dtypes, shapes, significant
strides, conj/neg bits resolved, and values (NaNs equal whatever their
payload; +0.0 and -0.0 differ). An op may declare a tolerance
(see declared.py); values are then compared with torch.testing.assert_close.
A difference raises `Mismatch` whose first line says what and where.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch._prims_common import check_significant_strides


class Mismatch(AssertionError):
    """A kiln result differs from the CPU result."""


@dataclass(frozen=True)
class Tolerance:
    """Allowed difference for values; atol=rtol=0 means bit-exact.

    `per_dtype` ((dtype, Tolerance), ...) overrides atol/rtol for result
    tensors of those dtypes (the compiled pass: an int64 op whose result is
    float32 is compared as float32)."""

    atol: float = 0.0
    rtol: float = 0.0
    per_dtype: tuple = ()

    @property
    def exact(self) -> bool:
        return self.atol == 0.0 and self.rtol == 0.0

    def for_dtype(self, dtype: torch.dtype) -> "Tolerance":
        for d, tolerance in self.per_dtype:
            if d == dtype:
                return tolerance
        return self


EXACT = Tolerance()

_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def expected_device_type(cpu_device: torch.device, device_type: str) -> str:
    """Where a kiln result should live, given where the CPU result lives."""
    return device_type if cpu_device.type == "cpu" else cpu_device.type


def assert_same(actual: Any, expected: Any, *, device_type: str = "kiln",
                tolerance: Tolerance = EXACT, check_strides: bool = True,
                path: str = "output") -> None:
    """Raises Mismatch unless `actual` (run on kiln) equals `expected` (CPU)."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise Mismatch(f"{path}: kiln returned {type(actual).__name__}, CPU a Tensor")
        _assert_same_tensor(actual, expected, device_type, tolerance, check_strides, path)
    elif isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            raise Mismatch(f"{path}: kiln returned {_describe(actual)}, CPU {_describe(expected)}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, device_type=device_type, tolerance=tolerance,
                        check_strides=check_strides, path=f"{path}[{i}]")
    elif isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            raise Mismatch(f"{path}: kiln returned {_describe(actual)}, CPU {_describe(expected)}")
        for k in expected:
            assert_same(actual[k], expected[k], device_type=device_type, tolerance=tolerance,
                        check_strides=check_strides, path=f"{path}[{k!r}]")
    elif isinstance(expected, float) and isinstance(actual, float):
        if not (actual == expected or (math.isnan(actual) and math.isnan(expected))):
            raise Mismatch(f"{path}: kiln {actual!r} != CPU {expected!r}")
    elif isinstance(expected, complex) and isinstance(actual, complex):
        assert_same(actual.real, expected.real, path=f"{path}.real")
        assert_same(actual.imag, expected.imag, path=f"{path}.imag")
    elif isinstance(expected, torch.device):
        want = torch.device(expected_device_type(expected, device_type))
        if actual.type != want.type:
            raise Mismatch(f"{path}: kiln device {actual} but expected {want.type}")
    elif type(actual) is not type(expected) or actual != expected:
        raise Mismatch(f"{path}: kiln {actual!r} != CPU {expected!r}")


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def _assert_same_tensor(actual: torch.Tensor, expected: torch.Tensor, device_type: str,
                        tolerance: Tolerance, check_strides: bool, path: str) -> None:
    tolerance = tolerance.for_dtype(expected.dtype)
    want_device = expected_device_type(expected.device, device_type)
    if actual.device.type != want_device:
        raise Mismatch(f"{path}: on {actual.device}, expected a {want_device} tensor")
    if actual.dtype != expected.dtype:
        raise Mismatch(f"{path}: dtype {actual.dtype} on kiln, {expected.dtype} on CPU")
    if actual.layout != expected.layout:
        raise Mismatch(f"{path}: layout {actual.layout} on kiln, {expected.layout} on CPU")
    if actual.shape != expected.shape:
        raise Mismatch(f"{path}: shape {tuple(actual.shape)} on kiln, "
                       f"{tuple(expected.shape)} on CPU")
    if actual.requires_grad != expected.requires_grad:
        raise Mismatch(f"{path}: requires_grad {actual.requires_grad} on kiln, "
                       f"{expected.requires_grad} on CPU")
    if check_strides and expected.layout == torch.strided:
        same, _ = check_significant_strides(actual, expected, only_cuda=False)
        if not same:
            raise Mismatch(f"{path}: strides {actual.stride()} on kiln, "
                           f"{expected.stride()} on CPU (shape {tuple(expected.shape)})")
    if expected.layout != torch.strided:
        # Sparse: the same nnz and members (indices in the same order), each
        # compared as a dense tensor.
        if actual._nnz() != expected._nnz():
            raise Mismatch(f"{path}: nnz {actual._nnz()} on kiln, {expected._nnz()} on CPU")
        if expected.layout == torch.sparse_coo and (
                actual.is_coalesced() != expected.is_coalesced()):
            raise Mismatch(f"{path}: is_coalesced {actual.is_coalesced()} on kiln, "
                           f"{expected.is_coalesced()} on CPU")
        for name, a, e in zip(("indices", "values") if expected.layout == torch.sparse_coo
                              else ("compressed indices", "plain indices", "values"),
                              _sparse_members(actual), _sparse_members(expected)):
            _assert_same_tensor(a, e, device_type, tolerance, False, f"{path}.{name}")
        return
    host = actual.detach().cpu().resolve_conj().resolve_neg()
    want = expected.detach().resolve_conj().resolve_neg()
    if tolerance.exact:
        _assert_bitwise_equal(host, want, path)
    else:
        try:
            torch.testing.assert_close(host, want, atol=tolerance.atol, rtol=tolerance.rtol,
                                       equal_nan=True)
        except AssertionError as error:
            raise Mismatch(f"{path}: {_first_line(str(error))} "
                           f"(tolerance atol={tolerance.atol} rtol={tolerance.rtol})") from None


def _sparse_members(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    t = t.detach()
    if t.layout == torch.sparse_coo:
        return t._indices(), t._values()
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices(), t.values()
    return t.ccol_indices(), t.row_indices(), t.values()


def _assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, path: str) -> None:
    """Same bits everywhere, except that any NaN equals any NaN."""
    if expected.numel() == 0:
        return
    a = actual.contiguous()
    e = expected.contiguous()
    if e.is_complex():
        a, e = torch.view_as_real(a), torch.view_as_real(e)
    if e.is_floating_point():
        # Bits, so that -0.0 differs from +0.0; NaNs equal whatever their bits.
        bits = _BITS_DTYPE[e.element_size()]
        differ = (a.view(bits) != e.view(bits)) & ~(torch.isnan(a) & torch.isnan(e))
    else:
        differ = a != e
    if differ.any():
        count = int(differ.sum())
        index = tuple(int(i) for i in differ.nonzero()[0])
        first_a, first_e = a[index].item(), e[index].item()
        extra = ""
        if e.is_floating_point():
            ignored = ~differ | ~(torch.isfinite(a) & torch.isfinite(e))
            diff = (a.double() - e.double()).abs().masked_fill(ignored, 0)
            extra = f", max abs diff {float(diff.max()):.3g}"
        raise Mismatch(f"{path}: {count} of {e.numel()} values differ{extra}; first at "
                       f"{index}: kiln {first_a!r}, CPU {first_e!r}")


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else ""
