"""Mixed precision on kiln: what ``torch.autocast("kiln")`` needs from the
device module (``torch.cuda`` offers the same functions).

``torch.autocast(device_type="kiln", dtype=torch.bfloat16 | torch.float16)``
applies CUDA's cast policies (registered in C++ for AutocastPrivateUse1);
``torch.amp.GradScaler("kiln")`` works unchanged.
"""

from __future__ import annotations

import torch


def get_amp_supported_dtype() -> list[torch.dtype]:
    """The dtypes ``torch.autocast("kiln", dtype=...)`` accepts. Others make
    autocast warn and disable itself, as PyTorch does for every device."""
    return [torch.float16, torch.bfloat16, torch.float32]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """Kiln computes bfloat16 natively (ATen's CPU kernels)."""
    return True
