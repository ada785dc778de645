"""torch.kiln.FloatTensor and the other legacy typed tensor classes, with
torch.cuda.FloatTensor's semantics (Note [Legacy typed tensor classes] in
torch_kiln/csrc/python/LegacyTensorTypes.cc). Every result is compared with
what the CPU class (torch.FloatTensor, ...) gives."""

import warnings

import pytest
import torch

from conftest import assert_same

# name -> dtype, as torch.cuda.<name> has it.
LEGACY_TYPES = {
    "ByteTensor": torch.uint8,
    "CharTensor": torch.int8,
    "ShortTensor": torch.int16,
    "IntTensor": torch.int32,
    "LongTensor": torch.int64,
    "HalfTensor": torch.float16,
    "BFloat16Tensor": torch.bfloat16,
    "FloatTensor": torch.float32,
    "DoubleTensor": torch.float64,
    "BoolTensor": torch.bool,
}

DEVICES = [0, 1]


def test_torch_kiln_has_the_classes_torch_cuda_has():
    cuda_names = {n for n in dir(torch.cuda) if n.endswith("Tensor") and n != "Tensor"}
    kiln_names = {n for n in dir(torch.kiln) if n.endswith("Tensor")}
    assert cuda_names == set(LEGACY_TYPES)
    assert kiln_names == cuda_names
    assert set(LEGACY_TYPES) <= set(torch.kiln.__all__)


@pytest.mark.parametrize("name", sorted(LEGACY_TYPES))
def test_class_attributes(name):
    cls = getattr(torch.kiln, name)
    cuda_cls = getattr(torch.cuda, name)
    assert cls.__name__ == cuda_cls.__name__ == name
    assert cls.__module__ == "torch.kiln"
    assert repr(cls) == f"<class 'torch.kiln.{name}'>"
    assert cls.dtype == cuda_cls.dtype == LEGACY_TYPES[name]
    assert cls.layout == torch.strided
    assert cls.is_kiln is True
    assert cls.is_cuda is False
    assert cls.is_sparse is False and cls.is_sparse_csr is False
    assert cls in torch._tensor_classes
    # The classes carry torch.Tensor's methods, as torch.cuda's do.
    assert cls.add is torch.Tensor.add and cls.sum is torch.Tensor.sum


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(LEGACY_TYPES))
def test_construct_on_current_device(name, device):
    cls, cpu_cls = getattr(torch.kiln, name), getattr(torch, name)
    with torch.kiln.device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        by_size = cls(2, 3)
        by_tuple = cls(torch.Size([4]))
        empty = cls()
        data = [[1, 0], [3, 1]]
        by_data = cls(data)
    for t in (by_size, by_tuple, empty, by_data):
        assert t.device == torch.device("kiln", device)
        assert t.dtype == LEGACY_TYPES[name]
        assert isinstance(t, cls)
    assert by_size.shape == (2, 3) and by_tuple.shape == (4,) and empty.shape == (0,)
    assert_same(by_data, cpu_cls(data))


@pytest.mark.parametrize("current", DEVICES)
def test_construct_with_device_argument(current):
    other = 1 - current
    with torch.kiln.device(current), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.kiln.FloatTensor(3, device=f"kiln:{other}")
        d = torch.kiln.LongTensor([5, 6], device=torch.device("kiln", other))
    assert t.device == torch.device("kiln", other) and t.shape == (3,)
    assert d.device == torch.device("kiln", other)
    assert_same(d, torch.LongTensor([5, 6]))


@pytest.mark.parametrize("device", DEVICES)
def test_construct_from_kiln_tensor_and_storage(device):
    src = torch.arange(4.0, device=f"kiln:{device}")
    with torch.kiln.device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        same = torch.kiln.FloatTensor(src)
        from_storage = torch.kiln.FloatTensor(src.untyped_storage())
    assert same.data_ptr() == src.data_ptr()  # as torch.FloatTensor(t): an alias
    assert same.device == src.device
    assert from_storage.device == src.device and from_storage.data_ptr() == src.data_ptr()
    assert_same(from_storage, torch.arange(4.0))
    # A storage on another device than the current one is refused, as CUDA's
    # class refuses one (the new tensor is made on the current device first).
    with torch.kiln.device(1 - device), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(RuntimeError, match=f'storage on different device "kiln:{device}"'):
            torch.kiln.FloatTensor(src.untyped_storage())


def test_constructor_errors_are_cudas():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(RuntimeError, match="legacy constructor expects device type: kiln but "
                                               "device type: cpu was passed"):
            torch.kiln.FloatTensor(2, device="cpu")
        with pytest.raises(TypeError, match="expected TensorOptions.*device=kiln"):
            torch.kiln.FloatTensor(torch.ones(2))  # a CPU tensor, as CUDA's class refuses
        with pytest.raises(TypeError, match="expected TensorOptions.*dtype=float"):
            torch.kiln.FloatTensor(torch.ones(2, dtype=torch.int64, device="kiln"))
        with pytest.raises(TypeError, match="data must be a sequence"):
            torch.kiln.FloatTensor(2.5)
        with pytest.raises(TypeError, match="invalid combination of arguments"):
            torch.kiln.FloatTensor(dtype=torch.float32)
        with pytest.raises(RuntimeError, match="Invalid device kiln:7: Kiln has 2 devices"):
            torch.kiln.FloatTensor(2, device="kiln:7")
    with pytest.raises(TypeError, match="not an acceptable base type"):
        type("Sub", (torch.kiln.FloatTensor,), {})


def test_constructor_warns_once_like_cuda():
    code = (
        "import warnings, torch\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    torch.kiln.FloatTensor(2); torch.kiln.IntTensor(2)\n"
        "msgs = [str(x.message) for x in w if 'DtypeTensor' in str(x.message)]\n"
        "assert len(msgs) == 1, msgs\n"
        "assert 'torch.kiln.*DtypeTensor constructors are no longer recommended' in msgs[0]\n"
        "assert \"device='kiln'\" in msgs[0]\n"
    )
    from conftest import run_python

    r = run_python(code)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(LEGACY_TYPES))
def test_isinstance(name, device):
    cls = getattr(torch.kiln, name)
    t = torch.zeros(2, dtype=LEGACY_TYPES[name], device=f"kiln:{device}")
    assert isinstance(t, cls)
    assert isinstance(t, torch.Tensor)
    assert not isinstance(t.cpu(), cls)
    assert not isinstance(t, getattr(torch, name))  # the CPU class
    other = next(n for n in LEGACY_TYPES if n != name)
    assert not isinstance(t, getattr(torch.kiln, other))
    assert not isinstance(torch.nn.Parameter(t.float()), torch.kiln.DoubleTensor)
    assert isinstance(torch.nn.Parameter(t.float()), torch.kiln.FloatTensor)
    assert not isinstance("a string", cls)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(LEGACY_TYPES))
def test_type_returns_the_class_name(name, device):
    t = torch.zeros(2, dtype=LEGACY_TYPES[name], device=f"kiln:{device}")
    assert t.type() == f"torch.kiln.{name}"
    assert t.cpu().type() == f"torch.{name}"


@pytest.mark.parametrize("non_blocking", [False, True])
@pytest.mark.parametrize("current", DEVICES)
@pytest.mark.parametrize("form", ["string", "class"])
def test_type_converts_to_kiln(form, current, non_blocking):
    cpu = torch.tensor([1.5, -2.0, 3.0])
    if non_blocking:
        cpu = cpu.pin_memory()
    target = "torch.kiln.DoubleTensor" if form == "string" else torch.kiln.DoubleTensor
    with torch.kiln.device(current):
        # From the CPU: to the current kiln device, as CUDA's goes to the current GPU.
        moved = cpu.type(target, non_blocking=non_blocking)
        assert moved.device == torch.device("kiln", current)
        assert moved.dtype == torch.float64
        assert isinstance(moved, torch.kiln.DoubleTensor)
        # From a tensor on the other kiln device: it stays on its device.
        other = cpu.to(f"kiln:{1 - current}")
        converted = other.type(target, non_blocking=non_blocking)
        assert converted.device == other.device
        torch.kiln.synchronize(0)
        torch.kiln.synchronize(1)
    assert_same(moved, cpu.double())
    assert_same(converted, cpu.double())
    # Same type: the tensor itself, as for CUDA.
    assert moved.type(target) is moved


@pytest.mark.parametrize("form", ["string", "class"])
def test_type_converts_back_to_cpu(form):
    t = torch.tensor([1, 2, 3], device="kiln:1")
    target = "torch.FloatTensor" if form == "string" else torch.FloatTensor
    back = t.type(target)
    assert back.device == torch.device("cpu")
    assert_same(back, torch.tensor([1.0, 2.0, 3.0]))


def test_type_rejects_unknown_kiln_type():
    t = torch.ones(2, device="kiln")
    with pytest.raises(ValueError, match="invalid type: 'torch.kiln.NopeTensor'"):
        t.type("torch.kiln.NopeTensor")
