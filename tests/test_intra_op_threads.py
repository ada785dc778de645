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


def _weight_grad_mm(device):
    # The weight gradient of a Linear(2048 -> ...) layer: a long reduction
    # (k = 2048) whose split over threads changes the float32 rounding on CPU.
    torch.manual_seed(0)
    a, b = torch.randn(2048, 128).t(), torch.randn(2048, 512)
    return (a.to(device) @ b.to(device)).cpu()


def _layer_norm_backward(device):
    # native_layer_norm_backward of a (32, 64, 128) float32 input: the weight
    # and bias gradients are summed per thread, then across threads.
    torch.manual_seed(0)
    x, grad, w, b = torch.randn(32, 64, 128), torch.randn(32, 64, 128), torch.randn(128), torch.randn(128)
    _, mean, rstd = torch.native_layer_norm(x, (128,), w, b, 1e-5)
    args = [t.to(device) for t in (grad, x)] + [(128,)] + [t.to(device) for t in (mean, rstd, w, b)]
    return [t.cpu() for t in torch.ops.aten.native_layer_norm_backward(*args, [True, True, True])]


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("threads", [1, 2])
def test_thread_count_dependent_reductions_match_cpu_bit_for_bit(threads):
    # The char GPT's (examples/train_char_gpt.py) ops whose CPU result depends
    # on the intra-op thread count: kiln gives CPU's bits at the same count.
    torch.set_num_threads(threads)
    assert torch.equal(_weight_grad_mm("kiln"), _weight_grad_mm("cpu"))
    for k, c in zip(_layer_norm_backward("kiln"), _layer_norm_backward("cpu")):
        assert torch.equal(k, c)


@pytest.mark.usefixtures("restore_threads")
def test_layer_norm_backward_on_cpu_depends_on_the_thread_count():
    # Why the test above runs at both counts: CPU's own bits change with it,
    # so a kiln kernel run with another count would give other numbers.
    torch.set_num_threads(1)
    one = _layer_norm_backward("cpu")
    torch.set_num_threads(2)
    two = _layer_norm_backward("cpu")
    assert not torch.equal(one[1], two[1])


class _ReportThreadsInBackward(torch.autograd.Function):
    """Identity whose backward, run by autograd's kiln device thread, issues
    the reporting kernel."""
    reports: list = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _ReportThreadsInBackward.reports.append(
            torch.ops.kiln_test_threads.intra_op_threads(grad))
        return grad


@pytest.mark.usefixtures("restore_threads")
def test_set_num_threads_reaches_backward_kernels():
    # Backward kernels are issued by autograd's device thread, whose own
    # OpenMP count dates from when it started (Note [Intra-op threads of kiln
    # kernels]); they must follow torch.set_num_threads as CPU's do.
    for n in (1, 3, 2, 1):
        torch.set_num_threads(n)
        x = torch.zeros(1, device="kiln", requires_grad=True)
        _ReportThreadsInBackward.apply(x).sum().backward()
        threads, tid = _ReportThreadsInBackward.reports.pop().cpu().tolist()
        assert threads == n
        assert tid != threading.get_native_id()


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_backward_after_set_num_threads_gives_cpus_bits(device):
    # A convolution's weight gradient splits its reduction by thread count.
    torch.manual_seed(0)
    img, k = torch.randn(2, 3, 9, 9), torch.randn(4, 3, 3, 3)

    def weight_grad(dev):
        kk = k.to(dev, copy=True).requires_grad_()
        torch.nn.functional.conv2d(img.to(dev), kk, padding=1).relu().sum().backward()
        return kk.grad.cpu()

    for n in (1, 2, 1):
        torch.set_num_threads(n)
        assert torch.equal(weight_grad(device), weight_grad("cpu"))
