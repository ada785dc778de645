"""Generated C++ kernels for kiln: the entry trampoline and the loader.

Inductor's C++ code generator writes each fused kernel as
``extern "C" void kernel(const float* in_ptr0, float* out_ptr0, const int64_t ks0)``.
For kiln, :func:`entry_trampoline` appends one more function with a single
signature for every kernel::

    extern "C" void kernel_kiln_entry(const int64_t* packed);

which unpacks one 64-bit slot per argument (a pointer, an integer, or the
bits of a double) and calls the kernel. :func:`load_kernel` compiles the
source through Inductor's own C++ code cache (as CPU kernels are compiled:
same compiler, flags and on-disk cache) and returns a
``torch_kiln._C._GeneratedKernel``, whose ``launch(device, *args)`` packs the
arguments and enqueues one call on the current stream of ``kiln:device``
(See Note [Compiled code runs in stream order] in ``__init__.py``).
"""

from __future__ import annotations

import ctypes
import re

from torch_kiln import _C

ENTRY_SUFFIX = "_kiln_entry"

_FLOAT_TYPES = ("float", "double", "half", "bfloat16", "Half", "BFloat16")


def _argument_kind(cpp_type: str) -> str:
    """The signature letter of a kernel argument of C++ type ``cpp_type``
    (see torch_kiln/csrc/python/GeneratedKernelBindings.cc)."""
    t = cpp_type.strip()
    if t.endswith("*"):
        return "r" if t.startswith("const ") else "w"
    base = t.removeprefix("const ").strip()
    if base in ("int64_t", "int32_t", "int", "long", "bool", "uint64_t", "int16_t", "int8_t", "uint8_t"):
        return "i"
    if any(base.endswith(f) for f in _FLOAT_TYPES):
        return "f"
    raise NotImplementedError(
        f"kiln: a generated kernel takes an argument of C++ type '{cpp_type}', which the kiln "
        "kernel launcher does not pass (it passes pointers, integers and floating-point scalars). "
        "Compile this graph with backend='aot_eager' instead, and please report it."
    )


def entry_trampoline(kernel_name: str, arg_types: list[str]) -> tuple[str, str]:
    """``(signature, C++ source)`` of ``<kernel_name>_kiln_entry`` for a kernel
    whose arguments have the C++ types ``arg_types`` (as Inductor's
    ``KernelArgs.cpp_argdefs()`` lists them)."""
    kinds = [_argument_kind(t) for t in arg_types]
    unpacked = []
    for i, (kind, cpp_type) in enumerate(zip(kinds, arg_types)):
        if kind in "rw":
            unpacked.append(f"reinterpret_cast<{cpp_type}>(packed[{i}])")
        elif kind == "i":
            unpacked.append(f"static_cast<{cpp_type.removeprefix('const ')}>(packed[{i}])")
        else:
            base = cpp_type.removeprefix("const ")
            unpacked.append(f"static_cast<{base}>(kiln_unpack_double(packed[{i}]))")
    arguments = ",\n        ".join(unpacked)
    source = f"""
// kiln: one signature for every generated kernel (torch_kiln/compiler/inductor/kernels.py).
#include <cstring>
static inline double kiln_unpack_double(int64_t bits) {{
    double value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
}}
extern "C" void {kernel_name}{ENTRY_SUFFIX}(const int64_t* packed) {{
    {kernel_name}(
        {arguments});
}}
"""
    return "".join(kinds), source


# What Inductor's C++ kernels write for an indirect index out of range
# (CppKernel.indirect_assert): a TORCH_CHECK that throws.
INDEX_CHECK_MARKER = "index out of bounds:"


# Note [Index errors of compiled kernels]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Inductor's check is a TORCH_CHECK, a RuntimeError, whichever operator the
# index came from (compiled CPU raises RuntimeError for all of them; so does
# CUDA, eager or compiled, through its device-side assert). Eager ATen on
# the CPU, and so eager kiln, raises IndexError for most indexing (`x[i]`,
# index_select along dim 0, embedding, take, index_put, index_copy,
# index_fill) and RuntimeError for gather and scatter. A compiled kiln
# kernel raises IndexError, unless the operators of the compiled graph it
# was generated from include gather or a scatter and no other indexing
# operator: then it keeps the RuntimeError. The rule reads only the compiled
# graph, because Inductor's caches reuse one compiled graph for every
# program that decomposes to it; where eager's class depends on more than
# the graph's operators it can differ: index_add (IndexError in 1-D,
# RuntimeError in 2-D eagerly; compiled, it is an index_put: IndexError),
# index_select along another dimension and max_unpool (RuntimeError
# eagerly, IndexError compiled), and a kernel fused from gather and indexing
# (IndexError; eagerly, whichever op fails first). The launch makes the
# conversion (GeneratedKernelCall::index_check_raises_index_error,
# torch_kiln/csrc/aten/GeneratedKernels.h): the kernel cannot throw
# IndexError itself, as its shared library does not link c10's exception
# types. Either way the error is raised at the next synchronization, as an
# eager kernel's (tests/test_compile_inductor.py).
_RUNTIME_ERROR_INDEXING_OPS = frozenset({"gather", "scatter", "scatter_add", "scatter_reduce"})
_INDEX_ERROR_INDEXING_OPS = frozenset(
    {"index", "_unsafe_index", "index_select", "embedding", "take", "index_put",
     "_unsafe_index_put", "index_copy", "index_fill", "index_reduce"})


def index_check_raises_index_error(origin_ops: set[str]) -> bool:
    """Whether a kernel generated from the aten operators named in
    ``origin_ops`` (those of the compiled graph, e.g. ``{"gather", "add"}``)
    raises IndexError from its index checks (False: RuntimeError, as eager
    gather and scatter)."""
    return not (origin_ops & _RUNTIME_ERROR_INDEXING_OPS) or bool(
        origin_ops & _INDEX_ERROR_INDEXING_OPS)


def needs_serial_build(source: str) -> bool:
    """Whether ``source`` must be built without OpenMP.

    A C++ exception that leaves an OpenMP parallel region calls
    ``std::terminate``: a kernel whose indirect-index check throws inside
    ``#pragma omp parallel`` would kill the process instead of raising
    IndexError at the next synchronization. Kiln builds such kernels
    without OpenMP (their pragmas are ignored and the loops run on the stream
    worker alone), so the check's exception reaches the task and becomes the
    stream's sticky error like an eager kernel's."""
    return INDEX_CHECK_MARKER in source


# Note [Inductor's integer-division flag on kiln]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Inductor's C++ kernels report an integer division by zero through one
# pointer, `inductor_cpu_integer_div_error_flag`, an inline variable of
# cpp_prefix.h: every kernel points it at a local atomic on entry and resets
# it to nullptr on exit, and the three scalar helpers that divide
# (floor_divide_integral, mod, remainder_integral) store to it. The variable
# is a GNU unique symbol, one per process across all kernel libraries, so two
# kernels running at once (two kiln streams, two devices) race on it: one
# kernel's exit nulls the pointer under the other, whose division by zero
# then throws inside an OpenMP region (std::terminate), or the pointer
# outlives the local it points to. Kiln rewrites each kernel's source:
# a kernel that calls none of the three helpers never touches the pointer
# (it has nothing to report), and one that does holds a process-wide mutex
# (an inline variable too, so unique in the same way) from setting the
# pointer to its final check. Only kernels that divide integers are
# serialized, and only against each other.
INTEGER_DIV_FLAG_SET = "inductor_cpu_integer_div_error_flag = &inductor_cpu_integer_div_error;"
INTEGER_DIV_FLAG_CLEAR = "inductor_cpu_integer_div_error_flag = nullptr;"
_INTEGER_DIV_HELPERS = re.compile(r"\b(floor_divide_integral|remainder_integral|mod)\(")
_PREFIX_INCLUDE = "#include <torch/csrc/inductor/cpp_prefix.h>"
_FLAG_MUTEX = "kiln_integer_div_flag_mutex"


def isolate_integer_division_flag(source: str) -> str:
    """``source`` (one generated kernel) rewritten so it uses Inductor's
    process-wide integer-division flag only while holding a process-wide
    mutex, and only if it divides integers (Note [Inductor's integer-division
    flag on kiln])."""
    if INTEGER_DIV_FLAG_SET not in source:
        return source
    if not _INTEGER_DIV_HELPERS.search(source):
        return source.replace(INTEGER_DIV_FLAG_SET, "").replace(INTEGER_DIV_FLAG_CLEAR, "")
    if _PREFIX_INCLUDE not in source:
        raise RuntimeError(
            "kiln: a generated kernel that divides integers does not include cpp_prefix.h; "
            "kiln cannot guard Inductor's division-by-zero flag for it")
    declaration = f"{_PREFIX_INCLUDE}\n#include <mutex>\ninline std::mutex {_FLAG_MUTEX};"
    guard = f"std::lock_guard<std::mutex> kiln_integer_div_flag_guard({_FLAG_MUTEX}); "
    return (source.replace(_PREFIX_INCLUDE, declaration, 1)
            .replace(INTEGER_DIV_FLAG_SET, guard + INTEGER_DIV_FLAG_SET))


# Note [Generated kernels use at most their compile-time thread count]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Kiln generates the C++ Inductor generates for CPU, decisions included:
# which loops run in parallel (none for a small kernel), whether a reduction
# splits across threads, and how many per-thread partial results it keeps
# all follow the thread count T in force when the graph is compiled
# (``parallel_num_threads()``, the compiling thread's torch.get_num_threads()),
# so compiled kiln gives compiled CPU's bits at the same count. (Kiln used to
# turn on ``cpp.dynamic_threads``, which opens a parallel region in every
# kernel and splits every reduction by thread: other bits than CPU's, and a
# barrier per tiny kernel.)
#
# A kernel runs on a stream worker whose OpenMP count is the launching
# thread's torch.get_num_threads() (Note [Intra-op threads of kiln kernels]).
# Dynamo compiles a function again when the caller's count changes (its
# global-state guard), but not the backward graph compiled with it, which
# autograd launches later with the count in force then. Where Inductor
# writes a bare ``#pragma omp parallel`` (T is the machine's core count),
# such a launch could run more threads than the kernel's per-thread arrays
# have slots (T). Kiln's kernels cap the team at T:
# ``num_threads(min(omp_get_max_threads(), T))``: a lower count reaches them
# as it reaches CPU's, a higher one does not. Regions Inductor already fixes
# (``num_threads(N)``) are left as Inductor wrote them. T is
# part of kiln's cache key (cache_key.py).

_BARE_PARALLEL = re.compile(r"^(\s*)#pragma omp parallel\s*$", re.MULTILINE)


def cap_parallel_threads(source: str, threads: int) -> str:
    """``source`` (one generated kernel) with each bare ``#pragma omp
    parallel`` limited to ``threads``, the count it was generated for (Note
    [Generated kernels use at most their compile-time thread count])."""
    clause = f"num_threads(omp_get_max_threads() < {threads} ? omp_get_max_threads() : {threads})"
    return _BARE_PARALLEL.sub(lambda m: f"{m.group(1)}#pragma omp parallel {clause}", source)


# Note [Kiln's kernels keep GCC's loop vectorizer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Inductor builds C++ kernels with GCC's ``-fno-tree-loop-vectorize``
# (cpp_builder.py; not for clang). Its kernels are explicit at::vec code, but
# at::vec stores a vector mask as ``bool`` (``VecMask<float, 1>::store(bool*)``)
# through plain loops over the 64 lanes of ``Vectorized<bool>``, which GCC
# then leaves scalar (perf annotate: byte moves and branches). Every kernel
# that writes a comparison's result does that store, as a training ReLU or
# max-pool does for its backward's mask:
# ``(x + b) <= 0`` on 802,816 floats took 7.2 ms compiled against eager's
# 0.48 ms (a standalone build of the same loop: 7.6 ms with the flag, 0.25
# ms without). Kiln builds its kernels with ``-ftree-loop-vectorize`` after
# Inductor's flags, so the last one wins. The source is Inductor's CPU
# kernel unchanged; vectorizing a loop does not change its results here,
# because Inductor's flags keep GCC from reassociating floating-point
# arithmetic (no ``-fassociative-math``: floating-point reductions stay in
# order) or calling vector math libraries, so kiln still gives compiled
# CPU's bits (tests/test_compile_inductor.py, tests/test_compile_cpu_heuristics.py
# compare them). The flag is part of the C++ cache key.

def loop_vectorizer_flags() -> tuple[str, ...]:
    """``("-ftree-loop-vectorize",)`` when Inductor compiles with GCC, else
    ``()`` (Note [Kiln's kernels keep GCC's loop vectorizer])."""
    from torch._inductor.cpp_builder import _is_gcc, get_cpp_compiler

    return ("-ftree-loop-vectorize",) if _is_gcc(get_cpp_compiler()) else ()


def load_kernel(async_compile, name: str, signature: str, source: str,
                entry: str = "kernel" + ENTRY_SUFFIX, index_error: bool = True):
    """Compiles ``source`` (a generated kernel plus its trampoline) with
    Inductor's C++ code cache and returns a ``_GeneratedKernel`` named
    ``name`` launching its function ``entry``.

    ``async_compile`` is the wrapper module's ``AsyncCompile``: with more
    than one compile thread (``torch._inductor.config.compile_threads``) the
    compilation runs in Inductor's compile workers, as CPU kernels' do, and
    this returns a future that the module's ``async_compile.wait(globals())``
    resolves. ``index_error=False`` keeps the kernel's index checks
    RuntimeErrors (Note [Index errors of compiled kernels]). Raises what
    Inductor's C++ compilation raises (``CppCompileError``) if the source
    does not compile."""
    from torch._inductor.async_compile import get_compile_threads
    from torch._inductor.codecache import CppCodeCache, LambdaFuture

    extra_flags = ("-fno-openmp",) if needs_serial_build(source) else ()
    extra_flags += loop_vectorizer_flags()

    def make(library):
        address = ctypes.cast(getattr(library, entry), ctypes.c_void_p).value
        return _C._GeneratedKernel(name, address, signature,
                                   index_check_raises_index_error=index_error)

    if get_compile_threads() <= 1:
        return make(CppCodeCache.load(source, extra_flags=extra_flags))
    get_result = CppCodeCache.load_async(source, submit_fn=async_compile.submit, extra_flags=extra_flags)
    return LambdaFuture(lambda: make(get_result()))
