"""Intra-op threads: a kiln kernel runs on a stream worker with the intra-op
thread count of the thread that issued it, as a CPU kernel runs with its
caller's (Note [Intra-op threads of kiln kernels])."""

import threading

import pytest
import torch

_library = torch.library.Library("kiln_test_threads", "DEF")
_library.define("intra_op_threads(Tensor x) -> Tensor")


def _report_threads(x: torch.Tensor) -> torch.Tensor:
    # [at::get_num_threads(), OS thread id] of the thread running the kernel.
    return torch.tensor([torch.get_num_threads(), threading.get_native_id()], dtype=torch.int64)


_library.impl("intra_op_threads", _report_threads, "CPU")
torch.library.register_fake(
    "kiln_test_threads::intra_op_threads",
    lambda x: torch.empty(2, dtype=torch.int64, device=x.device), lib=_library)


def _kernel_threads(stream=None):
    """(intra-op threads, OS thread id) seen by a kernel run on kiln."""
    with torch.kiln.stream(stream or torch.kiln.current_stream()):
        out = torch.ops.kiln_test_threads.intra_op_threads(torch.zeros(1, device="kiln"))
    torch.kiln.synchronize()
    threads, tid = out.cpu().tolist()
    return threads, tid


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_kernels_run_on_a_worker_thread():
    _, tid = _kernel_threads()
    assert tid != threading.get_native_id()


@pytest.mark.usefixtures("restore_threads")
def test_set_num_threads_reaches_kernels_issued_after_it():
    for n in (1, 3, 2, 1):
        torch.set_num_threads(n)
        assert _kernel_threads()[0] == n
        assert _kernel_threads(torch.kiln.Stream())[0] == n


@pytest.mark.usefixtures("restore_threads")
def test_count_is_taken_when_the_kernel_is_issued():
    torch.set_num_threads(1)
    torch.kiln._sleep(50)  # the worker is busy while the next kernel is queued
    out = torch.ops.kiln_test_threads.intra_op_threads(torch.zeros(1, device="kiln"))
    torch.set_num_threads(2)
    torch.kiln.synchronize()
    assert out.cpu().tolist()[0] == 1
