"""Dynamo's device interface for kiln (``torch._dynamo.device_interface``).

Dynamo and Inductor reach a device's runtime only through a
``DeviceInterface`` registered for its type: Dynamo to recognise stream and
event objects in traced code, Inductor to query properties, switch devices
(``DeviceGuard``), synchronize for benchmarking, and to read properties in
compile subprocesses (``Worker``). :class:`KilnInterface` answers for every
``kiln:N`` with ``torch.kiln``'s functions, as ``CudaInterface`` does with
``torch.cuda``'s. It is registered by :func:`register`, which
``torch_kiln.compiler.register_dynamo_hooks`` calls once
``torch._dynamo.device_interface`` is imported.

Importing this module imports ``torch._dynamo`` (seconds); ``torch_kiln``
never does so at ``import torch`` (Note [Registering with Dynamo lazily]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.device_interface import (
    DeviceInterface,
    caching_worker_current_devices,
    caching_worker_device_properties,
    register_interface_for_device,
)

from torch_kiln import _C
from torch_kiln import kiln as _kiln

_TYPE = "kiln"


class KilnInterface(DeviceInterface):
    """``torch.kiln`` seen through Dynamo's ``DeviceInterface``.

    Devices are given as an ``int``, ``"kiln:N"``, a ``torch.device`` of type
    ``kiln`` or ``None`` (the current device); another device type raises
    ``ValueError``, an index outside ``[0, device_count())`` ``RuntimeError``.
    """

    device = _kiln.device
    # torch.Event / torch.Stream subclasses, so Dynamo can capture them.
    Event = _kiln.Event
    Stream = _kiln.Stream

    class Worker:
        """Queries that work in Inductor's compile subprocesses.

        Those may be forked from a process in which kiln is running, where
        kiln refuses to start again (as CUDA does). As for CUDA, the parent
        records every device's properties here before it forks (Inductor
        calls ``get_device_properties`` for each registered interface), and
        children answer from that record without touching the runtime."""

        @staticmethod
        def set_device(device: int) -> None:
            caching_worker_current_devices[_TYPE] = device

        @staticmethod
        def current_device() -> int:
            if _TYPE in caching_worker_current_devices:
                return caching_worker_current_devices[_TYPE]
            return _kiln.current_device()

        @staticmethod
        def get_device_properties(device: torch.types.Device = None) -> Any:
            """``torch.kiln.get_device_properties(device)``, cached for every
            device on the first call (in the parent process)."""
            if device is None:
                index = KilnInterface.Worker.current_device()
            elif isinstance(device, int):
                index = device
            else:
                device = torch.device(device)
                if device.type != _TYPE:
                    raise ValueError(f"Expected a kiln device, got {device}.")
                index = (KilnInterface.Worker.current_device() if device.index is None
                         else device.index)
            if _TYPE not in caching_worker_device_properties:
                caching_worker_device_properties[_TYPE] = [
                    _kiln.get_device_properties(i) for i in range(_kiln.device_count())
                ]
            properties = caching_worker_device_properties[_TYPE]
            if not 0 <= index < len(properties):
                raise RuntimeError(
                    f"Invalid device kiln:{index}: Kiln has {len(properties)} devices.")
            return properties[index]

    current_device = staticmethod(_kiln.current_device)
    set_device = staticmethod(_kiln.set_device)
    device_count = staticmethod(_kiln.device_count)
    stream = staticmethod(_kiln.stream)
    current_stream = staticmethod(_kiln.current_stream)
    set_stream = staticmethod(_kiln.set_stream)
    synchronize = staticmethod(_kiln.synchronize)
    get_device_properties = staticmethod(_kiln.get_device_properties)
    memory_allocated = staticmethod(_kiln.memory_allocated)

    @staticmethod
    def exchange_device(device: int) -> int:
        """Make ``device`` current; return the previous current device."""
        return _C._exchange_device(device)

    @staticmethod
    def maybe_exchange_device(device: int) -> int:
        """As ``exchange_device``; a negative ``device`` is a no-op (-1)."""
        return _C._maybe_exchange_device(device)

    @staticmethod
    def _set_stream_by_id(stream_id: int, device_index: int, device_type: int) -> None:
        """Make the stream with these ids (a ``torch.Stream``'s fields)
        current, as ``torch.cuda._set_stream_by_id``."""
        _kiln.set_stream(torch.Stream(stream_id=stream_id, device_index=device_index,
                                      device_type=device_type))

    @staticmethod
    def get_raw_stream(device_idx: int) -> int:
        """The runtime handle (``kilnStream_t`` as an int) of ``device_idx``'s
        current stream, as ``torch._C._cuda_getCurrentRawStream``."""
        return _kiln.current_stream(device_idx).kiln_stream

    @staticmethod
    def is_available() -> bool:
        return _kiln.is_available()

    @staticmethod
    def get_compute_capability(device: torch.types.Device = None) -> int:
        """``major * 10 + minor`` of ``torch.kiln.get_device_capability``
        (10: kiln has no capability levels), as CUDA's interface reports."""
        major, minor = _kiln.get_device_capability(device)
        return major * 10 + minor

    @staticmethod
    def is_bf16_supported(including_emulation: bool = False) -> bool:
        return _kiln.is_bf16_supported(including_emulation)

    @staticmethod
    def is_triton_capable(device: torch.types.Device = None) -> bool:
        """Kiln runs no Triton: Inductor generates C++ for it."""
        return False


def register() -> None:
    """Register :class:`KilnInterface` for ``"kiln"`` and each ``"kiln:N"``
    (as Dynamo does for ``"cuda:N"``). Does not start the kiln runtime."""
    register_interface_for_device(_TYPE, KilnInterface)
    for index in range(_kiln.device_count()):
        register_interface_for_device(f"{_TYPE}:{index}", KilnInterface)


__all__ = ["KilnInterface", "register"]
