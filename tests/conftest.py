"""Shared fixtures for Kiln's PyTorch-level tests.

Every test compares kiln results with CPU's; `assert_same` is bit-exact
(same dtype, shape, and bytes, NaNs equal) because kiln runs ATen's own CPU
kernels on the reference device.
"""

import os
import subprocess
import sys

import pytest
import torch


def assert_same(kiln_result: torch.Tensor, cpu_result: torch.Tensor) -> None:
    """Bit-exact comparison of a kiln (or CPU) tensor with a CPU tensor."""
    actual = kiln_result.cpu()
    assert actual.dtype == cpu_result.dtype, (actual.dtype, cpu_result.dtype)
    assert actual.shape == cpu_result.shape, (actual.shape, cpu_result.shape)
    torch.testing.assert_close(actual, cpu_result, rtol=0, atol=0, equal_nan=True)
    if cpu_result.is_floating_point() or cpu_result.is_complex():
        # rtol=atol=0 treats 0.0 and -0.0 as equal; compare the bytes too.
        a = actual.reshape(-1).contiguous().view(torch.uint8)
        c = cpu_result.reshape(-1).contiguous().view(torch.uint8)
        assert torch.equal(a, c)


def run_python(code: str, env_overrides: dict | None = None, timeout: float = 120):
    """Runs `code` in a fresh interpreter; returns the CompletedProcess."""
    env = dict(os.environ)
    for key, value in (env_overrides or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(autouse=True)
def _synchronize_after_test():
    """Surface errors of a test's queued kernels in that test, not the next."""
    yield
    torch.kiln.synchronize()
