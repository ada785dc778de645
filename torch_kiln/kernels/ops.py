"""``custom_op``: a kiln kernel as a PyTorch operator (torch.library).

A thin layer on ``torch.library.custom_op``::

    lib = torch_kiln.kernels.load_inline("bias_gelu_ext", SOURCE, ["bias_gelu(...)"])

    @torch_kiln.kernels.custom_op("kilnex::bias_gelu", mutates_args=(),
                                  cpu=bias_gelu_reference, fake=lambda x, b: torch.empty_like(x))
    def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)       # from kiln's caching allocator
        lib.bias_gelu(out, x, bias)     # a task on the current stream
        return out

The decorated function is the operator's kiln implementation; ``cpu`` (a
function with the same signature) is its CPU implementation, so the op runs
on both devices; ``fake`` its fake (meta) implementation, which
torch.compile traces with (the op is then one graph node); autograd as in
torch.library: ``bias_gelu.register_autograd(backward, setup_context=...)``.
What returns is torch's ``CustomOpDef``, callable as the operator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def custom_op(qualname: str, *, mutates_args: Iterable[str] | str, cpu: Callable | None = None,
              fake: Callable | None = None, schema: str | None = None):
    """Decorator: registers the function as operator ``qualname``
    ("namespace::name") with a kiln implementation (the function), and the
    given CPU and fake implementations. ``mutates_args`` and ``schema`` as in
    ``torch.library.custom_op``."""
    if not isinstance(qualname, str) or "::" not in qualname:
        raise ValueError(f"kiln custom_op: qualname must be 'namespace::name', got {qualname!r}")

    def register(kiln_impl: Callable):
        op = torch.library.custom_op(qualname, mutates_args=mutates_args, device_types="kiln",
                                     schema=schema)(kiln_impl)
        if cpu is not None:
            op.register_kernel("cpu", cpu)
        if fake is not None:
            op.register_fake(fake)
        return op

    return register
