"""Device queries of ``torch.cuda`` that describe the hardware: peer access,
TF32, the compiled architectures, runtime status codes, and what CUDA reads
from NVML (``nvidia-smi``'s sensors).

The reference device is software on the host CPU, so the answers are:

* ``can_device_access_peer``: ``True`` between two different kiln devices (all
  of them live in this process's memory; ``kilnMemcpyPeerAsync`` copies
  between them directly, with no staging through the host), ``False`` for a
  device and itself, as CUDA answers.
* ``is_tf32_supported``: ``False``. Kiln's kernels are ATen's CPU kernels,
  which compute float32 in float32 (TF32 is a CUDA tensor-core format;
  ``torch.backends.cuda.matmul.allow_tf32`` changes nothing on kiln).
* ``get_arch_list`` / ``get_gencode_flags``: ``[]`` / ``""``: kiln has no
  device binaries per architecture (as CUDA answers for a build without CUDA).
* ``device_memory_used`` (in ``memory.py``): bytes the device has handed
  out, what ``nvidia-smi`` would call "used": ``total - free`` of
  ``mem_get_info``.
* ``utilization``, ``memory_usage``, ``temperature``, ``power_draw``,
  ``clock_rate``: the reference device has no sensors and does not measure
  them, so these raise ``NotImplementedError`` (a ``RuntimeError``) naming
  the query, as ``torch.cuda``'s raise when NVML (``nvidia-ml-py``) is
  missing, rather than return a made-up number. For how busy the device
  is, use ``torch.profiler`` with ``ProfilerActivity.PrivateUse1``.
"""

from __future__ import annotations

from typing import Any

from torch_kiln import _C
from torch_kiln.kiln._utils import _device_index

__all__ = [
    "KilnError",
    "can_device_access_peer",
    "check_error",
    "clock_rate",
    "get_arch_list",
    "get_gencode_flags",
    "is_tf32_supported",
    "memory_usage",
    "power_draw",
    "temperature",
    "utilization",
]

_SUCCESS = 0  # kilnSuccess


class KilnError(RuntimeError):
    """A failing status code of the kiln runtime's C API (``torch.cuda.CudaError``).
    ``code`` is the ``kilnError_t`` value; the message is
    ``"<kilnErrorName>: <description> (<code>)"``."""

    def __init__(self, code: int) -> None:
        self.code = code
        name, description = _C._get_error_string(code)
        super().__init__(f"{name}: {description} ({code})")


def check_error(res: int) -> None:
    """Raise ``KilnError`` if ``res``, a status code returned by a kiln runtime
    call (``kilnError_t``, say through ``ctypes``), is not ``kilnSuccess`` (0),
    as ``torch.cuda.check_error`` does for CUDA runtime calls. Raises
    ``TypeError`` if ``res`` is not an int."""
    if isinstance(res, bool) or not isinstance(res, int):
        raise TypeError(f"check_error: res must be an int (a kilnError_t status code), got "
                        f"{type(res).__name__} {res!r}.")
    if res != _SUCCESS:
        raise KilnError(res)


def can_device_access_peer(device: Any, peer_device: Any) -> bool:
    """Whether ``device`` can access ``peer_device``'s memory directly
    (``torch.cuda.can_device_access_peer``): ``True`` for two different kiln
    devices, ``False`` for a device and itself (CUDA's answer). ``device``
    may be ``None`` (the current device); ``peer_device`` may not.

    Raises:
        ValueError: either is not a kiln device, or ``peer_device`` is ``None``.
        RuntimeError: an index is not below ``device_count()``.
    """
    index = _device_index(device, optional=True)
    peer = _device_index(peer_device)
    for value, what in ((index, "device"), (peer, "peer_device")):
        if value < 0:
            raise ValueError(f"can_device_access_peer: {what} must be a kiln device index >= 0, "
                             f"got {value}.")
    return index != peer


def is_tf32_supported() -> bool:
    """``False``: kiln computes float32 in float32 (ATen's CPU kernels have no
    TF32 mode), as ``torch.cuda.is_tf32_supported`` answers for GPUs older
    than Ampere."""
    return False


def get_arch_list() -> list[str]:
    """``[]``: kiln has no per-architecture device binaries (``torch.cuda``
    lists ``sm_XX`` targets)."""
    return []


def get_gencode_flags() -> str:
    """``""``: no NVCC ``-gencode`` flags apply to kiln."""
    return ""


def _no_sensor(query: str, what: str, device: Any) -> None:
    _device_index(device, optional=True)  # a bad device still names the device count
    raise NotImplementedError(
        f"torch.kiln.{query}: the kiln reference device does not measure its {what} (CUDA reads "
        f"it from NVML, which kiln devices do not have), so there is no value to return. For the "
        f"device's busy time, profile with torch.profiler and ProfilerActivity.PrivateUse1.")


def utilization(device: Any = None) -> int:
    """CUDA: percent of time a kernel ran over the last sample period (NVML).
    Raises ``NotImplementedError``: kiln does not measure it (module docs)."""
    _no_sensor("utilization", "utilization (percent of time a kernel ran)", device)


def memory_usage(device: Any = None) -> int:
    """CUDA: percent of time memory was read or written (NVML). Raises
    ``NotImplementedError``: kiln does not measure it (module docs)."""
    _no_sensor("memory_usage", "memory activity (percent of time memory was read or written)",
               device)


def temperature(device: Any = None) -> int:
    """CUDA: the GPU's temperature in degrees C (NVML). Raises
    ``NotImplementedError``: kiln has no sensor (module docs)."""
    _no_sensor("temperature", "temperature", device)


def power_draw(device: Any = None) -> int:
    """CUDA: average power draw in mW (NVML). Raises ``NotImplementedError``:
    kiln has no sensor (module docs)."""
    _no_sensor("power_draw", "power draw", device)


def clock_rate(device: Any = None) -> int:
    """CUDA: the SM clock in MHz (NVML). Raises ``NotImplementedError``: the
    reference device has no clock of its own (module docs)."""
    _no_sensor("clock_rate", "clock rate", device)
