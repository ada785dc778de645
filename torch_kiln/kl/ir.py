"""The traced form of a kl kernel: values, operations, blocks, loops.

``Value``: a tile (shape of static ints, torch dtype) or a scalar (shape ()).
Every Value is produced by one ``Op`` (``kind``, ``operands``: Values or
Python numbers, ``attrs``), recorded in program order in a ``Block``; a
dynamic loop (kl.range) is an Op of kind "for" holding its body Block, its
induction variable and its loop-carried pairs (outer value, value at the end
of the body). ``loc`` is the user's (filename, line) that made the op.

``Value.affine``: for int64 index values made of program ids, scalars,
kl.arange and + - * by scalars, the value as ``base + sum(coeffs[d] *
index_d)`` (C++ expression strings over scalar names), so the lowering
computes indices in place instead of storing index tiles
(lowering.py). ``alias_of``: a value that is another one with size-1 dims
inserted (``t[:, None]``), same storage.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Value:
    shape: tuple[int, ...]
    dtype: torch.dtype
    scope: tuple[int, ...] = ()  # ids of the kl.range loops it is defined in
    affine: tuple[str, tuple[str, ...]] | None = None
    alias_of: "Value | None" = None
    id: int = dataclasses.field(default_factory=lambda: next(_ids))

    @property
    def name(self) -> str:
        return f"v{self.id}"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclasses.dataclass(eq=False)
class Op:
    kind: str
    result: Value | None
    operands: list
    attrs: dict
    loc: tuple[str, int]


@dataclasses.dataclass(eq=False)
class Block:
    ops: list[Op] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class Loop:
    """attrs of a "for" Op: ``var`` (int64 scalar), ``body``, ``carried``."""
    var: Value
    body: Block
    carried: list[tuple[Value, Value]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Param:
    """A kernel parameter: kind "tensor", "scalar" or "constexpr"."""
    name: str
    kind: str
    written: bool = False


@dataclasses.dataclass
class Trace:
    """A traced kernel specialisation."""
    name: str
    params: list[Param]
    tensor_specs: dict  # param name -> (dtype, ndim)
    scalar_kinds: dict  # param name -> "int" | "float"
    constexprs: dict  # param name -> value
    block: Block
    peak_scratch_bytes: int = 0  # per partition
    written: set = dataclasses.field(default_factory=set)  # tensor params stored to


def walk(block: Block):
    """Every op of ``block`` and of its loops' bodies, in program order."""
    for op in block.ops:
        yield op
        if op.kind == "for":
            yield from walk(op.attrs["loop"].body)
