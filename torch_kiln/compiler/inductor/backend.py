"""``torch.compile(model, backend="kiln")``: Inductor for kiln.

Registered as the ``kiln`` entry point of the ``torch_dynamo_backends``
group (pyproject.toml), so it appears in ``torch._dynamo.list_backends()``.
It is Inductor (``torch._inductor.compile_fx.compile_fx``) with kiln's
backend registered first; today kiln's defaults are Inductor's. The default
backend (``torch.compile(model)``) gives the same code for kiln tensors.
"""

from __future__ import annotations

from typing import Any

import torch


def kiln_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any):
    """Dynamo backend: compiles ``gm`` with Inductor for kiln (and for any
    other device among its tensors, as Inductor does). ``kwargs`` are passed
    to ``compile_fx`` (e.g. ``config_patches``)."""
    from torch._inductor.compile_fx import compile_fx

    from torch_kiln.compiler.inductor import register

    register()
    return compile_fx(gm, example_inputs, **kwargs)
