"""``torch.compile(model, backend="kiln")``: Inductor for kiln.

Registered as the ``kiln`` entry point of the ``torch_dynamo_backends``
group (pyproject.toml), so it appears in ``torch._dynamo.list_backends()``.
It is Inductor (``torch._inductor.compile_fx.compile_fx``) with kiln's
backend registered first and kiln's defaults (``KILN_INDUCTOR_DEFAULTS``):

* ``fallback_random=True``: random ops (dropout, rand, randn, ...) call kiln's
  eager kernels, which draw from the kiln generator exactly as eager code
  does, so a compiled model draws eager kiln's (and so CPU's) random
  numbers for the same seed. (Dropout is traced as on the CPU, as
  ``native_dropout``: eager's masks, scaled by ``1 / (1 - p)`` rounded once,
  so at some rates a kept value is an ulp from eager's, as compiled CPU's
  is; Note [Tracing kiln's eager compositions].) Inductor's own generated
  random numbers differ from eager ones (as on CUDA); the cost is that
  random ops are not fused.

Otherwise the default backend (``torch.compile(model)``) gives the same code
for kiln tensors. ``mode=`` and ``options=`` work as for the default backend
(``torch._inductor.list_mode_options``; ``mode="reduce-overhead"`` captures
kiln graphs, reduce_overhead.py); options override kiln's defaults.

Failure policy (TorchNeuron's): a graph this backend cannot compile raises
the compiler's error (Dynamo reports it as ``BackendCompilerFailed``; an
Inductor lowering error names the FX node and its op), with a note naming
the graph (Dynamo's compile id) and its size. With
``KILN_COMPILE_FALLBACK=eager`` the graph runs eagerly instead, with one
warning per graph that names the graph and the error. Other values raise
``ValueError``. See docs/environment.md.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

_POLICIES = ("error", "eager")

# Inductor settings backend="kiln" applies (see the module docstring).
KILN_INDUCTOR_DEFAULTS = {"fallback_random": True}


def _fallback_policy() -> str:
    policy = os.environ.get("KILN_COMPILE_FALLBACK", "error").strip().lower() or "error"
    if policy not in _POLICIES:
        raise ValueError(
            f"KILN_COMPILE_FALLBACK={os.environ['KILN_COMPILE_FALLBACK']!r} is not a policy; "
            f"use one of {', '.join(_POLICIES)} (unset means error)")
    return policy


def _graph_name() -> str:
    compile_id = torch._guards.CompileContext.current_compile_id()
    return f"[{compile_id}]" if compile_id is not None else "(outside a Dynamo compile)"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _mode_and_options(mode: str | None, options: dict | None) -> dict:
    """Inductor config patches for torch.compile's ``mode``/``options``, checked
    as for the default backend (unknown modes and options raise RuntimeError)."""
    wrapper = torch._TorchCompileInductorWrapper

    class Options:  # the wrapper's own parsing, without its other effects
        apply_mode = wrapper.apply_mode
        apply_options = wrapper.apply_options

        def __init__(self) -> None:
            self.config: dict = {}
            self.dynamic = None

    parsed = Options()
    parsed.apply_mode(mode)
    parsed.apply_options(options)
    return parsed.config


def kiln_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], *, mode: str | None = None,
                 options: dict | None = None, **kwargs: Any):
    """Dynamo backend: compiles ``gm`` with Inductor for kiln (and for any
    other device among its tensors, as Inductor does). ``mode`` and
    ``options`` are torch.compile's; other ``kwargs`` are passed to
    ``compile_fx`` (e.g. ``config_patches``). Failures follow the policy
    above."""
    from torch._inductor import compile_fx

    from torch_kiln.compiler.inductor import register

    policy = _fallback_policy()  # a bad setting is reported before compiling
    register()
    kwargs["config_patches"] = {**KILN_INDUCTOR_DEFAULTS, **_mode_and_options(mode, options),
                                **(kwargs.get("config_patches") or {})}
    try:
        return compile_fx.compile_fx(gm, example_inputs, **kwargs)
    except Exception as error:
        graph = f"graph {_graph_name()} ({len(gm.graph.nodes)} FX nodes)"
        if policy == "eager":
            warnings.warn(
                f"kiln: {graph} could not be compiled ({type(error).__name__}: "
                f"{_first_line(error)}); running it eagerly because "
                f"KILN_COMPILE_FALLBACK=eager", stacklevel=2)
            return gm.forward
        error.add_note(f"kiln: while compiling {graph} with backend='kiln'. Set "
                       "KILN_COMPILE_FALLBACK=eager to run graphs that cannot be compiled "
                       "eagerly instead.")
        raise
