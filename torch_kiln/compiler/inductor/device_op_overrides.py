"""What Inductor's wrapper writes for kiln's device and stream operations
(``register_device_op_overrides("kiln", KilnDeviceOpOverrides())``)."""

from __future__ import annotations

from textwrap import dedent

from torch._inductor.codegen.common import DeviceOpOverrides


class KilnDeviceOpOverrides(DeviceOpOverrides):
    def import_get_raw_stream_as(self, name: str) -> str:
        return dedent(
            f"""
            def {name}(device_index):
                return torch.kiln.current_stream(device_index).kiln_stream
            """
        )

    def set_device(self, device_idx: int) -> str:
        return f"torch.kiln.set_device({device_idx})"

    def synchronize(self) -> str:
        return "torch.kiln.synchronize()"

    def current_stream(self) -> str:
        return "torch.kiln.current_stream()"

    def device_guard(self, device_idx: int) -> str:
        return f"torch.kiln.device({device_idx})"

    def cpp_kernel_type(self) -> str:
        return "void*"
