"""Keeps kiln's eager ops from importing ``torch._dynamo``.

Note [Meta kernels without importing Dynamo]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Kiln runs an op's meta kernel on the calling thread to size its outputs
(Note [How an eager op runs on kiln]). For most elementwise ops PyTorch 2.13's
meta kernel is a Python reference (``torch._refs.add`` ...) whose
type-promotion wrapper is decorated with ``torch._disable_dynamo``, which
imports ``torch._dynamo`` on its first call: a program's first elementwise op
on kiln imported all of Dynamo (seconds on a busy machine) although nothing
is compiled. CPU and CUDA run no meta kernel and never pay it.

``_disable_dynamo``'s wrapper (``inner`` in torch/_compile.py) looks for a
cached disabled function in ``fn.__dynamo_disable`` and imports Dynamo only
when there is none. ``install()`` pre-fills that cache, for the functions of
PyTorch's references, prims and decompositions only, with
``_DisableOnceDynamoIsLoaded``. While ``torch._dynamo.eval_frame`` has never
been imported no Dynamo frame callback can be installed, so
``torch._dynamo.disable(fn)`` would only call ``fn``, and calling ``fn``
directly is the same. Once it is loaded (a ``torch.compile`` anywhere in the
process) the next call builds the real ``torch._dynamo.disable(fn, ...)``
exactly as PyTorch would have and caches it in place of ours, so compiled
code sees PyTorch's behaviour unchanged.

Not deferred: the references also import ``torch.fx.experimental.symbolic_shapes``
(and with it sympy) from inside their bodies, in some 50 places
(``_broadcast_shapes`` among them); those imports are what they compute with,
so the first elementwise op still costs that once.

If a later PyTorch changes the wrapper's shape (its closure no longer holds
``fn`` and ``recursive``) nothing is patched and the first op imports Dynamo
again; tests/test_first_op_imports.py catches that.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable

import torch
import torch._compile

# Modules whose functions are PyTorch's Python meta kernels and what they call.
_META_KERNEL_MODULES = ("torch._refs", "torch._prims", "torch._decomp", "torch._meta_registrations")


class _DisableOnceDynamoIsLoaded:
    """Stands in for ``torch._dynamo.disable(fn, recursive, wrapping=False)``
    until Dynamo's frame evaluation is imported, then becomes it."""

    __slots__ = ("fn", "recursive")

    def __init__(self, fn: Callable[..., Any], recursive: bool) -> None:
        self.fn = fn
        self.recursive = recursive

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo.eval_frame" not in sys.modules:
            return self.fn(*args, **kwargs)
        import torch._dynamo

        disabled = torch._dynamo.disable(self.fn, self.recursive, wrapping=False)
        # What torch/_compile.py's inner caches (setattr: inside a class body
        # the attribute name would be mangled).
        setattr(self.fn, "__dynamo_disable", disabled)
        return disabled(*args, **kwargs)


def _defer_dynamo() -> int:
    """Pre-fills the ``_disable_dynamo`` cache of every wrapped function
    reachable from PyTorch's Python meta kernels (module attributes, the
    decomposition tables, and the ``__wrapped__`` chains and closures of
    those). Returns how many were patched (0 if the wrapper changed shape)."""
    code = getattr(torch._compile._disable_dynamo(lambda: None), "__code__", None)
    if code is None or set(code.co_freevars) != {"fn", "recursive"}:
        return 0
    fn_index = code.co_freevars.index("fn")
    recursive_index = code.co_freevars.index("recursive")

    roots: list[Any] = []
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith(_META_KERNEL_MODULES):
            roots.extend(vars(module).values())
    from torch._decomp import global_decomposition_table

    for table in global_decomposition_table.values():
        roots.extend(table.values())

    patched = 0
    seen: set[int] = set()
    stack = [r for r in roots if isinstance(r, types.FunctionType)]
    while stack:
        f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        closure = f.__closure__ or ()
        if f.__code__ is code:
            fn = closure[fn_index].cell_contents
            if getattr(fn, "__dynamo_disable", None) is None:
                recursive = closure[recursive_index].cell_contents
                fn.__dynamo_disable = _DisableOnceDynamoIsLoaded(fn, recursive)
                patched += 1
        wrapped = getattr(f, "__wrapped__", None)
        if isinstance(wrapped, types.FunctionType):
            stack.append(wrapped)
        for cell in closure:
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(content, types.FunctionType):
                stack.append(content)
    return patched


def install() -> int:
    """Defers Dynamo's import (Note [Meta kernels without importing Dynamo]).
    Returns how many functions were patched."""
    return _defer_dynamo()
