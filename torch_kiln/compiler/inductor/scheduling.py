"""``KilnScheduling``: Inductor's C++ (CPU) code generator for the kiln device.

Kiln device memory is host-addressable on the reference device, so the
kernels Inductor writes for CPU are correct kiln kernels as they are; what
differs is how they are *called*. ``define_kernel`` emits each kernel with a
kiln entry trampoline (``kernels.entry_trampoline``) and defines it in the
wrapper as ``kiln_cpp_kernel(async_compile, name, signature, source)``, a
``torch_kiln._C._GeneratedKernel`` that the wrapper launches on the current
kiln stream (See Note [Compiled code runs in stream order] in ``__init__.py``).
Everything else — loop generation, vectorization, fusion decisions — is
``CppScheduling``'s.
"""

from __future__ import annotations

from torch._inductor import config
from torch._inductor.codegen.cpp import CppScheduling
from torch._inductor.utils import Placeholder, get_fused_kernel_name, parallel_num_threads
from torch._inductor.virtualized import V

from torch_kiln.compiler.inductor import kernels

# The name of the C function every kernel is compiled under (one kernel per
# shared library, as Inductor's Python wrapper does for CPU).
KERNEL_SYMBOL = "kernel"


def _graph_name() -> str:
    from torch._functorch._aot_autograd.logging_utils import get_aot_graph_name

    return get_aot_graph_name()


def _origin_ops(nodes) -> set[str]:
    """Names of the aten operators (``"gather"``, ``"add"``) of the graph
    Inductor compiles that the scheduler ``nodes`` of one kernel were lowered
    from. Those of the compiled graph, not the ones the program called
    (``original_aten``): Inductor's caches share one compiled graph among
    programs whose calls decompose alike (index_add and index_put with
    accumulate=True), so only the graph may decide what the code does."""
    names = set()
    for node in nodes:
        for inner in node.get_nodes():
            for origin in getattr(inner.node, "origins", ()) or ():
                packet = getattr(origin.target, "_overloadpacket", None)
                if packet is not None:
                    names.add(packet.__name__)
    return names


class KilnScheduling(CppScheduling):
    # Loop generation is CppScheduling's with Inductor's CPU settings, thread
    # count included; define_kernel caps each parallel region at that count
    # (Note [Generated kernels use at most their compile-time thread count]
    # in kernels.py).

    def define_kernel(self, src_code, nodes, kernel_args=None):
        wrapper = V.graph.wrapper_code
        if src_code in wrapper.src_to_kernel:
            return wrapper.src_to_kernel[src_code]
        descriptive = get_fused_kernel_name(nodes, config.cpp.descriptive_names) if config.cpp.descriptive_names else ""
        kernel_name = "_".join(["kiln_cpp", descriptive, wrapper.next_kernel_suffix()])
        wrapper.src_to_kernel[src_code] = kernel_name
        source = (
            src_code.replace(str(Placeholder.KERNEL_NAME), KERNEL_SYMBOL)
            .replace(str(Placeholder.DESCRIPTIVE_NAME), kernel_name)
            .replace("#pragma CMT", "//")
        )
        source = kernels.isolate_integer_division_flag(source)
        source = kernels.cap_parallel_threads(source, parallel_num_threads())
        args = self.kernel_group.args if kernel_args is None else kernel_args
        _, _, arg_types = args.cpp_argdefs()
        signature, trampoline = kernels.entry_trampoline(KERNEL_SYMBOL, arg_types)
        # Errors name the kernel and its graph, e.g. "kiln_cpp_fused_index_0
        # in compiled graph model__0_forward_1" (AOTAutograd's graph name,
        # as TORCH_LOGS=output_code shows it).
        label = f"{kernel_name} in compiled graph {_graph_name()}"
        index_error = ""
        if kernels.INDEX_CHECK_MARKER in source and not kernels.index_check_raises_index_error(
                _origin_ops(nodes)):
            index_error = ", index_error=False"  # Note [Index errors of compiled kernels]
        body = (f"kiln_cpp_kernel(async_compile, {label!r}, {signature!r}, "
                f"r'''\n{source}\n{trampoline}'''{index_error})")
        wrapper.define_kernel(kernel_name, body, gpu=False)
        return kernel_name
