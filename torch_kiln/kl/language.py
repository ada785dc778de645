"""The kl language: the functions a @kl.jit kernel calls (Triton's and NKI's
vocabulary), with their shape and dtype rules and the tile-model checks.

Each function works out its result's shape and dtype here, checks the result
against the device's tile model (tile_model.py: partition dim, dtypes), and
hands the operation to the running backend: the tracer (tracer.py, records
IR) or the simulator (simulator.py, computes with torch). Both see the same
rules, so a kernel fails the same way traced, simulated and compiled.

Dtype rules are PyTorch's (``torch.result_type``; a Python number is a weak
scalar), with true division of integers giving float32; math functions of
integer tiles give float32. Shapes broadcast as numpy's. Errors:
KernelError naming the kernel and the user's line.
"""

from __future__ import annotations

import builtins
import functools
import numbers

import torch

from torch_kiln.kl import tile_model
from torch_kiln.kl.errors import backend, error
from torch_kiln.kl.tile import TensorArg, Tile

float32, bfloat16, float16 = torch.float32, torch.bfloat16, torch.float16
int32, int64 = torch.int32, torch.int64
bool_ = torch.bool

_INTEGRAL = (torch.int32, torch.int64, torch.bool)


class constexpr:
    """Annotation of a kernel parameter whose value is a compile-time
    constant (``BLOCK: kl.constexpr``): an int, float or bool, baked into the
    traced kernel (one compiled specialisation per value), usable as a tile
    shape, in kl.arange and kl.static_range."""


def _name(dtype) -> str:
    return tile_model.dtype_name(dtype)


def _describe(value) -> str:
    if isinstance(value, Tile):
        return f"a tile of shape {value.shape} {_name(value.dtype)}"
    return f"{type(value).__name__} {value!r}"


def check_tile(shape, dtype, what: str = "tile", scratch: bool = True) -> None:
    """Raises KernelError if a tile of ``shape``/``dtype`` breaks the tile
    model (its dtype, partition dim and, if ``scratch``, its size)."""
    if dtype not in tile_model.DTYPES:
        raise error(f"{what} of shape {tuple(shape)} has dtype {_name(dtype)}, which the kiln "
                    f"device does not support; supported: {tile_model.supported_dtype_names()} "
                    "(torch.kiln.get_device_properties().tile_dtypes)")
    p = tile_model.partition_dim(tuple(shape))
    if p > tile_model.MAX_PARTITION_DIM:
        raise error(f"{what} of shape {tuple(shape)} {_name(dtype)} has partition (leading) "
                    f"dimension {p}; the kiln tile model allows at most "
                    f"{tile_model.MAX_PARTITION_DIM} (torch.kiln.get_device_properties()."
                    f"tile_max_partition_dim): split it into tiles of at most "
                    f"{tile_model.MAX_PARTITION_DIM} rows")
    row = tile_model.bytes_per_partition(tuple(shape), dtype)
    if scratch and row > tile_model.SCRATCH_BYTES_PER_PARTITION:
        raise error(f"{what} of shape {tuple(shape)} {_name(dtype)} needs {row} bytes of scratch "
                    f"per partition; the kiln tile model has "
                    f"{tile_model.SCRATCH_BYTES_PER_PARTITION} (torch.kiln.get_device_properties()."
                    "tile_scratch_bytes_per_partition): use smaller tiles")


_INDEX_OPS = ("add", "sub", "mul", "expand_dims")


def _is_index(kind, operands, dtype) -> bool:
    """Whether an op's result is an index tile (Tile.index): kl.arange, or an
    int64 ``+ - *`` or ``t[:, None]`` whose tile operands are index tiles or
    scalars. Index tiles are computed in place by compiled kernels and are
    not counted in scratch (docs/kernels.md, "The device's tile model"); a
    tile the lowering does store is still counted in the program's peak."""
    if kind == "arange":
        return True
    return (kind in _INDEX_OPS and dtype == torch.int64 and
            all(not isinstance(o, Tile) or o.index or o.shape == () for o in operands))


def _make(kind, operands, shape, dtype, **attrs) -> Tile:
    index = _is_index(kind, operands, dtype)
    check_tile(shape, dtype, scratch=not index)
    tile = backend().op(kind, operands, tuple(shape), dtype, attrs)
    if tile is not None:
        tile.index = index
    return tile


def _const_int(value, what: str) -> int:
    if isinstance(value, Tile):
        raise error(f"{what} must be a constant int (a Python int or a kl.constexpr argument), "
                    f"got a runtime value ({_describe(value)})")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise error(f"{what} must be a constant int, got {_describe(value)}")
    return int(value)


def _operand(value, what="operand"):
    if isinstance(value, Tile):
        return value
    if isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, numbers.Real):
        return float(value) if not isinstance(value, numbers.Integral) else int(value)
    if isinstance(value, TensorArg):
        raise error(f"{what}: tensor argument '{value.name}' is not a tile; kl.load it first")
    raise error(f"{what} must be a tile or a Python number, got {type(value).__name__}")


def _proto(value):
    """A tensor standing for ``value`` in torch.result_type: a scalar tile
    (shape ()) is a 0-dim tensor, so it promotes as PyTorch's 0-dim tensors
    do (a float32 scalar with a bfloat16 tile gives bfloat16)."""
    if not isinstance(value, Tile):
        return value
    return torch.empty((), dtype=value.dtype) if value.shape == () else torch.empty(1, dtype=value.dtype)


def result_type(*values) -> torch.dtype:
    """PyTorch's promotion of tiles and Python numbers (numbers are weak)."""
    tiles = [v for v in values if isinstance(v, Tile)]
    if not tiles:
        return torch.tensor(values[0]).dtype
    acc = _proto(tiles[0])
    for v in values:
        p = _proto(v)
        # 0-dim only while every tile so far is: as one call over all operands
        dims = acc.dim() > 0 or (isinstance(p, torch.Tensor) and p.dim() > 0)
        acc = torch.empty((1,) if dims else (), dtype=torch.result_type(acc, p))
    return acc.dtype


def broadcast_shapes(*shapes, what="operands") -> tuple[int, ...]:
    try:
        return tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        raise error(f"{what} of shapes {', '.join(str(tuple(s)) for s in shapes)} do not "
                    "broadcast (numpy rules: trailing dims equal or 1)") from None


def _shape(v):
    return v.shape if isinstance(v, Tile) else ()


_ARITH = {"add", "sub", "mul", "div", "floordiv", "mod", "maximum", "minimum"}
_COMPARE = {"lt", "le", "gt", "ge", "eq", "ne"}
_BITWISE = {"and", "or", "xor"}


_HALF = (torch.bfloat16, torch.float16)


def _half_scalar(kind: str, value, common):
    """Python number ``value`` as a half-precision binary op uses it.

    Note [kl Python numbers with half tiles]: PyTorch's CPU kernels round a
    Python number to the tensor's dtype before ``+ - < == maximum`` etc. (the
    TensorIterator casts it to the common dtype), but keep it at float32
    precision in ``*`` and ``/`` (``mul_kernel``/``div_true_kernel`` take
    ``original_scalar_value<opmath_t>``): ``bf16_t * 1.01`` uses 1.01f,
    ``bf16_t + 1.01`` uses 1.0078125. kl does the same, here, at trace time, so
    that the simulator and compiled code see one already-rounded number; both
    then compute in float32 and round the result to the tile's dtype once.
    (``x / t`` with x a number is one division; PyTorch's ``__rtruediv__``
    is ``t.reciprocal() * x``, which rounds twice.)
    """
    if common not in _HALF or isinstance(value, Tile):
        return value
    target = torch.float32 if kind in ("mul", "div") else common
    return torch.tensor(value, dtype=torch.float64).to(target).item()


def _half_operand(kind: str, x, common):
    """Operand ``x`` of a binary op whose common dtype is ``common``, as
    PyTorch's CPU kernels use it when that is bfloat16 or float16 (Note [kl
    Python numbers with half tiles]): a Python number or a scalar tile (a
    scalar argument, a reduction's result) is rounded to ``common`` except in
    ``*`` and ``/``, which take it at float32 precision; a tile of another
    dtype with dims is converted to ``common`` (TensorIterator's cast)."""
    if common not in _HALF:
        return x
    if not isinstance(x, Tile):
        return _half_scalar(kind, x, common)
    if x.dtype == common:
        return x
    if x.shape == () and kind in ("mul", "div"):
        return cast(x, torch.float32)
    return cast(x, common)


def binary(kind: str, a, b) -> Tile:
    a, b = _operand(a), _operand(b)
    if not isinstance(a, Tile) and not isinstance(b, Tile):
        a = full((), a, result_type(a))
    shape = broadcast_shapes(_shape(a), _shape(b))
    common = result_type(a, b)
    a, b = _half_operand(kind, a, common), _half_operand(kind, b, common)
    if kind in _COMPARE:
        return _make(kind, [a, b], shape, torch.bool, common=common)
    if kind in _BITWISE:
        if common not in _INTEGRAL:
            symbol = {"and": "&", "or": "|", "xor": "^"}.get(kind, kind)
            raise error(f"'{symbol}' needs bool or integer tiles, got {_describe(a)} and "
                        f"{_describe(b)}")
        return _make(kind, [a, b], shape, common, common=common)
    if kind in ("floordiv", "mod") and common not in (torch.int32, torch.int64):
        raise error(f"'//' and '%' are defined for integer tiles here, got {_describe(a)} and "
                    f"{_describe(b)}; for floats write kl.floor(a / b)")
    if kind == "div" and common in _INTEGRAL:
        common = torch.float32
    if common == torch.bool and kind in ("add", "sub", "mul"):
        common = torch.int64
    return _make(kind, [a, b], shape, common, common=common)


def invert(x) -> Tile:
    if x.dtype not in _INTEGRAL:
        raise error(f"'~' needs a bool or integer tile, got {_describe(x)}")
    return _make("invert", [x], x.shape, x.dtype)


def negative(x) -> Tile:
    """``-x`` (Tile.__neg__): a float tile's sign flipped, as torch.neg
    (-0.0 for 0.0, NaN's sign too); ``0 - x`` for integer tiles (wrapping)
    and numbers."""
    x = _operand(x)
    if isinstance(x, Tile) and x.dtype.is_floating_point:
        return _make("neg", [x], x.shape, x.dtype)
    return binary("sub", 0, x)


def maximum(a, b) -> Tile:
    """Elementwise maximum (NaN propagates, as torch.maximum)."""
    return binary("maximum", a, b)


def minimum(a, b) -> Tile:
    """Elementwise minimum (NaN propagates, as torch.minimum)."""
    return binary("minimum", a, b)


def where(condition, a, b) -> Tile:
    """``a`` where ``condition`` (a bool tile) is true, else ``b``; broadcast."""
    condition, a, b = _operand(condition), _operand(a), _operand(b)
    if not isinstance(condition, Tile) or condition.dtype != torch.bool:
        raise error(f"kl.where needs a bool tile as condition, got {_describe(condition)}")
    if not isinstance(a, Tile) and not isinstance(b, Tile):
        a = full((), a, result_type(a))
    shape = broadcast_shapes(condition.shape, _shape(a), _shape(b))
    dtype = result_type(a, b)
    for operand in (a, b):
        if not isinstance(operand, Tile):
            _check_representable(operand, dtype, "kl.where operand")
    return _make("where", [condition, a, b], shape, dtype)


def _unary_float(kind):
    def f(x) -> Tile:
        x = _operand(x)
        if not isinstance(x, Tile):
            x = full((), x, result_type(x))
        dtype = x.dtype if x.dtype.is_floating_point else torch.float32
        return _make(kind, [x], x.shape, dtype)
    f.__name__ = kind
    f.__doc__ = f"Elementwise {kind} (integer tiles give float32)."
    return f


exp = _unary_float("exp")
log = _unary_float("log")
sqrt = _unary_float("sqrt")
rsqrt = _unary_float("rsqrt")
tanh = _unary_float("tanh")
sigmoid = _unary_float("sigmoid")
erf = _unary_float("erf")
floor = _unary_float("floor")
fast_exp = _unary_float("fast_exp")
fast_exp.__doc__ = (
    "Elementwise exp, faster and less exact than kl.exp (torch.exp's 1-ULP Sleef exp): float32 "
    "tiles use the range reduction and polynomial of ATen's Vectorized<float>::exp_u20. On AVX2 it "
    "is right on every float (at most 5 ULP from exact, checked on all 2^32 floats; NaN gives NaN, "
    "results below FLT_MIN round to denormals); elsewhere NaN and inputs below -86 or above 88 take "
    "Sleef's exp. Other dtypes, scalars and the simulator use torch.exp. Integer tiles give "
    "float32. Like Triton's tl.exp on GPUs, which is an approximate exp2.")


def abs(x) -> Tile:  # noqa: A001  (kl.abs, as tl.abs)
    """Elementwise absolute value (same dtype)."""
    x = _operand(x)
    return _make("abs", [x], x.shape, x.dtype)


def cast(x, dtype) -> Tile:
    """``x`` converted to ``dtype`` (``x.to(dtype)``): C++/PyTorch conversion
    (floats to ints truncate, bfloat16 rounds to nearest even)."""
    if not isinstance(dtype, torch.dtype):
        raise error(f".to() needs a torch dtype such as kl.float32, got {dtype!r}")
    x = _operand(x)
    if not isinstance(x, Tile):
        return full((), x, dtype)
    if x.dtype == dtype:
        return x
    return _make("cast", [x], x.shape, dtype)


def expand_dims(x: Tile, index) -> Tile:
    """``x[:, None]``-style indexing: ``:`` keeps a dim, ``None`` inserts one of size 1."""
    items = index if isinstance(index, tuple) else (index,)
    shape, d, inserted = [], 0, []
    for item in items:
        if item is None:
            inserted.append(len(shape))
            shape.append(1)
        elif isinstance(item, slice) and item == slice(None):
            if d >= x.ndim:
                raise error(f"index {index!r} has more ':' than the tile's {x.ndim} dims")
            shape.append(x.shape[d])
            d += 1
        else:
            raise error(f"tiles can only be indexed with ':' and None (t[:, None]), got "
                        f"{item!r}; use kl.load for gathers")
    shape += list(x.shape[d:])
    return _make("expand_dims", [x], tuple(shape), x.dtype, inserted=tuple(inserted))


def broadcast_to(x, shape) -> Tile:
    """``x`` broadcast (materialised) to ``shape``."""
    x = _operand(x)
    shape = tuple(_const_int(s, "kl.broadcast_to shape") for s in shape)
    if broadcast_shapes(_shape(x), shape) != shape:
        raise error(f"cannot broadcast {_describe(x)} to shape {shape}")
    if not isinstance(x, Tile):
        return full(shape, x, result_type(x))
    return _make("broadcast", [x], shape, x.dtype)


def transpose(x: Tile) -> Tile:
    """The transpose of a 2-D tile."""
    if not isinstance(x, Tile) or x.ndim != 2:
        raise error(f"kl.transpose needs a 2-D tile, got {_describe(x)}")
    return _make("transpose", [x], (x.shape[1], x.shape[0]), x.dtype)


def _axis(x: Tile, axis, what) -> int:
    axis = _const_int(axis, f"{what} axis")
    if not -x.ndim <= axis < x.ndim:
        raise error(f"{what} axis {axis} is out of range for {_describe(x)}")
    return axis % x.ndim


def _reduce(kind, x, axis, keepdims):
    x = _operand(x)
    if not isinstance(x, Tile) or x.ndim == 0:
        raise error(f"kl.{kind} needs a tile of rank >= 1, got {_describe(x)}")
    axis = _axis(x, axis, f"kl.{kind}")
    shape = list(x.shape)
    if keepdims:
        shape[axis] = 1
    else:
        del shape[axis]
    if kind == "sum":
        dtype = torch.int64 if x.dtype in _INTEGRAL else x.dtype
    else:
        dtype = x.dtype
    return _make(kind, [x], tuple(shape), dtype, axis=axis, keepdims=bool(keepdims))


def sum(x, axis=0, keepdims=False) -> Tile:  # noqa: A001
    """Sum along ``axis`` (bool/int tiles give int64; floats accumulate in
    float32 and round to the tile's dtype)."""
    return _reduce("sum", x, axis, keepdims)


def max(x, axis=0, keepdims=False) -> Tile:  # noqa: A001
    """Maximum along ``axis`` (NaN propagates)."""
    return _reduce("max", x, axis, keepdims)


def min(x, axis=0, keepdims=False) -> Tile:  # noqa: A001
    """Minimum along ``axis`` (NaN propagates)."""
    return _reduce("min", x, axis, keepdims)


def matmul(a, b, acc_dtype=torch.float32) -> Tile:
    """``a @ b`` for 2-D tiles a (M, K), b (K, N): (M, N) in ``acc_dtype``
    (float32), products and sums in acc_dtype."""
    if not isinstance(a, Tile) or not isinstance(b, Tile) or a.ndim != 2 or b.ndim != 2:
        raise error(f"kl.matmul needs two 2-D tiles, got {_describe(a)} and {_describe(b)}")
    if a.shape[1] != b.shape[0]:
        raise error(f"kl.matmul: inner dims differ, {a.shape} @ {b.shape}")
    if acc_dtype != torch.float32:
        raise error(f"kl.matmul acc_dtype must be kl.float32, got {acc_dtype}")
    if not (a.dtype.is_floating_point and b.dtype.is_floating_point):
        raise error(f"kl.matmul needs floating-point tiles, got {_describe(a)} and {_describe(b)}")
    return _make("matmul", [a, b], (a.shape[0], b.shape[1]), acc_dtype)


def dot(a, b, acc_dtype=torch.float32) -> Tile:
    """Alias of matmul (Triton's tl.dot)."""
    return matmul(a, b, acc_dtype)


def arange(start, end=None) -> Tile:
    """The int64 tile [start, start + 1, ..., end - 1]; bounds are constants."""
    if end is None:
        start, end = 0, start
    start, end = _const_int(start, "kl.arange start"), _const_int(end, "kl.arange end")
    if end <= start:
        raise error(f"kl.arange({start}, {end}) is empty; end must be > start")
    return _make("arange", [], (end - start,), torch.int64, start=start)


def _const_shape(shape, what):
    if isinstance(shape, (int, Tile)) and not isinstance(shape, bool):
        shape = (shape,)
    return tuple(_const_int(s, f"{what} shape") for s in shape)


def full(shape, value, dtype=torch.float32) -> Tile:
    """A tile of ``shape`` (constants) filled with ``value`` (a Python number
    or a scalar tile)."""
    shape = _const_shape(shape, "kl.full")
    if isinstance(value, Tile):
        if value.shape != ():
            raise error(f"kl.full value must be a scalar, got {_describe(value)}")
        check_tile(shape, dtype)
        v = cast(value, dtype)
        return v if shape == () else broadcast_to(v, shape)
    if not isinstance(value, (bool, int, float)):
        raise error(f"kl.full value must be a number, got {type(value).__name__}")
    value = _exact_number(value, dtype, "kl.full value")
    return _make("full", [], shape, dtype, value=value)


def _exact_number(value, dtype, what: str):
    """A Python number given for a tile of ``dtype`` (kl.load's other=,
    kl.store's value): raises as kl.full if ``dtype`` cannot hold it (nan as
    int32: compiled code wrote 0 where the simulator raised); a bool for a
    bool tile (nan and inf are True, as torch's; C++ converted them to
    false)."""
    _check_representable(value, dtype, what)
    return bool(value) if dtype == torch.bool else value


def _check_representable(value, dtype, what: str) -> None:
    """PyTorch's rule, as torch.full and torch.where apply it: a Python
    number ``dtype`` cannot hold (nan or 1e30 as int64, 2**31 as int32, 1e5
    as float16) raises. Compiled code converted it to junk (nan -> 0, 2**31
    -> INT32_MIN), the simulator raised. A dtype kiln does not support is
    left to check_tile's error. Runs once per (value, dtype): the simulator
    calls kl.full again in every program."""
    if dtype not in tile_model.DTYPES:
        return
    problem = _unrepresentable(type(value), value, dtype)
    if problem is not None:
        raise error(f"{what} {value!r} cannot be represented as {_name(dtype)} ({problem})")


@functools.lru_cache(maxsize=1024)
def _unrepresentable(kind: type, value, dtype) -> str | None:
    # (kind keeps 1, 1.0 and True apart: they hash alike.) Two elements:
    # PyTorch's fill of a single half element gives inf instead of raising.
    try:
        torch.full((2,), value, dtype=dtype)
    except (RuntimeError, OverflowError) as e:
        return str(e)
    return None


def zeros(shape, dtype=torch.float32) -> Tile:
    """A tile of zeros."""
    return full(shape, 0, dtype)


def empty(shape, dtype=torch.float32) -> Tile:
    """An uninitialised tile: filled with NaN (floats) or 0 (ints), in the
    simulator and compiled alike, so reading it before writing shows."""
    shape = _const_shape(shape, "kl.empty")
    fill = float("nan") if dtype.is_floating_point else 0
    return _make("full", [], shape, dtype, value=fill)


def program_id(axis: int) -> Tile:
    """This program's index along grid ``axis`` (0, 1 or 2): an int64 scalar."""
    axis = _const_int(axis, "kl.program_id axis")
    if axis not in (0, 1, 2):
        raise error(f"kl.program_id axis must be 0, 1 or 2, got {axis}")
    return _make("program_id", [], (), torch.int64, axis=axis)


def num_programs(axis: int) -> Tile:
    """The grid's extent along ``axis``: an int64 scalar."""
    axis = _const_int(axis, "kl.num_programs axis")
    if axis not in (0, 1, 2):
        raise error(f"kl.num_programs axis must be 0, 1 or 2, got {axis}")
    return _make("num_programs", [], (), torch.int64, axis=axis)


def _indices(x: TensorArg, index, what):
    if not isinstance(x, TensorArg):
        raise error(f"{what} needs a tensor argument of the kernel first, got "
                    f"{type(x).__name__}")
    items = list(index) if isinstance(index, (tuple, list)) else [index]
    if len(items) != x.ndim:
        raise error(f"{what} of '{x.name}' ({x.ndim}-D) needs {x.ndim} index "
                    f"{'tile' if x.ndim == 1 else 'tiles'} (one per dim), got {len(items)}")
    out = []
    for k, item in enumerate(items):
        item = _operand(item, f"{what} index {k}")
        if isinstance(item, Tile):
            if item.dtype not in (torch.int32, torch.int64):
                raise error(f"{what} index {k} of '{x.name}' must be an integer tile, got "
                            f"{_describe(item)}")
        elif not isinstance(item, int) or isinstance(item, bool):
            raise error(f"{what} index {k} of '{x.name}' must be an int, got {item!r}")
        out.append(item)
    return out


def _mask(mask, shape, what):
    if mask is None:
        return None
    mask = _operand(mask, f"{what} mask")
    if not isinstance(mask, Tile) or mask.dtype != torch.bool:
        raise error(f"{what} mask must be a bool tile, got {_describe(mask)}")
    return mask


def load(x: TensorArg, index, mask=None, other=None) -> Tile:
    """Gathers the tile ``x[index]`` from tensor argument ``x``. ``index``:
    one integer tile or int per dim of x (a tuple), broadcast together (and
    with ``mask``) to the result's shape; element (i, j) is
    ``x[index0[i, j], index1[i, j]]``. Where ``mask`` (bool tile) is false
    nothing is read and the element is ``other`` (a number or a tile; default
    NaN for floats, 0 for ints). An unmasked index outside x raises
    KernelError (simulator at the call; compiled at the next
    synchronization)."""
    items = _indices(x, index, "kl.load")
    mask = _mask(mask, None, "kl.load")
    shape = broadcast_shapes(*[_shape(i) for i in items], _shape(mask), what="kl.load index "
                             "and mask")
    if other is not None:
        other = _operand(other, "kl.load other")
        if isinstance(other, Tile):
            broadcast_shapes(shape, other.shape, what="kl.load other")
            if broadcast_shapes(shape, other.shape) != shape:
                raise error(f"kl.load other of shape {other.shape} does not broadcast to the "
                            f"loaded shape {shape}")
            other = cast(other, x.dtype)
        else:  # a number: PyTorch's rule, as kl.full's value
            other = _exact_number(other, x.dtype, "kl.load other")
    return _make("load", [x, mask, other, *items], shape, x.dtype)


def store(x: TensorArg, index, value, mask=None) -> None:
    """Scatters ``value`` (a tile or number, broadcast to the index shape and
    converted to x's dtype) to ``x[index]`` (index as in kl.load) where
    ``mask`` is true. Unmasked indices outside x raise KernelError. Two
    programs storing to one element race (the simulator keeps the last)."""
    items = _indices(x, index, "kl.store")
    mask = _mask(mask, None, "kl.store")
    value = _operand(value, "kl.store value")
    shape = broadcast_shapes(*[_shape(i) for i in items], _shape(mask), what="kl.store index "
                             "and mask")
    if broadcast_shapes(shape, _shape(value), what="kl.store value and index") != shape:
        raise error(f"kl.store value of shape {_shape(value)} does not broadcast to the index "
                    f"shape {shape}")
    if isinstance(value, Tile):
        value = cast(value, x.dtype)
    else:
        value = _exact_number(value, x.dtype, "kl.store value")
    backend().op("store", [x, mask, value, *items], shape, x.dtype, {})


def static_range(start, end=None, step=1):
    """A loop unrolled while tracing: ``for i in kl.static_range(4)``; bounds
    are constants and ``i`` is a Python int."""
    if end is None:
        start, end = 0, start
    return builtins.range(_const_int(start, "kl.static_range start"),
                          _const_int(end, "kl.static_range end"),
                          _const_int(step, "kl.static_range step"))


def range(start, end=None, step=1):  # noqa: A001
    """A loop with a runtime trip count (a real loop in the compiled kernel):
    ``for k in kl.range(0, n, BLOCK)``; bounds may be int scalar tiles, the
    step a positive constant; ``k`` is an int64 scalar tile. Tiles assigned
    before the loop and rebound in it (``acc = acc + ...``) are loop-carried
    and keep shape and dtype; tiles first made inside the loop cannot be used
    after it. ``break``/``return`` inside are not supported."""
    if end is None:
        start, end = 0, start
    step = _const_int(step, "kl.range step")
    if step <= 0:
        raise error(f"kl.range step must be a positive constant, got {step}")
    for what, v in (("start", start), ("end", end)):
        if isinstance(v, Tile):
            if v.shape != () or v.dtype not in (torch.int32, torch.int64):
                raise error(f"kl.range {what} must be an int scalar, got {_describe(v)}")
        elif isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise error(f"kl.range {what} must be an int, got {v!r}")
    return backend().range(start, end, step)
