"""Shared fixtures for Kiln's PyTorch-level tests.

Every test compares kiln results with CPU's; `assert_same` is bit-exact
(same dtype, shape, and bytes, NaNs equal) because kiln runs ATen's own CPU
kernels on the reference device.
"""

import ctypes
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


KILN_ERROR_NOT_READY = 600  # kilnErrorNotReady


def kiln_runtime() -> ctypes.CDLL:
    """The device runtime's C API (the libkilnrt that kiln itself loaded), as
    another library calling kilnStreamCreate would see it."""
    import torch_kiln
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch_kiln._C.__file__), "libkilnrt.so"))
    lib.kilnStreamCreateWithPriority.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint,
                                                 ctypes.c_int]
    for name in ("kilnStreamDestroy", "kilnStreamQuery", "kilnStreamSynchronize"):
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    return lib


def create_runtime_stream(device: int, priority: int = 0) -> int:
    """A kilnStream_t made by the runtime directly (not by torch_kiln), on
    `device`; the caller destroys it with kiln_runtime().kilnStreamDestroy."""
    lib = kiln_runtime()
    previous = ctypes.c_int()
    assert lib.kilnGetDevice(ctypes.byref(previous)) == 0
    assert lib.kilnSetDevice(device) == 0
    handle = ctypes.c_void_p()
    status = lib.kilnStreamCreateWithPriority(ctypes.byref(handle), 0, priority)
    assert lib.kilnSetDevice(previous.value) == 0
    assert status == 0
    return handle.value


@pytest.fixture
def runtime_stream():
    """Makes runtime streams for a test (`runtime_stream(device, priority=0)`
    returns a kilnStream_t) and destroys them after it."""
    created = []

    def make(device: int, priority: int = 0) -> int:
        created.append(create_runtime_stream(device, priority))
        return created[-1]

    yield make
    lib = kiln_runtime()
    for handle in created:
        lib.kilnStreamSynchronize(handle)
        lib.kilnStreamDestroy(handle)


@pytest.fixture(autouse=True)
def _synchronize_after_test():
    """Surface errors of a test's queued kernels in that test, not the next."""
    yield
    torch.kiln.synchronize()


@pytest.fixture
def restore_threads():
    """Puts torch.get_num_threads() back after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fresh_compile(tmp_path, monkeypatch):
    """A private Inductor cache and reset Dynamo caches around one test, so
    a compiled test neither reuses another's graphs nor leaves its own."""
    import torch._dynamo

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# `make test` runs the tests on two pytest-xdist workers (`-n 2 --dist
# loadgroup`). The tests that start kccl ranks check /dev/shm for segments
# left by dead processes, so another worker's test killing its ranks on
# purpose could show up in them: those files run on one worker, one test
# after another (the xdist_group below; a no-op without xdist).
_ONE_WORKER_FILES = {
    "test_distributed_apis.py": "kccl",
    "test_distributed_kccl.py": "kccl",
    "test_distributed_kccl_cross_host.py": "kccl",
    "test_distributed_kccl_two_hosts.py": "kccl",
    "test_examples_parallel.py": "kccl",
}


# tryfirst: xdist's own hook turns the marker into the node id's "@group"
# suffix, so the marker must be on the items before it runs.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = _ONE_WORKER_FILES.get(item.path.name)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
