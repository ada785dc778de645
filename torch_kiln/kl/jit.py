"""``@kl.jit``: a kl kernel as a launchable, compiled, registered operator.

``kernel = kl.jit(fn)`` reads ``fn``'s parameters: ``p: kl.constexpr`` ones
are compile-time constants; a parameter the body passes to kl.load /
kl.store (or whose ``.shape`` / ``.stride`` it reads) is a tensor, written
if it is kl.store's first argument; the rest are scalars (int or float).
It defines the operator ``torch.ops.kl.<name>`` (a torch.library custom op:
the written tensors are mutated arguments, no returns) with a kiln
implementation, a CPU implementation (the simulator) and a fake one (it
allocates nothing: kernels write tensors they are given), so a launch
works in eager code and as one node under ``torch.compile``.

``kernel[grid](*args, **kwargs)`` (Triton's form; ``grid`` a tuple of up to
3 ints or a function of the arguments by name returning one) calls that
operator. Its kiln implementation specialises the kernel on the tensors'
dtypes and ranks, the scalars' kinds and the constexpr values, traces it
(tracer.py: tile-model checks), lowers it to C++ (lowering.py) and builds
and launches it through part 1 (torch_kiln.kernels.load_inline: the disk
cache keyed by the generated source and the flags; the launch is a task on
the current kiln stream of the tensors' device). Each specialisation is
traced and built once per process (and once per machine on disk). With
``simulate=True`` or ``KILN_KL_SIMULATE=1`` the kiln implementation runs
the simulator instead (tensors copied to the CPU and the written ones back).

Errors at the call: a wrong argument count or name (TypeError), a tensor
where a scalar is expected or the reverse (TypeError), a tensor of a dtype
the tile model does not support (TypeError), tensors on different devices
(RuntimeError), a bad grid (ValueError), each naming the kernel and the
argument.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import itertools
import numbers
import os
import textwrap
import threading

import torch

from torch_kiln.kernels.autograd import autograd_kernel, guard_backward
from torch_kiln.kernels.launch import check_written
from torch_kiln.kernels.library import alias_names
from torch_kiln.kl import ir, lowering, tile_model, tracer
from torch_kiln.kl.errors import KernelError
from torch_kiln.kl.language import constexpr

_LIBRARY = None
_NAMES: set[str] = set()
_LOCK = threading.Lock()
_COMPILE_STATS = {"traces": 0, "libraries_loaded": 0}  # per process, for tests


class _FakeRun(threading.local):
    active = False  # set while kl.op runs a function as its fake implementation


_FAKE_RUN = _FakeRun()


@contextlib.contextmanager
def launches_skipped():
    """Kernel launches in this thread bind their arguments and return without
    running (kl.op's fake implementation: shapes come from the function's
    allocations, and a constexpr computed from a symbolic size need not be
    known)."""
    previous, _FAKE_RUN.active = _FAKE_RUN.active, True
    try:
        yield
    finally:
        _FAKE_RUN.active = previous


# Appended to part 1's flags (-O3 ...): -O2 with the vectoriser's dynamic cost
# model vectorises the same row loops; -O3 takes about 5x longer to build a
# generated kernel (hundreds of small loops) for no measured gain.
# -ffp-contract=off: g++ contracts a * b + c into one fused multiply-add by
# default in C++ (even with -std=c++17), which rounds once where the
# kernel's two ops round twice; off, every kl op rounds as written, so fused
# and unfused lowerings agree bit for bit (Note [kl elementwise fusion]) and
# agree with the simulator's op-by-op PyTorch math.
# -fwrapv: signed integer overflow wraps (two's complement), as PyTorch's
# int64 tensors do in the simulator. Without it, overflow is undefined in
# C++ and g++ folds it away: (n * 4) // 4 became n and m + 1 > m became true
# where the simulator wrapped (tests/test_kl_lowering.py, int64 overflow).
# -fno-tree-loop-distribute-patterns: g++ turns a row copy loop (a tile's
# load, kl_load_row) into a call of memcpy, and glibc's memcpy took 28% of
# the RMSNorm kernel's time on a 4 KiB row (perf, AMD EPYC with AVX-512:
# __memmove_avx512_unaligned_erms); left as a vectorised loop, the kernel
# ran 0.59 ms instead of 1.35 ms (4096x1024, one thread, docs/kernels.md).
CFLAGS = ("-O2", "-fvect-cost-model=dynamic", "-ffp-contract=off", "-fwrapv",
          "-fno-tree-loop-distribute-patterns")


def _kl_library():
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library("kl", "FRAGMENT")
    return _LIBRARY


def _is_constexpr(annotation) -> bool:
    if annotation is constexpr:
        return True
    return isinstance(annotation, str) and annotation.split(".")[-1] == "constexpr"


def _source_tree(fn):
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError):
        return None


def _resolve(fn, func):
    """The object a call's ``func`` node names in ``fn``'s scope: a global or
    closure name, or ``module.name``; None if not resolvable by reading
    names."""
    if isinstance(func, ast.Name):
        scope = dict(zip(fn.__code__.co_freevars,
                         (c.cell_contents for c in fn.__closure__ or () if _filled(c))))
        return scope.get(func.id, fn.__globals__.get(func.id))
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        owner = fn.__globals__.get(func.value.id)
        return getattr(owner, func.attr, None) if inspect.ismodule(owner) else None
    return None


def _callee(fn, func):
    """The Python function (a helper) a call's ``func`` node names, or
    None: kl's own functions, builtins, anything not resolvable."""
    target = _resolve(fn, func)
    if not inspect.isfunction(target) or target.__module__.startswith("torch_kiln.kl"):
        return None
    return target


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a closure variable not yet assigned
        return False
    return True


def _analyse(fn, names=None, seen=None, kernel=None) -> tuple[set[str], set[str]]:
    """(tensor params, written params) of kernel ``fn``, read from its
    source: a parameter is a tensor if it is kl.loaded or kl.stored (written)
    or its ``.shape``/``.stride``/``.ndim`` is read, in the kernel or in a
    helper function it is passed to by name (followed through globals,
    closures and ``module.function``, as the tracer will call them).
    ``names`` maps fn's local names to kernel parameters (None: fn is the
    kernel, named ``kernel`` in errors). A launch of a kl kernel (``k[grid](...)``
    or ``k(...)``) raises TypeError: kernels do not launch kernels."""
    kernel = fn.__name__ if kernel is None else kernel
    tree = _source_tree(fn)
    if tree is None:
        if names is None:
            raise TypeError(f"kl.jit: the source of {fn.__qualname__} is not available (kl "
                            "reads it to find the tensor parameters); define kernels in a file")
        return set(), set()  # a helper kl cannot read: its uses stay unknown
    if names is None:
        names = {name: name for name in inspect.signature(fn).parameters}
    seen = set() if seen is None else seen
    tensors, written = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            launched = _resolve(fn, func.value if isinstance(func, ast.Subscript) else func)
            if isinstance(launched, JITFunction):
                line = fn.__code__.co_firstlineno + node.lineno - 1
                raise TypeError(f"kl kernel {kernel} launches kl kernel {launched.__name__} at "
                                f"{fn.__code__.co_filename}:{line}: a kernel cannot launch "
                                "kernels; put the shared code in a plain Python function (a "
                                "helper, which kl runs inline) and call that from both")
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if fname in ("load", "store") and node.args and \
                    isinstance(node.args[0], ast.Name) and node.args[0].id in names:
                tensors.add(names[node.args[0].id])
                if fname == "store":
                    written.add(names[node.args[0].id])
            callee = _callee(fn, func)
            if callee is not None:
                passed = _passed(callee, node, names)
                key = (callee.__code__, frozenset(passed.items()))
                if passed and key not in seen:
                    seen.add(key)
                    inner_tensors, inner_written = _analyse(callee, passed, seen, kernel)
                    tensors |= inner_tensors
                    written |= inner_written
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.attr in ("shape", "stride", "ndim") and node.value.id in names:
            tensors.add(names[node.value.id])
    return tensors, written


def _passed(callee, call, names) -> dict[str, str]:
    """{callee parameter: kernel parameter} for the call's arguments that
    are names of kernel parameters (positional and keyword)."""
    params = [p for p in inspect.signature(callee).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    passed = {}
    for param, arg in zip(params, call.args):
        if isinstance(arg, ast.Starred):
            break
        if isinstance(arg, ast.Name) and arg.id in names:
            passed[param.name] = names[arg.id]
    for keyword in call.keywords:
        if keyword.arg and isinstance(keyword.value, ast.Name) and keyword.value.id in names:
            passed[keyword.arg] = names[keyword.value.id]
    return passed


class GridKeyError(KeyError):
    """A grid function's KeyError, reworded to name the kernel; a KeyError
    whose str() is its message (KeyError's own str() quotes it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# The largest grid a launch may have, per axis: CUDA's limits on a grid's x, y
# and z dimensions (CUDA C++ Programming Guide, "Features and Technical
# Specifications", maximum x-/y-/z-dimension of a grid), as Triton has them.
MAX_GRID = (2**31 - 1, 65535, 65535)
# The operator's last three arguments: the grid (reserved parameter names).
_GRID_PARAMS = ("kl_grid0", "kl_grid1", "kl_grid2")


# Note [A kl kernel's first use may be under torch.compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A kernel is prepared (its parameters classified, its operator registered,
# Note [kl parameters are classified at first use]) on its first use, which
# may be inside a function Dynamo traces. Dynamo cannot trace that work (a
# lock, reading source files, registering an operator): it broke the graph
# there, and under fullgraph=True raised "Unsupported context manager". So
# while Dynamo traces, JITFunction._prepare calls the function below, which
# Dynamo runs eagerly at trace time and takes the result of as a constant
# (torch._dynamo.assume_constant_result's marker, set by hand so that kl
# does not import Dynamo). Dynamo then reads the prepared kernel's
# attributes; _prepare reads none of them before this call, so Dynamo never
# sees an unprepared value. Preparing twice is harmless (_prepare returns
# at once).
def _prepare_eagerly_while_tracing(kernel: "JITFunction") -> bool:
    kernel._prepare()
    return True


_prepare_eagerly_while_tracing._dynamo_marked_constant = True  # type: ignore[attr-defined]


class JITFunction:
    """A kl kernel; launch with ``kernel[grid](*args)``. ``op`` is its
    torch.library operator; ``source(*args, grid=...)`` the generated C++
    for those arguments (for reading and debugging)."""

    def __init__(self, fn, simulate: bool = False):
        if not inspect.isfunction(fn):
            raise TypeError(f"kl.jit decorates a Python function (def), got "
                            f"{type(fn).__name__} {fn!r}")
        if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn) or \
                inspect.isasyncgenfunction(fn):
            raise TypeError(f"kl.jit {fn.__name__}: a kernel is a plain function (def), not "
                            "async def or a generator: its body would never run")
        if not fn.__name__.isidentifier():
            raise TypeError(f"kl.jit: a kernel must be a function defined with def (its name "
                            f"names the operator torch.ops.kl.<name>), got {fn.__name__!r}")
        for name in inspect.signature(fn).parameters:
            if name in _GRID_PARAMS:
                raise ValueError(f"kl.jit {fn.__name__}: parameter name '{name}' is reserved "
                                 f"({', '.join(_GRID_PARAMS)} carry the grid in the kernel's "
                                 "operator); rename it")
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self.simulate = simulate
        if _source_tree(fn) is None:
            raise TypeError(f"kl.jit: the source of {fn.__qualname__} is not available (kl "
                            "reads it to find the tensor parameters); define kernels in a file")
        self.defaults = {}
        for name, p in inspect.signature(fn).parameters.items():
            if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                raise TypeError(f"kl.jit {fn.__name__}: parameter '{name}' must be a plain "
                                "positional parameter (no *args, **kwargs, keyword-only)")
            if p.default is not p.empty:
                self.defaults[name] = p.default
        self._params: list[ir.Param] | None = None  # set by _prepare
        self._prepare_lock = threading.Lock()
        self._specs: dict = {}
        self._spec_lock = threading.Lock()

    # Note [kl parameters are classified at first use]: whether a parameter
    # is a tensor (and whether it is written) is read from the kernel's
    # source and the helper functions it calls (_analyse). Helpers are found
    # by name in the kernel's module, which may define them after the
    # kernel, so the reading, and the operator's registration that needs
    # it, happen at the first launch (or the first use of params, op, name).

    def _prepare(self) -> None:
        if torch.compiler.is_dynamo_compiling():
            # A first use inside torch.compile: Dynamo cannot trace the
            # lock or the source analysis, so it runs them eagerly (Note
            # [A kl kernel's first use may be under torch.compile]).
            _prepare_eagerly_while_tracing(self)
            return
        if self._params is not None:
            return
        with self._prepare_lock:
            if self._params is not None:
                return
            tensors, written = _analyse(self.fn)
            params = []
            for name, p in inspect.signature(self.fn).parameters.items():
                kind = ("constexpr" if _is_constexpr(p.annotation) else
                        "tensor" if name in tensors else "scalar")
                params.append(ir.Param(name, kind, name in written))
            self._name, self._op = self._register(params)
            self._params = params

    @property
    def params(self) -> list[ir.Param]:
        self._prepare()
        return self._params

    @property
    def name(self) -> str:
        """The operator's name: torch.ops.kl.<name>."""
        self._prepare()
        return self._name

    @property
    def op(self):
        """The kernel's torch.library operator (torch.ops.kl.<name>.default)."""
        self._prepare()
        return self._op

    def __repr__(self) -> str:
        return f"<kl kernel {self.fn.__qualname__} (torch.ops.kl.{self.name})>"

    # ------------------------------------------------------------ operator
    def _register(self, params) -> tuple:
        with _LOCK:
            base = self.fn.__name__
            name = base
            for k in itertools.count(1):
                if name not in _NAMES:
                    break
                name = f"{base}_{k}"
            _NAMES.add(name)
        parts, aliases = [], alias_names()
        for p in params:
            if p.kind == "tensor":
                parts.append(f"Tensor({next(aliases)}!) {p.name}" if p.written
                             else f"Tensor {p.name}")
            else:
                parts.append(f"Scalar {p.name}")
        parts += [f"SymInt {name}" for name in _GRID_PARAMS]
        lib = _kl_library()
        lib.define(f"{name}({', '.join(parts)}) -> ()")
        lib.impl(name, self._kiln_impl, "PrivateUse1")
        lib.impl(name, self._cpu_impl, "CPU")
        torch.library.register_fake(f"kl::{name}", lambda *args: None, lib=lib)
        lib.impl(name, autograd_kernel(f"kl::{name}", [i for i, p in enumerate(params)
                                                        if p.kind == "tensor" and p.written]),
                 "Autograd", with_keyset=True)
        return name, getattr(torch.ops.kl, name).default

    def __getitem__(self, grid):
        return _Launcher(self, grid)

    def __call__(self, *args, **kwargs):
        raise TypeError(f"kl kernel {self.fn.__name__} is launched with a grid: "
                        f"{self.fn.__name__}[grid](...), e.g. {self.fn.__name__}[(n,)](...)")

    def _bind(self, args, kwargs) -> dict:
        if len(args) > len(self.params):
            raise TypeError(f"kl kernel {self.fn.__name__} takes {len(self.params)} arguments "
                            f"({', '.join(p.name for p in self.params)}), got {len(args)}")
        names = {p.name for p in self.params}
        for k in kwargs:
            if k not in names:
                raise TypeError(f"kl kernel {self.fn.__name__}: unexpected argument '{k}'")
        values = {}
        for i, p in enumerate(self.params):
            if i < len(args):
                if p.name in kwargs:
                    raise TypeError(f"kl kernel {self.fn.__name__}: argument '{p.name}' given "
                                    "twice")
                values[p.name] = args[i]
            elif p.name in kwargs:
                values[p.name] = kwargs[p.name]
            elif p.name in self.defaults:
                values[p.name] = self.defaults[p.name]
            else:
                raise TypeError(f"kl kernel {self.fn.__name__}: missing argument '{p.name}' "
                                f"(takes {', '.join(p.name for p in self.params)})")
        return values

    def _check_kinds(self, values) -> None:
        """Tensors for tensor parameters, numbers for the others (checked
        before the operator call, whose schema would reject them with a
        message that does not name the kernel)."""
        where = f"kl kernel {self.fn.__name__}"
        for p in self.params:
            v = values[p.name]
            if p.kind == "tensor" and not isinstance(v, torch.Tensor):
                raise TypeError(f"{where}: argument '{p.name}' must be a tensor (the kernel "
                                f"loads or stores it), got {type(v).__name__}")
            if p.kind == "scalar" and isinstance(v, torch.Tensor):
                raise TypeError(f"{where}: argument '{p.name}' is a tensor, but the kernel "
                                f"never kl.loads or kl.stores it, so kl takes '{p.name}' as an "
                                f"int or float scalar: use it in the kernel, or drop the "
                                f"parameter")
            if p.kind == "scalar" and (isinstance(v, bool) or not isinstance(
                    v, (numbers.Real, torch.SymInt, torch.SymFloat))):  # Sym*: under compile
                raise TypeError(f"{where}: argument '{p.name}' must be an int or float scalar "
                                f"(the kernel does not kl.load it), got {type(v).__name__}")
            if p.kind != "tensor" and isinstance(v, numbers.Integral) and \
                    not -2**63 <= int(v) < 2**63:
                raise ValueError(f"{where}: int argument '{p.name}' is {int(v)}; kl int "
                                 f"scalars and constexprs are int64 ({-2**63} to {2**63 - 1})")
            if p.kind == "constexpr" and not isinstance(v, (bool, int, float)):
                raise TypeError(f"{where}: kl.constexpr argument '{p.name}' must be a Python "
                                f"int, float or bool, got {type(v).__name__}")

    def _launch(self, grid, args, kwargs):
        values = self._bind(args, kwargs)
        if _FAKE_RUN.active:
            return
        self._check_kinds(values)
        if not any(p.kind == "tensor" for p in self.params):
            raise TypeError(f"kl kernel {self.fn.__name__} has no tensor parameters: a kernel "
                            "loads from or stores to at least one tensor, whose device also "
                            "says where it runs")
        for p in self.params:
            v = values[p.name]
            if p.kind == "scalar" and type(v) not in (int, float) and \
                    not isinstance(v, (torch.SymInt, torch.SymFloat)):
                # A NumPy (or other numbers.Real) scalar: the operator's schema
                # takes Python numbers only.
                values[p.name] = int(v) if isinstance(v, numbers.Integral) else float(v)
        if callable(grid):
            try:
                grid = grid(values)
            except Exception as e:
                message = (f"kl kernel {self.fn.__name__}: the grid function raised "
                           f"{type(e).__name__}: {e} (it is called with one argument, a dict "
                           f"of the launch's arguments by parameter name, and returns 1 to 3 "
                           f"ints)")
                if isinstance(e, KeyError):
                    wrapped = GridKeyError(message)  # KeyError's str() would quote it
                else:
                    try:
                        wrapped = type(e)(message)  # the same type, for except clauses
                    except Exception:
                        wrapped = RuntimeError(message)
                raise wrapped from e
        if not isinstance(grid, (tuple, list)):
            grid = (grid,)
        if not 1 <= len(grid) <= 3:
            raise ValueError(f"kl kernel {self.fn.__name__}: the grid has {len(grid)} dims; "
                             "give 1 to 3")
        grid = self._check_grid(tuple(grid) + (1,) * (3 - len(grid)), traced=True)
        self.op(*[values[p.name] for p in self.params], *grid)

    def _check_grid(self, grid, traced: bool = False):
        """The grid as 3 ints; ValueError unless each is a non-negative int
        (a float, even 2.0, is refused, as Triton's launcher refuses it).
        ``traced``: at the launch, where torch.compile passes SymInts (and a
        0-dim integer tensor converts), those two pass unchecked and the
        operator's implementation checks them; anything else that is not a
        non-negative int (a str, None, a float) is refused here."""
        for axis, (g, limit) in enumerate(zip(grid, MAX_GRID)):
            if traced and isinstance(g, (torch.SymInt, torch.Tensor)):
                continue  # a size under torch.compile; the implementation checks it
            if isinstance(g, bool) or not isinstance(g, numbers.Integral) or g < 0:
                raise ValueError(f"kl kernel {self.fn.__name__}: grid {grid} must be "
                                 f"non-negative ints, got {type(g).__name__} {g!r}")
            if g > limit:
                raise ValueError(f"kl kernel {self.fn.__name__}: grid {grid} has {g} programs "
                                 f"on axis {axis}; at most {limit} are allowed there (CUDA's "
                                 f"grid limits, {MAX_GRID})")
        return grid if traced else tuple(int(g) for g in grid)

    # ------------------------------------------------------------ impls
    def _unflatten(self, flat):
        n = len(self.params)
        values = dict(zip((p.name for p in self.params), flat[:n]))
        return values, self._check_grid(tuple(flat[n:n + 3]))

    def _spec(self, values):
        # (again here: torch.ops.kl.<name> may be called without the launcher)
        self._check_kinds(values)
        tensor_specs, scalar_kinds, constexprs = {}, {}, {}
        where = f"kl kernel {self.fn.__name__}"
        for p in self.params:
            v = values[p.name]
            if p.kind == "tensor":
                if v.dtype not in tile_model.DTYPES:
                    raise TypeError(f"{where}: argument '{p.name}' is a "
                                    f"{tile_model.dtype_name(v.dtype)} tensor; the kiln tile "
                                    f"model supports {tile_model.supported_dtype_names()}")
                if v.layout != torch.strided:
                    raise TypeError(f"{where}: argument '{p.name}' has layout {v.layout}; kl "
                                    "kernels take strided tensors")
                tensor_specs[p.name] = (v.dtype, v.dim())
            elif p.kind == "scalar":
                scalar_kinds[p.name] = "int" if isinstance(v, numbers.Integral) else "float"
            else:
                constexprs[p.name] = v
        key = (tuple((k, v) for k, v in tensor_specs.items()), tuple(scalar_kinds.items()),
               tuple((k, type(v).__name__, v) for k, v in constexprs.items()))
        return key, tensor_specs, scalar_kinds, constexprs

    def _devices(self, values):
        devices = {values[p.name].device for p in self.params if p.kind == "tensor"}
        if len(devices) > 1:
            raise RuntimeError(f"kl kernel {self.fn.__name__}: expected all tensors on one "
                               f"device, got {', '.join(sorted(map(str, devices)))}")
        return devices.pop() if devices else None

    def _specialisation(self, values):
        key, tensor_specs, scalar_kinds, constexprs = self._spec(values)
        with self._spec_lock:
            entry = self._specs.get(key)
            if entry is None:
                trace = tracer.trace(self.fn, self.fn.__name__, self.params, tensor_specs,
                                     scalar_kinds, constexprs)
                _COMPILE_STATS["traces"] += 1
                for name in trace.written:
                    if not next(p for p in self.params if p.name == name).written:
                        raise KernelError(f"kl kernel {self.fn.__name__!r}: stores to '{name}' "
                                          f"through another name; write kl.store({name}, ...) "
                                          "with the parameter itself so kl sees it is written")
                entry = self._specs[key] = {"trace": trace, "kernel": None}
            return entry

    def _simulate(self, values, grid, entry):
        from torch_kiln.kl import simulator

        cpu_values, copies = dict(values), []
        tensors = [(p, values[p.name]) for p in self.params if p.kind == "tensor"]
        # Arguments over one device storage (a tensor passed twice, or
        # overlapping views) become views of one host copy of that storage,
        # so a store through one is seen by loads through the other, as in
        # compiled code; each other argument is copied alone.
        uses: dict[int, int] = {}
        for _, v in tensors:
            if v.device.type != "cpu":
                key = v.untyped_storage().data_ptr()
                uses[key] = uses.get(key, 0) + 1
        shared: dict[int, torch.UntypedStorage] = {}
        for p, v in tensors:
            if p.written:
                # the compiled path's checks, in its words
                check_written(f"kiln kernel kl::{self.name}: argument '{p.name}'", v)
            if v.device.type == "cpu":
                continue
            key = v.untyped_storage().data_ptr()
            if uses[key] > 1:
                if key not in shared:
                    shared[key] = v.untyped_storage().cpu()
                cpu_values[p.name] = torch.empty(0, dtype=v.dtype).set_(
                    shared[key], v.storage_offset(), v.shape, v.stride())
            else:
                cpu_values[p.name] = v.cpu()
            if p.written:
                copies.append((v, cpu_values[p.name]))
        simulator.simulate(self.fn, entry["trace"], cpu_values, grid)
        for target, source in copies:
            target.copy_(source)
        # (The compiled path's part-1 Kernel does this itself.)
        guard_backward(f"kl::{self.name}", [values[p.name] for p in self.params
                                            if p.kind == "tensor"],
                       [values[p.name] for p in self.params if p.kind == "tensor" and p.written])

    def _cpu_impl(self, *flat):
        values, grid = self._unflatten(flat)
        self._devices(values)
        entry = self._specialisation(values)
        self._simulate(values, grid, entry)

    def _kiln_impl(self, *flat):
        values, grid = self._unflatten(flat)
        device = self._devices(values)
        if device is not None and device.type != "kiln":
            raise RuntimeError(f"kl kernel {self.fn.__name__}: expected kiln tensors, got {device}")
        entry = self._specialisation(values)
        if self.simulate or os.environ.get("KILN_KL_SIMULATE", "0") not in ("", "0"):
            self._simulate(values, grid, entry)
            return
        kernel = self._compiled(entry)
        args = [values[p.name] for p in self.params if p.kind != "constexpr"]
        kernel(*args, *grid)

    def _compiled(self, entry):
        if entry["kernel"] is None:
            with self._spec_lock:
                if entry["kernel"] is None:
                    from torch_kiln import kernels

                    # The C++ kernel is named after the Python function (not the
                    # operator, which may carry a _1 suffix), so the generated
                    # source, hence the disk cache key, depends only on the kernel.
                    source, signature = lowering.lower(entry["trace"], self.fn.__name__)
                    entry["source"] = source
                    library = kernels.load_inline("kl", source, [signature], extra_cflags=CFLAGS)
                    _COMPILE_STATS["libraries_loaded"] += 1
                    entry["library"] = library
                    entry["kernel"] = library.kernels[self.fn.__name__]
        return entry["kernel"]

    def source(self, *args, **kwargs) -> str:
        """The generated C++ for a launch with these arguments."""
        values = self._bind(args, kwargs)
        entry = self._specialisation(values)
        return lowering.lower(entry["trace"], self.fn.__name__)[0]


class _Launcher:
    def __init__(self, fn: JITFunction, grid):
        self.fn = fn
        self.grid = grid

    def __call__(self, *args, **kwargs):
        self.fn._launch(self.grid, args, kwargs)


def jit(fn=None, *, simulate: bool = False):
    """Decorator making ``fn`` a kl kernel (``@kl.jit`` or
    ``@kl.jit(simulate=True)``); see the module docstring."""
    if fn is None:
        return lambda f: JITFunction(f, simulate=simulate)
    return JITFunction(fn, simulate=simulate)


def cdiv(a, b):
    """Ceiling division, ``(a + b - 1) // b`` (for grids)."""
    return (a + b - 1) // b
