"""``KilnPythonWrapperCodegen``: the Python wrapper Inductor writes for a
graph on kiln, PyTorch's ``PythonWrapperCodegen`` with three kiln changes:

* generated kernels are launched as kiln stream tasks,
  ``<kernel>.launch(<device index>, *args)``, instead of being called on the
  Python thread (See Note [Compiled code runs in stream order]);
* buffers are allocated with the device index,
  ``empty_strided(..., device='kiln:N')``: the stock wrapper writes
  ``device='kiln'`` for a device it does not know, which allocates on the
  *current* device, so a graph on kiln:1 put its outputs on kiln:0;
* the header imports ``kiln_cpp_kernel`` (kernels.load_kernel).

``mode="reduce-overhead"`` changes nothing here: the compiled callable is
captured into kiln graphs after compilation (reduce_overhead.py).
"""

from __future__ import annotations

import torch
from torch._inductor.codegen.wrapper import PythonWrapperCodegen
from torch._inductor.virtualized import V


def _device_index(device: torch.device) -> int:
    # Inductor normalizes devices through the DeviceInterface (decode_device),
    # so a kiln device here has its index; writing the current device instead
    # would put a kiln:1 graph's work on kiln:0.
    if device.index is None:
        raise RuntimeError(f"kiln: Inductor generated code for {device} without a device index")
    return device.index


class KilnPythonWrapperCodegen(PythonWrapperCodegen):
    @staticmethod
    def create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures=None):
        if is_subgraph:
            raise NotImplementedError(
                "kiln: Inductor subgraphs (torch.cond, while_loop, invoke_subgraph) are not "
                "supported on kiln yet; compile this function with backend='aot_eager'."
            )
        if partition_signatures is not None:
            raise NotImplementedError(
                "kiln: Inductor graph partitions are not supported on kiln yet; compile with "
                "backend='aot_eager' or leave torch._inductor.config.graph_partition off."
            )
        return KilnPythonWrapperCodegen()

    def write_header(self) -> None:
        super().write_header()
        self.imports.writeline(
            "from torch_kiln.compiler.inductor.kernels import load_kernel as kiln_cpp_kernel"
        )

    def _generate_kernel_call_helper(self, kernel_name, call_args, *, device=None, triton=True, **kwargs):
        device = device or V.graph.get_current_device_or_throw()
        if device.type != "kiln":
            return super()._generate_kernel_call_helper(
                kernel_name, call_args, device=device, triton=triton, **kwargs
            )
        if triton:
            raise NotImplementedError("kiln: Triton kernels do not run on kiln; Inductor's C++ code does")
        index = _device_index(device)
        args = ", ".join([str(index), *map(str, call_args)])
        self.writeline(f"{kernel_name}.launch({args})")

    def make_allocation(self, name, device, dtype, shape, stride, allocation_shape=None, is_pinned=False):
        if device.type != "kiln":
            return super().make_allocation(name, device, dtype, shape, stride, allocation_shape, is_pinned)
        if allocation_shape is None:
            allocation_shape = shape
        index = _device_index(device)
        shape_code = self.codegen_python_shape_tuple(shape)
        allocation_code = self.codegen_python_shape_tuple(allocation_shape)
        stride_code = self.codegen_python_shape_tuple(stride)
        line = f"{name} = empty_strided({allocation_code}, {stride_code}, device='kiln:{index}', dtype={dtype})"
        if allocation_code != shape_code:
            line += f".as_strided({shape_code}, {stride_code})"
        return line


class KilnCppWrapperCodegen:
    """``cpp_wrapper=True`` on kiln: not supported yet (a clear error instead
    of a C++ wrapper that would call kernels on the calling thread)."""

    supports_caching = False  # read by compile_fx before create()

    @staticmethod
    def create(*args, **kwargs):
        raise NotImplementedError(
            "kiln: torch._inductor.config.cpp_wrapper=True is not supported on kiln yet; "
            "compile with the default Python wrapper (cpp_wrapper=False)."
        )
