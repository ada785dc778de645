"""Launching a custom kiln kernel: checks at the call, then a stream task.

A ``Kernel`` is one KILN_KERNEL function of a loaded library (build.py). A
call ``kernel(*args)`` checks the arguments against the kernel's signature
(signature.py) on the calling thread, packs them in kiln/kernel.h's launch
ABI, and launches the kernel through ``torch_kiln._C._GeneratedKernel``: a
task on the current stream of the tensors' kiln device, the same launch path
as eager kiln ops and torch.compile's kernels (aten/GeneratedKernels.h), so
the call returns at once and the kernel runs in stream order. Each launch is
counted in ``torch.kiln.get_executed_ops()`` and appears in the profiler's
device track under ``<library>::<kernel>``. A kernel has no autograd
formula: with grad mode on and an argument that requires grad, backward
through its written tensors raises (autograd.py).
"""

from __future__ import annotations

import ctypes
import numbers
import operator

import torch

from torch_kiln.kernels.autograd import guard_backward
from torch_kiln.kernels.signature import DTYPE_CODES, DTYPE_NAMES, Signature

_DESCRIPTION = "a custom kiln kernel (torch_kiln.kernels)"
_TENSOR, _FLOAT, _INT = 0, 1, 2


def check_written(where: str, value: torch.Tensor) -> None:
    """RuntimeError, starting with ``where``, if a kernel may not write
    ``value``: a leaf that requires grad (with grad mode on), an inference
    tensor outside inference mode, or a tensor with internal overlap
    (expanded, stride 0). Shared by part 1's launcher
    and the kl simulator, so every mode refuses the same tensors alike."""
    if value.requires_grad and torch.is_grad_enabled() and value.is_leaf:
        raise RuntimeError(f"{where} is written by the kernel but is a leaf tensor that "
                           "requires grad")
    if value.is_inference() and not torch.is_inference_mode_enabled():
        # as torch refuses in-place ops (custom operators' included) on them
        raise RuntimeError(f"{where} is written by the kernel but is an inference tensor (made "
                           "under torch.inference_mode()), which may be written only inside "
                           "inference mode; clone() it first, or launch under inference_mode")
    if torch._debug_has_internal_overlap(value) == 1:
        raise RuntimeError(f"{where} is written by the kernel, but more than one of its "
                           "elements refers to a single memory location (an expanded, "
                           "stride-0 tensor); clone() it first")


class Kernel:
    """A loaded kernel; call it with its signature's arguments, in order."""

    def __init__(self, library: str, signature: Signature, address: int):
        self.library = library
        self.signature = signature
        self.qualified_name = f"{library}::{signature.name}"
        self._address = address
        # The kernel reads its name from the launch slots (KernelContext::name).
        self._name_buffer = ctypes.create_string_buffer(self.qualified_name.encode())
        self._launchers: dict[str, object] = {}  # by slot signature

    def __repr__(self) -> str:
        return f"<kiln kernel {self.library}::{self.signature}>"

    def __call__(self, *args):
        arguments = self.signature.arguments
        if len(args) != len(arguments):
            raise TypeError(f"kiln kernel {self.qualified_name} takes {len(arguments)} arguments "
                            f"({self.signature}), got {len(args)}")
        device = self._device_of(args)
        written: list[torch.Tensor] = []
        letters = ["i", "i", "i", "i"]
        stream_id = torch.kiln.current_stream(device).stream_id
        values: list[object] = [device.index, stream_id, ctypes.addressof(self._name_buffer),
                                len(args)]
        for argument, value in zip(arguments, args):
            if argument.kind == "tensor":
                self._check_tensor(argument, value, device)
                if argument.written:
                    written.append(value)
                letters += ["i", "w" if argument.written else "r", "i", "i", "i"]
                letters += ["i"] * (2 * value.dim())
                values += [_TENSOR, value, DTYPE_CODES[value.dtype], int(argument.written),
                           value.dim(), *value.shape, *value.stride()]
            elif argument.kind == "float":
                letters += ["i", "f"]
                values += [_FLOAT, self._float(argument, value)]
            else:
                letters += ["i", "i"]
                values += [_INT, self._int(argument, value)]
        self._launcher("".join(letters)).launch(device.index, *values)
        # The kernel writes these in place, as an out= or in-place op does:
        # autograd must see the change (a tensor saved for backward and then
        # overwritten raises at backward instead of giving wrong gradients).
        for tensor in written:
            torch.autograd.graph.increment_version(tensor)
        guard_backward(self.qualified_name, [a for a in args if isinstance(a, torch.Tensor)],
                       written)

    # ------------------------------------------------------------ checks

    def _where(self, argument) -> str:
        return f"kiln kernel {self.qualified_name}: argument '{argument.name}'"

    def _float(self, argument, value) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{self._where(argument)} must be a float, got "
                            f"{type(value).__name__}")
        try:
            return float(value)
        except OverflowError:
            raise OverflowError(f"{self._where(argument)} = {value} does not fit a double") from None

    def _int(self, argument, value) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{self._where(argument)} must be an int, got "
                            f"{type(value).__name__}")
        value = operator.index(value)
        if not -(2 ** 63) <= value < 2 ** 63:
            raise OverflowError(f"{self._where(argument)} = {value} does not fit int64 "
                                f"[-2**63, 2**63 - 1]")
        return value

    def _device_of(self, args) -> torch.device:
        devices = {a.device for a in args if isinstance(a, torch.Tensor)}
        if not devices:
            # No tensor arguments: the current kiln device, as a CUDA launch
            # without tensors runs on the current device.
            return torch.device("kiln", torch.kiln.current_device())
        kiln = sorted((d for d in devices if d.type == "kiln"), key=lambda d: d.index)
        if not kiln:
            raise RuntimeError(f"kiln kernel {self.qualified_name}: expected kiln tensors, got "
                               f"tensors on {sorted(str(d) for d in devices) or 'no device'}")
        if len(kiln) > 1:
            raise RuntimeError(f"kiln kernel {self.qualified_name}: expected all tensors on one "
                               f"kiln device, got {', '.join(map(str, kiln))}")
        return kiln[0]

    def _check_tensor(self, argument, value, device: torch.device) -> None:
        where = self._where(argument)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where} must be a tensor ({argument.describe()}), got "
                            f"{type(value).__name__}")
        if value.device != device:
            raise RuntimeError(f"{where} is on {value.device}, expected {device} like the "
                               "kernel's other tensors")
        if value.layout != torch.strided:
            raise RuntimeError(f"{where} has layout {value.layout}; kiln kernels take strided "
                               "tensors")
        if value.dtype not in DTYPE_CODES:
            raise TypeError(f"{where} has dtype {value.dtype}, which kiln kernels cannot take")
        if argument.dtypes and value.dtype not in argument.dtypes:
            allowed = " or ".join(DTYPE_NAMES[d] for d in argument.dtypes)
            raise TypeError(f"{where} has dtype {DTYPE_NAMES[value.dtype]}, expected {allowed}")
        if argument.dim is not None and value.dim() != argument.dim:
            raise ValueError(f"{where} has {value.dim()} dimensions (shape "
                             f"{tuple(value.shape)}), expected {argument.dim}")
        if value.dim() > 8:
            raise ValueError(f"{where} has {value.dim()} dimensions; kiln kernels take at most 8")
        if argument.written:
            check_written(where, value)

    def _launcher(self, letters: str):
        launcher = self._launchers.get(letters)
        if launcher is None:
            from torch_kiln import _C

            launcher = _C._GeneratedKernel(self.qualified_name, self._address, letters,
                                           description=_DESCRIPTION, counted_as_op=True)
            self._launchers[letters] = launcher
        return launcher
