"""Integer division by zero in compiled kiln code (Note [Inductor's
integer-division flag on kiln], torch_kiln/compiler/inductor/kernels.py):
raised at synchronization like eager's error, and safe when kernels run on
several streams at once."""

import pytest
import torch
import torch._dynamo

from torch_kiln.compiler.inductor import kernels

from quick_shard import rotate

KERNEL = """#include <torch/csrc/inductor/cpp_prefix.h>
extern "C" void kernel(const int64_t* in_ptr0, int64_t* out_ptr0)
{
    std::atomic<int> inductor_cpu_integer_div_error{0};
    inductor_cpu_integer_div_error_flag = &inductor_cpu_integer_div_error;
    out_ptr0[0] = BODY;
    inductor_cpu_integer_div_error_flag = nullptr;
    inductor_cpu_throw_if_integer_div_error(inductor_cpu_integer_div_error);
}
"""


pytestmark = pytest.mark.usefixtures("fresh_compile")  # conftest.py


def test_kernel_without_division_never_touches_the_flag():
    source = kernels.isolate_integer_division_flag(KERNEL.replace("BODY", "in_ptr0[0] * 2"))
    assert "inductor_cpu_integer_div_error_flag" not in source
    assert "inductor_cpu_throw_if_integer_div_error" in source  # its own local, harmless


@pytest.mark.parametrize("helper", ["floor_divide_integral", "remainder_integral", "mod"])
def test_kernel_with_division_holds_the_process_wide_lock(helper):
    source = kernels.isolate_integer_division_flag(
        KERNEL.replace("BODY", f"{helper}(in_ptr0[0], in_ptr0[1])"))
    guard = source.index("kiln_integer_div_flag_guard(kiln_integer_div_flag_mutex)")
    assert guard < source.index(kernels.INTEGER_DIV_FLAG_SET)
    assert "inline std::mutex kiln_integer_div_flag_mutex;" in source


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_division_by_zero_raises_at_synchronize_and_later_work_runs(device):
    fn = torch.compile(lambda a, b: a // b + 1)
    a = torch.arange(12, device=device)
    ones = torch.ones(12, dtype=torch.long, device=device)
    assert torch.equal(fn(a, ones).cpu(), torch.arange(12) + 1)
    zeros = ones.clone()
    zeros[5] = 0
    fn(a, zeros)
    with pytest.raises(RuntimeError, match=r"floor_divide.* in compiled graph .*ZeroDivisionError"):
        torch.kiln.synchronize(device)
    assert torch.equal(fn(a, ones).cpu(), torch.arange(12) + 1)


def test_dividing_and_other_kernels_on_two_devices_at_once():
    """Kernels running at the same time on kiln:0 and kiln:1 workers: one
    divides by zero over and over, the other never divides. Before the
    rewrite, the second kernel's exit could null the shared flag while the
    first divided (a throw inside OpenMP, terminating the process). A
    stress check, not a proof: the interleaving is up to the scheduler."""
    divide = torch.compile(lambda a, b: a // b)
    other = torch.compile(lambda x: (x * 3 + 1).sum(1))
    a = torch.arange(1 << 16, device="kiln:0").reshape(256, 256)
    b = torch.ones_like(a)
    b[0, 0] = 0
    x = torch.randn(256, 256, device="kiln:1")
    expected = (x * 3 + 1).sum(1).cpu()
    outs = []
    for _ in range(30):
        divide(a, b)
        outs.append(other(x))
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        torch.kiln.synchronize(0)
    for out in outs:
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype,dynamic", rotate(
    [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8], [False, True]))
def test_truncation_division_gives_eagers_quotients_and_raises_on_zero(dtype, dynamic):
    """torch.div(a, b, rounding_mode="trunc") on integers: Inductor writes a
    bare `a / b`, which killed the process with SIGFPE on a zero divisor (on
    CPU too). Kiln computes it from the checked floor division: eager's
    quotients, and ZeroDivisionError at synchronization."""
    fn = torch.compile(lambda a, b: torch.div(a, b, rounding_mode="trunc"), dynamic=dynamic)
    g = torch.Generator().manual_seed(0)
    low, high = {torch.uint8: (0, 256), torch.int8: (-128, 128)}.get(dtype, (-1000, 1000))
    a = torch.randint(low, high, (1037,), dtype=dtype, generator=g)  # odd size: a scalar tail
    b = torch.randint(low, high, (1037,), dtype=dtype, generator=g)
    b[b == 0] = 7
    out = fn(a.to("kiln"), b.to("kiln"))
    assert out.dtype == dtype
    assert torch.equal(out.cpu(), torch.div(a, b, rounding_mode="trunc"))
    b[3] = 0
    fn(a.to("kiln"), b.to("kiln"))
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        torch.kiln.synchronize()
    b[3] = 7
    assert torch.equal(fn(a.to("kiln"), b.to("kiln")).cpu(), torch.div(a, b, rounding_mode="trunc"))


def test_truncation_division_of_a_python_number_by_a_kiln_tensor():
    fn = torch.compile(lambda b: torch.div(7, b, rounding_mode="trunc"))
    b = torch.tensor([3, -2, 1, 5, -7, 4])
    assert torch.equal(fn(b.to("kiln")).cpu(), torch.div(7, b, rounding_mode="trunc"))
    fn(torch.tensor([3, 0], device="kiln"))
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        torch.kiln.synchronize()
