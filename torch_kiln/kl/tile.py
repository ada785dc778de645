"""Tiles and tensor arguments as a kl kernel sees them.

``Tile``: a value of the kernel: ``shape`` (tuple of ints, static), ``dtype``
(torch.dtype), and a backend handle (an ir.Value while tracing, a torch
tensor in the simulator). Python operators work as in Triton and PyTorch: ``+
- * /`` (true division), ``//`` and ``%`` (integers, floor as torch),
comparisons (bool tiles), ``& | ^ ~`` (bool and integer tiles), unary ``-``,
broadcasting (numpy rules), ``t[:, None]`` to insert a size-1 dim, ``t.T``,
``t.to(dtype)``. A Tile is not a Python bool or int: ``if t:``, ``range(t)``
or ``int(t)`` raise KernelError (use kl.where, kl.range).

``TensorArg``: a tensor parameter: ``shape`` (tuple of int64 scalar tiles,
the runtime sizes), ``stride(d)`` (int64 scalar tile, in elements),
``dtype``, ``ndim``. Loaded from and stored to with kl.load / kl.store.
"""

from __future__ import annotations

import torch

from torch_kiln.kl import tile_model
from torch_kiln.kl.errors import error


class Tile:
    __slots__ = ("shape", "dtype", "handle", "index")

    def __init__(self, shape, dtype, handle):
        self.shape = tuple(shape)
        self.dtype = dtype
        self.handle = handle
        # an index tile: kl.arange, or int64 + - * of index tiles and
        # scalars, or t[:, None] of one; computed in place, so not held to
        # the scratch limit (language._make)
        self.index = False

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        from torch_kiln.kl.errors import state
        if state.backend is None:
            return f"Tile(shape={self.shape}, dtype={tile_model.dtype_name(self.dtype)})"
        return state.backend.describe(self)

    __str__ = __repr__

    # Python control flow on runtime values is not allowed.
    def __bool__(self):
        raise error("a tile's value is not known while the kernel is traced, so it cannot be "
                    "a Python bool (if/while/and/or on a tile); use kl.where(cond, a, b), or "
                    "make the value a kl.constexpr argument")

    def __index__(self):
        raise error(f"a runtime value (tile of shape {self.shape} {tile_model.dtype_name(self.dtype)}) "
                    "is used where a constant is required (Python range(), a shape, an "
                    "index); pass it as a kl.constexpr argument, or use kl.range for a "
                    "dynamic trip count")

    __int__ = __index__

    def __float__(self):
        raise error("a runtime value is used where a Python float constant is required; pass it "
                    "as a kl.constexpr argument")

    def __iter__(self):
        raise error("tiles cannot be iterated in Python; use kl.range / kl.static_range")

    def __len__(self):
        raise error("len() of a tile: use tile.shape[0]")

    # ------------------------------------------------------------ operators
    def __add__(self, other): return _lang().binary("add", self, other)
    def __radd__(self, other): return _lang().binary("add", other, self)
    def __sub__(self, other): return _lang().binary("sub", self, other)
    def __rsub__(self, other): return _lang().binary("sub", other, self)
    def __mul__(self, other): return _lang().binary("mul", self, other)
    def __rmul__(self, other): return _lang().binary("mul", other, self)
    def __truediv__(self, other): return _lang().binary("div", self, other)
    def __rtruediv__(self, other): return _lang().binary("div", other, self)
    def __floordiv__(self, other): return _lang().binary("floordiv", self, other)
    def __rfloordiv__(self, other): return _lang().binary("floordiv", other, self)
    def __mod__(self, other): return _lang().binary("mod", self, other)
    def __rmod__(self, other): return _lang().binary("mod", other, self)
    def __and__(self, other): return _lang().binary("and", self, other)
    def __rand__(self, other): return _lang().binary("and", other, self)
    def __or__(self, other): return _lang().binary("or", self, other)
    def __ror__(self, other): return _lang().binary("or", other, self)
    def __xor__(self, other): return _lang().binary("xor", self, other)
    def __rxor__(self, other): return _lang().binary("xor", other, self)
    def __lt__(self, other): return _lang().binary("lt", self, other)
    def __le__(self, other): return _lang().binary("le", self, other)
    def __gt__(self, other): return _lang().binary("gt", self, other)
    def __ge__(self, other): return _lang().binary("ge", self, other)
    def __eq__(self, other): return _lang().binary("eq", self, other)  # noqa: PLE0307
    def __ne__(self, other): return _lang().binary("ne", self, other)
    def __neg__(self): return _lang().negative(self)
    def __invert__(self): return _lang().invert(self)
    __hash__ = object.__hash__

    def __getitem__(self, index): return _lang().expand_dims(self, index)

    def to(self, dtype): return _lang().cast(self, dtype)

    @property
    def T(self): return _lang().transpose(self)


def _lang():
    from torch_kiln.kl import language
    return language


class TensorArg:
    """A tensor parameter of a kernel (see the module docstring)."""

    def __init__(self, name: str, dtype: torch.dtype, ndim: int, handle, sizes, strides):
        self.name = name
        self.dtype = dtype
        self.ndim = ndim
        self.handle = handle  # backend's: the tensor in the simulator, the param index traced
        self.shape = tuple(sizes)
        self._strides = tuple(strides)

    def stride(self, dim: int):
        return self._strides[dim]

    def __repr__(self) -> str:
        return f"TensorArg({self.name}, {tile_model.dtype_name(self.dtype)}, ndim={self.ndim})"
