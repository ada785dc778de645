"""The kl simulator: runs a kernel in Python on torch tensors, program by
program (``KILN_KL_SIMULATE=1`` or ``@kl.jit(simulate=True)``), like NKI's
simulator.

``simulate(fn, trace, args, grid)`` first needs the kernel's ir.Trace (made
by the caller, tracer.py): tracing is what checks the tile model, constants
and loops, so the simulator fails exactly where compilation would. It then
calls the Python function once per program of the grid (axis 0 fastest)
with TensorArgs over the tensors, scalar tiles holding 0-d tensors and the
constexpr values; each language call computes its tile with PyTorch on the
CPU. What the simulator adds:

* ``print(tile)`` shows the tile's values (``Tile(shape=..., dtype=...,
  tensor(...))``);
* kl.empty tiles and masked-off kl.load elements without ``other`` are NaN
  (0 for integers), so a read of uninitialised scratch shows in the result,
  as in the compiled kernel;
* an index outside a tensor in an unmasked (or masked-on) element of a load
  or store raises KernelError naming the kernel, the user's line, the
  tensor, the index and the program;
* a failing PyTorch computation (integer division by zero) raises
  KernelError with the line.

Tensors are used where they are: the caller (jit.py) passes CPU copies of
kiln tensors and copies the written ones back.
"""

from __future__ import annotations

import itertools

import torch

from torch_kiln.kl import ir, tile_model
from torch_kiln.kl.errors import KernelError, error, state, user_location
from torch_kiln.kl.tile import TensorArg, Tile

_HALF = (torch.bfloat16, torch.float16)

_UNARY = {
    "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "erf": torch.erf, "floor": torch.floor,
    "fast_exp": torch.exp,  # the compiled kernel's exp_u20 is within 20 ULP of it
}


def _number(value, dtype: torch.dtype) -> torch.Tensor:
    """A Python number as a 0-dim tensor of ``dtype``, an int wrapped into an
    integer dtype's range (two's complement) as PyTorch does with a Python
    int operand (``int32_tensor + 2**31`` wraps) and compiled kernels do;
    ``torch.tensor(2**31, dtype=torch.int32)`` would raise instead."""
    if isinstance(value, int) and not isinstance(value, bool) and \
            not dtype.is_floating_point and dtype != torch.bool:
        bits = torch.iinfo(dtype).bits
        value = (value + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))
    return torch.tensor(value, dtype=dtype)


_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "maximum": torch.maximum, "minimum": torch.minimum,
    "floordiv": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "mod": torch.remainder, "and": torch.bitwise_and, "or": torch.bitwise_or,
    "xor": torch.bitwise_xor, "lt": torch.lt, "le": torch.le, "gt": torch.gt,
    "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
}


def _fill(dtype):
    return float("nan") if dtype.is_floating_point else 0


class Simulator:
    def __init__(self, name: str, grid: tuple[int, int, int]):
        self.name = name
        self.grid = grid
        self.pid = (0, 0, 0)

    def describe(self, tile: Tile) -> str:
        return (f"Tile(shape={tile.shape}, dtype={tile_model.dtype_name(tile.dtype)}, "
                f"{tile.handle})")

    def op(self, kind, operands, shape, dtype, attrs):
        loc = user_location()
        data = [o.handle if isinstance(o, Tile) else o for o in operands]
        try:
            out = self._compute(kind, operands, data, shape, dtype, attrs, loc)
        except KernelError:
            raise
        except RuntimeError as e:
            raise error(f"{kind} failed in program {self.pid}: {e}", loc) from None
        if out is None:
            return None
        out = out.to(dtype).reshape(shape)
        return Tile(shape, dtype, out)

    def _compute(self, kind, operands, data, shape, dtype, attrs, loc):
        def tensor(x, dt):
            return x.to(dt) if isinstance(x, torch.Tensor) else x

        if kind in _BINARY:
            # Halves compute in float32 and round once (op() casts the result),
            # as compiled code and PyTorch's kernels do; Python numbers come
            # already rounded (Note [kl Python numbers with half tiles]).
            common = torch.float32 if attrs["common"] in _HALF else attrs["common"]
            a, b = (tensor(x, common) for x in data)
            if kind in ("floordiv", "mod") and isinstance(b, torch.Tensor) and \
                    bool((b == 0).any()):
                raise error(f"integer division by zero ('{'//' if kind == 'floordiv' else '%'}') "
                            f"in program {self.pid}", loc)
            if kind in ("floordiv", "mod") and not isinstance(b, torch.Tensor) and b == 0:
                raise error(f"integer division by zero in program {self.pid}", loc)
            if not isinstance(a, torch.Tensor):
                a = _number(a, common)
            if not isinstance(b, torch.Tensor):
                b = _number(b, common)
            return _BINARY[kind](a, b)
        if kind in _UNARY:
            # halves in float32, rounded once (op() casts), as compiled code:
            # PyTorch's own bf16/fp16 erf and rsqrt round otherwise
            return _UNARY[kind](data[0].to(torch.float32 if dtype in _HALF else dtype))
        if kind == "abs":
            return data[0].abs()
        if kind == "invert":
            return torch.bitwise_not(data[0])
        if kind == "neg":
            return torch.neg(data[0])
        if kind == "where":
            c, a, b = data
            a = tensor(a, dtype) if isinstance(a, torch.Tensor) else torch.tensor(a, dtype=dtype)
            b = tensor(b, dtype) if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=dtype)
            return torch.where(c, a, b)
        if kind == "cast":
            return data[0].to(dtype)
        if kind == "expand_dims":
            return data[0].reshape(shape)
        if kind == "broadcast":
            x = data[0] if isinstance(data[0], torch.Tensor) else torch.tensor(data[0])
            return x.expand(shape).clone()
        if kind == "transpose":
            return data[0].t().contiguous()
        if kind in ("sum", "max", "min"):
            x, axis, keep = data[0], attrs["axis"], attrs["keepdims"]
            if kind == "sum":
                acc = torch.int64 if not x.dtype.is_floating_point else torch.float32
                return x.to(acc).sum(axis, keepdim=keep)
            return (torch.amax if kind == "max" else torch.amin)(x, axis, keepdim=keep)
        if kind == "matmul":
            return data[0].to(torch.float32) @ data[1].to(torch.float32)
        if kind == "arange":
            return torch.arange(attrs["start"], attrs["start"] + shape[0], dtype=torch.int64)
        if kind == "full":
            return torch.full(shape, attrs["value"], dtype=dtype)
        if kind == "program_id":
            return torch.tensor(self.pid[attrs["axis"]], dtype=torch.int64)
        if kind == "num_programs":
            return torch.tensor(self.grid[attrs["axis"]], dtype=torch.int64)
        if kind in ("load", "store"):
            return self._access(kind, operands, data, shape, loc)
        raise AssertionError(kind)

    def _access(self, kind, operands, data, shape, loc):
        x: TensorArg = operands[0]
        mask, third = data[1], data[2]
        target = x.handle
        index = [torch.as_tensor(i, dtype=torch.int64).expand(shape) for i in data[3:]]
        active = mask.expand(shape) if mask is not None else torch.ones(shape, dtype=torch.bool)
        for d, idx in enumerate(index):
            bad = active & ((idx < 0) | (idx >= target.shape[d]))
            if bool(bad.any()):
                where = tuple(int(w[0]) for w in bad.nonzero(as_tuple=True))
                raise error(f"kl.{kind} {'from' if kind == 'load' else 'to'} '{x.name}' (shape "
                            f"{tuple(target.shape)}): index {int(idx[where])} is out of bounds "
                            f"for dimension {d} of size {target.shape[d]} (tile element "
                            f"{where}, program {self.pid}); mask the ragged edge with mask=",
                            loc)
        safe = [torch.where(active, idx, 0) for idx in index]
        if kind == "load":
            other = third
            if other is None:
                other = _fill(target.dtype)
            if target.numel() == 0 or not bool(active.any()):
                values = torch.empty(shape, dtype=target.dtype)
            else:
                values = target[tuple(safe)] if safe else target.reshape(())
            if not isinstance(other, torch.Tensor):
                other = torch.tensor(other, dtype=target.dtype)
            return torch.where(active, values, other.to(target.dtype))
        value = third
        value = (value.to(target.dtype) if isinstance(value, torch.Tensor)
                 else torch.tensor(value, dtype=target.dtype)).expand(shape)
        if safe:
            target[tuple(i[active] for i in index)] = value[active]
        elif bool(active):
            target.copy_(value)
        return None

    def range(self, start, end, step):
        start = int(start.handle) if isinstance(start, Tile) else start
        end = int(end.handle) if isinstance(end, Tile) else end
        for i in range(start, end, step):
            yield Tile((), torch.int64, torch.tensor(i, dtype=torch.int64))


def simulate(fn, trace: ir.Trace, values: dict, grid: tuple[int, int, int]) -> None:
    """Runs ``fn`` once per program of ``grid`` on ``values`` (param name ->
    tensor, number or constexpr value), writing the stored tensors in place."""
    sim = Simulator(trace.name, grid)
    args = []
    for p in trace.params:
        v = values[p.name]
        if p.kind == "tensor":
            sizes = [Tile((), torch.int64, torch.tensor(s, dtype=torch.int64)) for s in v.shape]
            strides = [Tile((), torch.int64, torch.tensor(s, dtype=torch.int64))
                       for s in v.stride()]
            args.append(TensorArg(p.name, v.dtype, v.dim(), v, sizes, strides))
        elif p.kind == "scalar":
            dtype = torch.int64 if trace.scalar_kinds[p.name] == "int" else torch.float32
            args.append(Tile((), dtype, torch.tensor(v, dtype=dtype)))
        else:
            args.append(v)
    previous = (state.backend, state.kernel)
    state.backend, state.kernel = sim, trace.name
    try:
        for z, y, x in itertools.product(range(grid[2]), range(grid[1]), range(grid[0])):
            sim.pid = (x, y, z)
            fn(*args)
    finally:
        state.backend, state.kernel = previous
