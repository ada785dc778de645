"""Helpers shared by the kl tests (tests/test_kl_*.py)."""

import os

import pytest


def line_of(module_file: str, marker: str) -> int:
    """The line number of the (only) line of ``module_file`` containing ``# marker``."""
    with open(module_file) as f:
        lines = [i + 1 for i, text in enumerate(f) if f"# {marker}" in text]
    assert len(lines) == 1, (marker, lines)
    return lines[0]


def where(fn_file: str, marker: str) -> str:
    """The ``<file>:<line>`` a KernelError names for the line with ``marker``."""
    return f"{os.path.basename(fn_file)}:{line_of(fn_file, marker)}"


@pytest.fixture(scope="module")
def private_kernel_cache(tmp_path_factory):
    """A private kernel cache directory for one test module."""
    path = tmp_path_factory.mktemp("kl-kernels")
    old = os.environ.get("KILN_KERNELS_CACHE_DIR")
    os.environ["KILN_KERNELS_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("KILN_KERNELS_CACHE_DIR", None)
    else:
        os.environ["KILN_KERNELS_CACHE_DIR"] = old


__all__ = ["line_of", "private_kernel_cache", "where"]
