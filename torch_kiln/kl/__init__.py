"""kl: the Kiln tile language (issue 14) — kernels written in Python over
tiles, checked against the kiln device's tile model, simulated or compiled
to C++ on kiln/kernel.h, launched on kiln streams as torch.library
operators. Triton's and NKI's vocabulary::

    import torch_kiln.kl as kl

    @kl.jit
    def softmax(out, x, n_cols, BLOCK: kl.constexpr):
        row = kl.program_id(0)
        cols = kl.arange(0, BLOCK)
        mask = cols < n_cols
        v = kl.load(x, (row, cols), mask=mask, other=-float("inf")).to(kl.float32)
        e = kl.exp(v - kl.max(v, axis=0))
        kl.store(out, (row, cols), e / kl.sum(e, axis=0), mask=mask)

    softmax[(rows,)](out, x, cols, BLOCK=1024)

Modules: language.py (the functions), tile.py (Tile, TensorArg),
tile_model.py (the device's limits), tracer.py, simulator.py, lowering.py,
jit.py, op.py (kl.op: kernels as one differentiable operator), errors.py.
See docs/kernels.md ("The kl tile language").
"""

from torch_kiln.kl.errors import KernelError
from torch_kiln.kl.jit import JITFunction, cdiv, jit
from torch_kiln.kl.op import op
from torch_kiln.kl.language import (abs, arange, bfloat16, bool_, broadcast_to, cast,  # noqa: A004
                                    constexpr, dot, empty, erf, exp, fast_exp, float16, float32, floor,
                                    full, int32, int64, load, log, matmul, max, maximum, min,
                                    minimum, num_programs, program_id, range, rsqrt, sigmoid,
                                    sqrt, static_range, store, sum, tanh, transpose, where,
                                    zeros)
from torch_kiln.kl.tile import TensorArg, Tile
from torch_kiln.kl import tile_model

__all__ = ["JITFunction", "KernelError", "TensorArg", "Tile", "abs", "arange", "bfloat16",
           "bool_", "broadcast_to", "cast", "cdiv", "constexpr", "dot", "empty", "erf", "exp",
           "fast_exp", "float16", "float32", "floor", "full", "int32", "int64", "jit", "load",
           "log", "matmul", "max", "maximum", "min", "minimum", "num_programs", "op", "program_id",
           "range", "rsqrt", "sigmoid", "sqrt", "static_range", "store", "sum", "tanh", "tile_model",
           "transpose", "where", "zeros"]
