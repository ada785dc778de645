"""kl.op: a Python function that launches kl kernels, as one PyTorch
operator with autograd — kiln's ``torch.library.triton_op``.

A ``@kl.jit`` kernel is a *mutating* operator (``torch.ops.kl.<name>``
writes the tensors it ``kl.store``s) with no autograd formula: backward
through a tensor it wrote raises instead of dropping the gradient. To make a
differentiable, functional operator out of kernels, write the Python function
that allocates the outputs and launches the kernels, and decorate it::

    @kl.op("mylib::rms_norm", mutates_args=())
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        rms_norm_kernel[(x.shape[0],)](out, x, weight, x.shape[1], eps, BLOCK=...)
        return out

    rms_norm.register_autograd(backward, setup_context=setup_context)

``kl.op`` registers ``fn`` as the operator's implementation for kiln tensors
(the kernels compiled) and CPU tensors (the kernels simulated), and as its
fake implementation too: under ``FakeTensorMode`` (torch.compile, opcheck,
meta shape propagation) the same function runs on fake tensors, its
allocations give the output shapes and its kernel launches only bind their
arguments (``jit.launches_skipped``: a constexpr computed from a symbolic
size need not be known). So the function must allocate every output with
torch factory functions on the inputs' device and return tensors it
allocated (not inputs or views of them), as any ``torch.library.custom_op``
must. The result is the ``torch.library.CustomOpDef``:
``register_autograd`` gives it a backward (usually another ``kl.op``
launching the backward kernels), ``register_kernel`` may replace the CPU
implementation, and ``torch.compile`` keeps it as one node
(``fullgraph=True`` works).

Errors: ``ValueError`` for a qualname that is not ``"namespace::name"`` of
two ASCII Python identifiers that are not keywords, or that names an
operator already defined by another function (``torch.library.custom_op``
would silently replace the first; the same function defined again — a module
reloaded or imported under two names, a notebook cell run again — replaces
it, as there); ``TypeError`` for decorating a non-function;
``torch.library.custom_op``'s own errors (a missing type annotation)
unchanged.
"""

from __future__ import annotations

import functools
import inspect
import keyword
import os
from collections.abc import Callable, Iterable

import torch

from torch_kiln.kl.jit import launches_skipped


# qualname -> (module, file, qualname) of the function kl.op registered
_REGISTERED: dict[str, tuple[str, str, str]] = {}


def _defined(qualname: str) -> bool:
    """Whether an operator ``qualname`` (any overload: aten::add has no
    default one) exists."""
    return bool(torch._C._jit_get_schemas_for_operator(qualname))


def _redefinition(qualname: str, fn: Callable) -> bool:
    """Whether ``fn`` is the definition kl.op registered as ``qualname``
    again: the same function name from the same module or file (a module
    imported under two names, reloaded, or a notebook cell run again),
    which may replace it, as torch.library.custom_op would."""
    previous = _REGISTERED.get(qualname)
    if previous is None:
        return False
    module, filename, name = previous
    return name == fn.__qualname__ and (
        module == fn.__module__ or
        os.path.abspath(filename) == os.path.abspath(fn.__code__.co_filename))


def op(qualname: str, *, mutates_args: Iterable[str] | str, schema: str | None = None):
    """Decorator: ``fn`` becomes operator ``qualname`` ("namespace::name")
    on kiln and CPU, with ``fn`` itself as the fake implementation.
    ``mutates_args`` and ``schema`` as in ``torch.library.custom_op``
    (``mutates_args=()`` for a functional operator, which autograd needs).
    Returns the ``torch.library.CustomOpDef``."""
    if not isinstance(qualname, str) or qualname.count("::") != 1 or \
            not all(part.isidentifier() and part.isascii() and not keyword.iskeyword(part)
                    for part in qualname.split("::")):
        # (checked here: torch's schema parser raises an unclear error, and
        # after one bad name every later torch.compile in the process fails)
        raise ValueError(f"kl.op: qualname must be 'namespace::name', two ASCII Python "
                         f"identifiers (not keywords), got {qualname!r}")

    def register(fn: Callable) -> torch.library.CustomOpDef:
        if not inspect.isfunction(fn):
            raise TypeError(f"kl.op({qualname!r}) decorates a function, got "
                            f"{type(fn).__name__}")
        if _defined(qualname) and not _redefinition(qualname, fn):
            raise ValueError(f"kl.op: operator {qualname} is already defined (by another "
                             f"function); registering {fn.__qualname__} under its name would "
                             f"silently change what the first one's callers run: pick another "
                             f"name")
        definition = torch.library.custom_op(qualname, mutates_args=mutates_args,
                                             device_types=("kiln", "cpu"), schema=schema)(fn)

        @functools.wraps(fn)
        def fake(*args, **kwargs):
            with launches_skipped():
                return fn(*args, **kwargs)

        definition.register_fake(fake)
        _REGISTERED[qualname] = (fn.__module__, fn.__code__.co_filename, fn.__qualname__)
        return definition

    return register
