"""Mixed precision on kiln: what ``torch.autocast("kiln")`` needs from the
device module, and ``torch.cuda.amp``'s deprecated spellings.

``torch.autocast(device_type="kiln", dtype=torch.bfloat16 | torch.float16)``
applies CUDA's cast policies (registered in C++ for AutocastPrivateUse1);
``torch.amp.GradScaler("kiln")`` works unchanged.

``torch.kiln.amp.autocast``, ``GradScaler``, ``custom_fwd`` and
``custom_bwd`` are ``torch.cuda.amp``'s names for those, with the same
arguments, defaults (``autocast``'s dtype is float16) and the same
``FutureWarning`` pointing to ``torch.amp``, for code that spells them
``torch.<device>.amp``.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch.amp.grad_scaler import OptState  # noqa: F401  (torch.cuda.amp keeps it too)
from typing_extensions import deprecated

__all__ = [
    "GradScaler",
    "autocast",
    "custom_bwd",
    "custom_fwd",
    "get_amp_supported_dtype",
    "is_bf16_supported",
]


def get_amp_supported_dtype() -> list[torch.dtype]:
    """The dtypes ``torch.autocast("kiln", dtype=...)`` accepts. Others make
    autocast warn and disable itself, as PyTorch does for every device."""
    return [torch.float16, torch.bfloat16, torch.float32]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """Kiln computes bfloat16 natively (ATen's CPU kernels)."""
    return True


@deprecated(
    "`torch.kiln.amp.autocast(args...)` is deprecated. "
    "Please use `torch.amp.autocast('kiln', args...)` instead.",
    category=FutureWarning,
)
class autocast(torch.amp.autocast_mode.autocast):
    """``torch.autocast("kiln", ...)`` under ``torch.cuda.amp.autocast``'s
    signature: ``enabled=True``, ``dtype=torch.float16``, ``cache_enabled=True``.
    Deprecated (``FutureWarning``), as ``torch.cuda.amp.autocast`` is."""

    if sys.version_info < (3, 13):
        # As torch.cuda.amp.autocast: before 3.13, inspect.signature of a
        # class decorated with @deprecated needs an explicit __new__.
        def __new__(cls, enabled: bool = True, dtype: torch.dtype = torch.float16,
                    cache_enabled: bool = True):
            return super().__new__(cls)

        def __init_subclass__(cls):
            pass

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16,
                 cache_enabled: bool = True):
        super().__init__("kiln", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler("kiln", ...)`` under ``torch.cuda.amp.GradScaler``'s
    signature. Deprecated (``FutureWarning``), as ``torch.cuda.amp.GradScaler`` is."""

    @deprecated(
        "`torch.kiln.amp.GradScaler(args...)` is deprecated. "
        "Please use `torch.amp.GradScaler('kiln', args...)` instead.",
        category=FutureWarning,
    )
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True) -> None:
        super().__init__("kiln", init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)


@deprecated(
    "`torch.kiln.amp.custom_fwd(args...)` is deprecated. "
    "Please use `torch.amp.custom_fwd(args..., device_type='kiln')` instead.",
    category=FutureWarning,
)
def custom_fwd(fwd: Any = None, *, cast_inputs: Any = None) -> Any:
    """``torch.amp.custom_fwd(..., device_type="kiln")``; deprecated, as
    ``torch.cuda.amp.custom_fwd`` is."""
    return functools.partial(torch.amp.custom_fwd, device_type="kiln")(
        fwd=fwd, cast_inputs=cast_inputs)


@deprecated(
    "`torch.kiln.amp.custom_bwd(args...)` is deprecated. "
    "Please use `torch.amp.custom_bwd(args..., device_type='kiln')` instead.",
    category=FutureWarning,
)
def custom_bwd(bwd: Any) -> Any:
    """``torch.amp.custom_bwd(..., device_type="kiln")``; deprecated, as
    ``torch.cuda.amp.custom_bwd`` is."""
    return functools.partial(torch.amp.custom_bwd, device_type="kiln")(bwd)
