"""kl semantics that compiled kernels and the simulator must share, found
by a fresh-user sweep of the kl language (each case: compiled on kiln, the
simulator on CPU tensors, and the simulator on kiln tensors with
KILN_KL_SIMULATE=1, against PyTorch):

- ``-tile`` is a sign flip (torch.neg): -0.0 for 0.0; it was ``0 - tile``;
- a number given as kl.load's ``other=`` or kl.store's value follows
  PyTorch's rule, as kl.full's value: a bool tensor takes ``bool(number)``
  (nan and inf are True; compiled code made them False), a number an
  integer dtype cannot hold raises (compiled code wrote 0 or a saturated
  value where the simulator raised);
- the simulator on kiln tensors gives arguments over one storage one host
  copy (a store through one argument was not seen by a load through the
  other);
- a name assigned the kl.range loop variable (``last = k``) is carried out
  of the loop, as in Python.
"""

import pytest
import torch

import torch_kiln.kl as kl
from kl_helpers import private_kernel_cache, where  # noqa: F401

RUNS = ["compiled", "simulator", "simulator on kiln"]


@pytest.fixture(autouse=True)
def _cache(private_kernel_cache):  # noqa: F811
    yield


def launch(kernel, run, monkeypatch, *tensors, **kwargs):
    """Runs kernel[(1,)] on copies of ``tensors`` on the run's device and
    returns them on the CPU."""
    monkeypatch.setenv("KILN_KL_SIMULATE", "1" if run == "simulator on kiln" else "0")
    device = "cpu" if run == "simulator" else "kiln"
    args = [t.to(device) for t in tensors]
    kernel[(1,)](*args, **kwargs)
    return [a.cpu() for a in args]


@kl.jit
def negate(o, x, N: kl.constexpr):
    i = kl.arange(0, N)
    t = kl.load(x, i)
    kl.store(o, (0, i), -t)
    kl.store(o, (1, i), 1.0 / (-t))


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unary_minus_flips_the_sign_of_zero(run, dtype, monkeypatch):
    x = torch.tensor([0.0, -0.0, 1.5, -2.0, float("inf"), float("-inf")], dtype=dtype)
    out, _ = launch(negate, run, monkeypatch, torch.zeros(2, 6, dtype=dtype), x, N=6)
    expected = torch.stack([torch.neg(x), 1.0 / torch.neg(x)])
    assert torch.equal(out.view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                       expected.view(torch.int16 if dtype.itemsize == 2 else torch.int32)), out


@kl.jit
def negate_ints(o, x, N: kl.constexpr):
    i = kl.arange(0, N)
    kl.store(o, i, -kl.load(x, i))


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_unary_minus_of_integers_wraps_as_torch(run, dtype, monkeypatch):
    info = torch.iinfo(dtype)
    x = torch.tensor([0, -1, 5, info.min, info.max], dtype=dtype)
    out, _ = launch(negate_ints, run, monkeypatch, torch.zeros_like(x), x, N=5)
    assert torch.equal(out, torch.neg(x))


@kl.jit
def load_with_other(o, x, OTHER: kl.constexpr):
    i = kl.arange(0, 4)
    kl.store(o, i, kl.load(x, i, mask=i < 2, other=OTHER))  # LINE:other


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("other", [float("inf"), float("-inf"), float("nan"), 2.0, 0.0])
def test_a_bool_tensors_other_is_the_numbers_truth(run, other, monkeypatch):
    x = torch.tensor([True, False, True, True])
    out, _ = launch(load_with_other, run, monkeypatch, torch.zeros(4, dtype=torch.bool), x,
                    OTHER=other)
    assert out.tolist() == [True, False, bool(other), bool(other)]


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("dtype,other", [(torch.int32, float("nan")), (torch.int64, float("-inf")),
                                         (torch.int32, 2 ** 40), (torch.int64, 1e30)])
def test_an_other_the_dtype_cannot_hold_raises(run, dtype, other, monkeypatch):
    x = torch.arange(4, dtype=dtype)
    with pytest.raises(kl.KernelError, match=rf"{where(__file__, 'LINE:other')}: kl.load other "
                                             rf".* cannot be represented as"):
        launch(load_with_other, run, monkeypatch, torch.zeros_like(x), x, OTHER=other)


@pytest.mark.parametrize("run", RUNS)
def test_an_other_the_dtype_holds_is_kept(run, monkeypatch):
    x = torch.arange(4, dtype=torch.int64)
    out, _ = launch(load_with_other, run, monkeypatch, torch.zeros_like(x), x, OTHER=2 ** 40)
    assert out.tolist() == [0, 1, 2 ** 40, 2 ** 40]


@kl.jit
def store_number(o, VALUE: kl.constexpr):
    kl.store(o, kl.arange(0, 4), VALUE)  # LINE:store


@pytest.mark.parametrize("run", RUNS)
def test_storing_a_number_follows_the_same_rule(run, monkeypatch):
    out, = launch(store_number, run, monkeypatch, torch.zeros(4, dtype=torch.bool),
                  VALUE=float("nan"))
    assert out.tolist() == [True] * 4
    with pytest.raises(kl.KernelError, match=rf"{where(__file__, 'LINE:store')}: kl.store value "
                                             rf"nan cannot be represented as int32"):
        launch(store_number, run, monkeypatch, torch.zeros(4, dtype=torch.int32),
               VALUE=float("nan"))


@kl.jit
def shift_through_two_names(o, x, N: kl.constexpr):
    i = kl.arange(0, N)
    kl.store(o, i, kl.load(x, i) * 3.0 + 1.0)
    kl.store(o, i, kl.load(x, N - 1 - i))  # reads what the first store wrote, if o is x


@pytest.mark.parametrize("run", RUNS)
def test_arguments_over_one_storage_see_each_others_stores(run, monkeypatch):
    base = torch.arange(12.0)
    expected = base.clone()
    expected[:6] = expected[:6] * 3 + 1
    expected[:6] = expected[:6].flip(0)
    t = base.clone().to("cpu" if run == "simulator" else "kiln")
    monkeypatch.setenv("KILN_KL_SIMULATE", "1" if run == "simulator on kiln" else "0")
    shift_through_two_names[(1,)](t, t, N=6)  # the same tensor as o and x
    assert torch.equal(t.cpu(), expected)
    # overlapping views of one storage
    t = base.clone().to("cpu" if run == "simulator" else "kiln")
    shift_through_two_names[(1,)](t[2:8], t[0:6], N=6)
    expected = base.clone()
    expected[2:8] = base[0:6] * 3 + 1
    expected[2:8] = expected[0:6].flip(0)
    assert torch.equal(t.cpu(), expected)


@kl.jit
def last_trip(o, n, STEP: kl.constexpr):
    last = kl.full((), -1, kl.int64)
    total = kl.full((), 0, kl.int64)
    for k in kl.range(0, n, STEP):
        last = k
        total = total + k
    kl.store(o, 0, last)
    kl.store(o, 1, total)


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("n,step", [(0, 1), (1, 1), (5, 1), (5, 2)])
def test_the_loop_variable_can_be_carried_out_of_the_loop(run, n, step, monkeypatch):
    monkeypatch.setenv("KILN_KL_SIMULATE", "1" if run == "simulator on kiln" else "0")
    o = torch.zeros(2, dtype=torch.int64, device="cpu" if run == "simulator" else "kiln")
    last_trip[(1,)](o, n, STEP=step)
    trips = list(range(0, n, step))
    assert o.cpu().tolist() == [trips[-1] if trips else -1, sum(trips)]
