"""Random number generation on kiln devices (mirrors ``torch.cuda.random``).

Each kiln device has a default generator. It is PyTorch's CPU generator
(Mersenne Twister) running on the device, so the same seed and the same
random ops give the same numbers on kiln as on CPU, and states
(``get_rng_state``) are CPU-format ``torch.uint8`` tensors.
"""

from __future__ import annotations

import copyreg
from typing import Any, Iterable

import torch

from torch_kiln import _C
from torch_kiln.kiln._utils import _checked_device, _device_index


def _default_generator(device: Any = None) -> torch.Generator:
    return _C._get_default_generator(_device_index(device, optional=True))


def get_rng_state(device: Any = "kiln") -> torch.Tensor:
    """State of ``device``'s default generator, as a CPU ``torch.uint8`` tensor.
    A negative index raises ``ValueError``."""
    return _default_generator(_checked_device(device, "get_rng_state")).get_state()


def get_rng_state_all() -> list[torch.Tensor]:
    """States of all kiln devices' default generators."""
    return [get_rng_state(i) for i in range(_C._get_device_count())]


def set_rng_state(new_state: torch.Tensor, device: Any = "kiln") -> None:
    """Set ``device``'s default generator state from ``get_rng_state()``
    output (a CPU ``torch.uint8`` tensor). A negative index raises
    ``ValueError``."""
    _default_generator(_checked_device(device, "set_rng_state")).set_state(new_state)


def set_rng_state_all(new_states: Iterable[torch.Tensor]) -> None:
    """Set every device's default generator state."""
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


def manual_seed(seed: int) -> None:
    """Seed the current kiln device's default generator (silently ignored
    without kiln devices, as ``torch.cuda.manual_seed`` is without CUDA)."""
    if _C._get_device_count() == 0:
        return
    _default_generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    """Seed the default generators of all kiln devices."""
    for i in range(_C._get_device_count()):
        _default_generator(i).manual_seed(int(seed))


def seed() -> None:
    """Seed the current device's default generator with a random number
    (silently ignored without kiln devices, as ``torch.cuda.seed`` is)."""
    if _C._get_device_count() == 0:
        return
    _default_generator().seed()


def seed_all() -> None:
    """Seed all devices' default generators with one random number."""
    count = _C._get_device_count()
    if count == 0:
        return
    random_seed = _default_generator(0).seed()
    for i in range(1, count):
        _default_generator(i).manual_seed(random_seed)


def initial_seed() -> int:
    """The seed of the current device's default generator."""
    return _default_generator().initial_seed()


def _reduce_generator(generator: torch.Generator) -> tuple:
    """How ``pickle`` and ``copy`` take a ``torch.Generator`` apart.

    PyTorch's own ``Generator.__reduce__`` stores ``(initial_seed, offset,
    state)`` and asks every non-CPU generator for its Philox offset, which a
    kiln generator (CPU's Mersenne Twister, Note [Kiln random numbers]) does
    not have: ``copy.deepcopy`` and ``pickle`` of a kiln generator raised
    ``SystemError``. A kiln generator is stored as a CPU one is, with no
    offset (its whole position is in ``get_state()``); other devices keep
    PyTorch's reduction."""
    if generator.device.type != "kiln":
        return generator.__reduce__()
    return (torch.Generator, (generator.device,),
            (generator.initial_seed(), None, generator.get_state()))


copyreg.pickle(torch.Generator, _reduce_generator)
