"""Kernel signatures: what a custom kiln kernel takes, checked at each call.

A signature names the kernel and its positional arguments::

    "rms_norm_forward(float32[*,*]! out, float32[*,*] x, float32[*] weight, float eps)"

* a tensor argument is ``<dtype>[<dims>] name``; ``<dtype>`` is one of
  ``float32 float64 float16 bfloat16 int64 int32 int16 int8 uint8 bool``,
  several joined by ``|`` (``float32|bfloat16``), or ``any``; ``<dims>`` has
  one ``*`` per dimension (``[]`` is a 0-dim tensor) or is ``...`` for any
  rank; a ``!`` after it marks a tensor the kernel writes.
* ``float name`` and ``int name`` are scalars.

The launcher (launch.py) checks every call against the signature on the
calling thread, so a wrong dtype, rank, device or argument count raises
there, naming the kernel, the argument and what was expected.
"""

from __future__ import annotations

import dataclasses
import re

import torch

# dtype names -> (torch dtype, code in kiln/kernel.h's kiln::ScalarType)
DTYPES = {
    "float32": (torch.float32, 0),
    "float64": (torch.float64, 1),
    "float16": (torch.float16, 2),
    "bfloat16": (torch.bfloat16, 3),
    "int64": (torch.int64, 4),
    "int32": (torch.int32, 5),
    "int16": (torch.int16, 6),
    "int8": (torch.int8, 7),
    "uint8": (torch.uint8, 8),
    "bool": (torch.bool, 9),
}
MAX_DIMS = 8  # kiln::kMaxDims in kiln/kernel.h
MAX_ARGS = 64  # kiln::kMaxArgs in kiln/kernel.h
DTYPE_CODES = {dtype: code for dtype, code in DTYPES.values()}
DTYPE_NAMES = {dtype: name for name, (dtype, _) in DTYPES.items()}

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_SIGNATURE = re.compile(rf"^\s*({_NAME})\s*\((.*)\)\s*$", re.S)
_TENSOR = re.compile(rf"^([A-Za-z0-9_|]+)\s*\[([^\]]*)\]\s*(!?)\s+({_NAME})$")
_SCALAR = re.compile(rf"^(float|int)\s+({_NAME})$")


@dataclasses.dataclass(frozen=True)
class Argument:
    name: str
    kind: str  # "tensor", "float" or "int"
    dtypes: tuple[torch.dtype, ...] = ()  # () = any dtype
    dim: int | None = None  # None = any rank
    written: bool = False

    def describe(self) -> str:
        if self.kind != "tensor":
            return f"{self.kind} {self.name}"
        dtypes = "|".join(DTYPE_NAMES[d] for d in self.dtypes) or "any"
        dims = "..." if self.dim is None else ",".join("*" * self.dim)
        return f"{dtypes}[{dims}]{'!' if self.written else ''} {self.name}"


@dataclasses.dataclass(frozen=True)
class Signature:
    name: str
    arguments: tuple[Argument, ...]

    def __str__(self) -> str:
        return f"{self.name}({', '.join(a.describe() for a in self.arguments)})"


def parse(text: str) -> Signature:
    """The Signature in ``text``; raises ValueError naming the part that does
    not parse and what is allowed."""
    if not isinstance(text, str):
        raise TypeError(f"kiln kernel signature must be a str, got {type(text).__name__}")
    match = _SIGNATURE.match(text)
    if match is None:
        raise ValueError(f"kiln kernel signature {text!r}: expected 'name(arguments)', "
                         "e.g. 'scale(float32[*]! out, float32[*] x, float alpha)'")
    name, body = match.group(1), match.group(2).strip()
    arguments: list[Argument] = []
    for part in (_split_top_level(body) if body else []):
        arguments.append(_parse_argument(text, part, arguments))
    if len(arguments) > MAX_ARGS:
        raise ValueError(f"kiln kernel signature of {name!r}: {len(arguments)} arguments; kiln "
                         f"kernels take at most {MAX_ARGS} (tensors and scalars together)")
    seen = set()
    for argument in arguments:
        if argument.name in seen:
            raise ValueError(f"kiln kernel signature {text!r}: argument {argument.name!r} "
                             "appears twice")
        seen.add(argument.name)
    return Signature(name, tuple(arguments))


def _split_top_level(body: str) -> list[str]:
    """``body`` split at the commas outside brackets ("[*,*]" stays whole)."""
    parts, depth, current = [], 0, []
    for ch in body:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    parts.append("".join(current).strip())
    return parts


def _parse_argument(text: str, part: str, before: list[Argument]) -> Argument:
    scalar = _SCALAR.match(part)
    if scalar:
        return Argument(scalar.group(2), scalar.group(1))
    tensor = _TENSOR.match(part)
    if tensor is None:
        raise ValueError(
            f"kiln kernel signature {text!r}: cannot read argument {part!r}; expected "
            "'<dtype>[<dims>] name' (a '!' after ']' marks a written tensor), "
            "'float name' or 'int name'")
    dtype_text, dims_text, bang, name = tensor.groups()
    dtypes: tuple[torch.dtype, ...] = ()
    if dtype_text != "any":
        names = dtype_text.split("|")
        unknown = [n for n in names if n not in DTYPES]
        if unknown:
            raise ValueError(f"kiln kernel signature {text!r}: argument {name!r} has unknown "
                             f"dtype {unknown[0]!r}; allowed: {', '.join(DTYPES)} or any")
        dtypes = tuple(DTYPES[n][0] for n in names)
    dims_text = dims_text.strip()
    if dims_text == "...":
        dim = None
    elif dims_text == "":
        dim = 0
    else:
        stars = [d.strip() for d in dims_text.split(",")]
        if any(d != "*" for d in stars):
            raise ValueError(f"kiln kernel signature {text!r}: argument {name!r} has dims "
                             f"[{dims_text}]; write one '*' per dimension or '...'")
        dim = len(stars)
        if dim > MAX_DIMS:
            raise ValueError(f"kiln kernel signature {text!r}: argument {name!r} has {dim} "
                             f"dimensions; kiln kernels take at most {MAX_DIMS}")
    return Argument(name, "tensor", dtypes, dim, written=bool(bang))
