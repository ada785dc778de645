"""``torch.compile(mode="reduce-overhead")`` on kiln: each compiled graph is
captured into a kiln graph and replayed (Inductor's CUDA graph trees, for kiln).

Inductor applies CUDA graphs to a compiled graph in ``post_compile``
(``output_code.cudagraph_post_compile``), through the upstream hook
``torch._inductor.config.cudagraph_policy``. :class:`KilnGraphPolicy` is that
policy: for graphs on one kiln device it wraps the compiled callable in a
:class:`KilnGraphedFunction`; graphs on other devices get PyTorch's own
``compile_fx.cudagraphify`` (CUDA graph trees), unchanged. Inductor's lowering
check (``cudagraph_utils.check_lowering_disable_cudagraph``) calls any
non-CUDA device a reason to skip; :func:`_check_lowering` answers for kiln
graphs instead (CPU tensors, several devices, and the checks that Inductor's
graph partitioning skips, which kiln does not partition).

Note [Kiln graphs for reduce-overhead]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The behaviour is CUDA graph trees' (torch/_inductor/cudagraph_trees.py in
PyTorch 2.13), built on torch.kiln.KilnGraph:

* Per compiled graph (an inference graph, or AOTAutograd's forward and
  backward), per *input signature* (sizes, strides, dtypes, devices of
  tensors, values of ints): the first call runs the compiled code eagerly
  (the warm-up: kiln checks an op's meta kernel on its first call with a new
  layout class, which a capture refuses), the second call captures it into a
  kiln graph and replays it, later calls replay. New static shapes and,
  with dynamic shapes, each distinct set of concrete sizes get their own
  graph (one warning past ``config.triton.cudagraph_dynamic_shape_warn_limit``
  signatures, as CUDA). The graphs of one compile (its compile id: forward,
  backward, every signature) share one private memory pool.
* Inputs: parameters and buffers (Inductor's ``static_input_idxs``) and
  outputs of an earlier replay (the saved activations a backward reads) are
  used in place; if such an input's address differs from the capture's, the
  graph is captured again (at most ``cudagraph_unexpected_rerecord_limit``
  times, then the graph runs without replay). Other tensor inputs are copied
  into static placeholders (a kiln copy on the current stream) before each
  replay.
* Replay is one launch on the current kiln stream of the graph's device, so
  it is ordered with the caller's eager work like any kiln op; a replay on a
  different stream than the previous replay of the same pool first waits for
  that stream (a pool's graphs share memory).
* Outputs live in the pool and are overwritten by a later replay, as on CUDA.
  Each call returns new tensors aliasing that memory (storages that do not
  own it); when a new *generation* starts, every output handed out before is
  marked (torch_kiln._C._set_storage_access_error_msg) so that any access
  raises CUDA's "accessing tensor output of CUDAGraphs that has been
  overwritten by a subsequent run" (with "kiln graphs" for "CUDAGraphs")
  instead of reading overwritten data. A generation starts, as CUDA's, at a
  call of a torch.compile'd function (Dynamo's GenerationTracker) unless a
  forward's backward is still pending, or at the first graph call after
  ``torch.compiler.cudagraph_mark_step_begin()``. A graph whose previous
  outputs are still alive in the current generation (a second forward before
  the first one's backward), or whose pool-mate captured later has live
  outputs (its memory may overlap this graph's temporaries), runs that call
  eagerly instead of overwriting them (CUDA records another graph there),
  with one warning.
* Graphs that cannot be captured run without graphs, with one warning naming
  the reason ("skipping cudagraphs due to ..." as Inductor logs it on CUDA):
  CPU tensors or several devices in the graph, mutation of inputs that are
  not static, ``.item()``/data-dependent ops (unbacked sizes), ops tagged
  ``cudagraph_unsafe``, and anything the capture itself refuses (a
  synchronization, a host copy, cross-stream waits: the capture's error
  names the op). ``config.triton.cudagraph_or_error`` raises instead.

Counters: :func:`get_stats` (``torch_kiln.compiler.get_metrics()["kiln_graphs"]``).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["KilnGraphPolicy", "KilnGraphedFunction", "get_stats", "reset_stats", "install"]

_STAT_KEYS = ("graphs_captured", "graph_replays", "warmup_runs", "eager_runs")
_stats: dict[str, Any] = {key: 0 for key in _STAT_KEYS}
_stats["skips"] = {}

_MARKED = (
    "Error: accessing tensor output of kiln graphs that has been overwritten by a subsequent "
    "run (torch.compile mode='reduce-overhead'). Stack trace: {trace}. To prevent "
    "overwriting, clone the tensor outside of torch.compile() or call "
    "torch.compiler.cudagraph_mark_step_begin() before each model invocation."
)


def get_stats() -> dict:
    """Counts since the process started or :func:`reset_stats`:
    ``graphs_captured`` (kiln graphs recorded), ``graph_replays`` (calls
    served by a replay, the capturing call included), ``warmup_runs`` and
    ``eager_runs`` (calls of a graphed function that ran the compiled code
    without a graph), and ``skips`` ({reason: graphs or functions that run
    without kiln graphs})."""
    return {**{k: _stats[k] for k in _STAT_KEYS}, "skips": dict(_stats["skips"])}


def reset_stats() -> None:
    """Sets every count of :func:`get_stats` back to zero."""
    for key in _STAT_KEYS:
        _stats[key] = 0
    _stats["skips"] = {}


def _skip(reason: str) -> None:
    """Records and warns (once per call site) that a graph runs without kiln graphs."""
    from torch._dynamo.utils import counters
    from torch._inductor import config

    reason = reason.strip()
    if not reason.startswith(("skipping cudagraphs", "disabling cudagraphs")):
        reason = f"skipping cudagraphs due to {reason}"
    first = reason.splitlines()[0]
    _stats["skips"][first] = _stats["skips"].get(first, 0) + 1
    counters["inductor"]["cudagraph_skips"] += 1
    if config.triton.cudagraph_or_error:
        raise RuntimeError(reason)
    warnings.warn(f"kiln: mode='reduce-overhead': {reason}\nThis graph runs without kiln graphs "
                  "(the default mode's code: same results, no replay).", stacklevel=3)


# --------------------------------------------------------------------------
# Generations (cudagraph_trees.py: MarkStepBox, GenerationTracker).


def _current_generation() -> int:
    from torch._dynamo.mutation_guard import GenerationTracker
    from torch._inductor.cudagraph_trees import MarkStepBox

    if MarkStepBox.mark_step_counter != 0:
        return MarkStepBox.mark_step_counter
    return GenerationTracker.generation


def _user_invoked_mark_step() -> bool:
    from torch._inductor.cudagraph_trees import MarkStepBox

    return MarkStepBox.mark_step_counter != 0


class _Manager:
    """Process-wide state: the generation, pending backwards, the static
    outputs of live records, and the records whose outputs are out there (to
    mark them when a new generation starts)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.generation: Optional[int] = None
        # Forwards run since the last backward: a weak reference to the record
        # that replayed, or None for an eager run.
        self.pending_backward: list[Optional[weakref.ref]] = []
        self.output_ptrs: dict[int, weakref.ref] = {}  # static output storage address -> record
        self.handed_out: "weakref.WeakSet[_Record]" = weakref.WeakSet()  # records with outputs out

    def begin_call(self, is_backward: bool) -> None:
        if is_backward:
            self.pending_backward.clear()
            return
        generation = _current_generation()
        if generation == self.generation:
            return
        if not _user_invoked_mark_step() and self._backward_pending():
            return  # a forward's backward is still to come: same generation (as CUDA)
        self.generation = generation
        self.pending_backward.clear()
        while self.handed_out:  # only records with outputs out there
            self.handed_out.pop().mark_outputs()

    def _backward_pending(self) -> bool:
        return any(ref is None or ((r := ref()) is not None and r.outputs_alive())
                   for ref in self.pending_backward)

    def is_graph_output(self, tensor: torch.Tensor) -> bool:
        ref = self.output_ptrs.get(tensor.untyped_storage().data_ptr())
        return ref is not None and ref() is not None


_manager = _Manager()


# --------------------------------------------------------------------------
# Static inputs.


def _expanded_dims(t: torch.Tensor) -> list[int]:
    return [d for d in range(t.dim()) if t.stride(d) == 0 and t.size(d) > 1]


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for same-layout tensors, once per element of an expanded (stride-0) dim."""
    for d in _expanded_dims(dst):
        dst, src = dst.narrow(d, 0, 1), src.narrow(d, 0, 1)
    dst.copy_(src)


def _static_like(x: torch.Tensor) -> torch.Tensor:
    """A placeholder with x's sizes and strides (storage offset 0), as CUDA's static_input."""
    if x.numel() == 0:
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
    needed = 1 + sum((size - 1) * stride for size, stride in zip(x.size(), x.stride()))
    return torch.empty(needed, dtype=x.dtype, device=x.device).as_strided(x.size(), x.stride())


def _signature(inputs: Sequence[Any]) -> tuple:
    key = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            key.append((tuple(x.size()), tuple(x.stride()), x.dtype, x.device))
        elif isinstance(x, (int, float, bool)) or x is None:
            key.append((type(x), x))
        else:
            key.append((type(x), id(x)))
    return tuple(key)


# --------------------------------------------------------------------------
# One captured graph.


@contextlib.contextmanager
def _current_stream_object(stream: Any):
    """Dynamo's generated code names streams by index into a registry that
    its bytecode fills before each call; index 0
    (torch._dynamo.graph_bytecode_inputs.CURRENT_STREAM_INDEX) is the stream
    current at the call. A capture switches to the capture stream after that,
    so while the graph is captured index 0 must be the capture stream, or
    `torch.ops.streams.wait_stream.default(1, 0)` makes the side stream wait
    for the caller's stream, which is not capturing, and the side stream's
    work never joins the graph. PyTorch's CUDA graph trees update the entry
    the same way (_update_current_stream_external_object in
    torch/_inductor/cudagraph_trees.py); here it is restored afterwards."""
    from torch._dynamo import graph_bytecode_inputs as registry

    index = registry.CURRENT_STREAM_INDEX
    previous = registry.index_to_external_object_weakref.get(index)
    registry.set_external_object_by_index(index, stream)
    try:
        yield
    finally:
        if previous is None:
            registry.index_to_external_object_weakref.pop(index, None)
        else:
            registry.index_to_external_object_weakref[index] = previous


class _Record:
    """One kiln graph of a graphed function for one input signature."""

    def __init__(self, owner: "KilnGraphedFunction", inputs: list[Any]) -> None:
        self.owner = owner
        self.graph = None
        self.inplace: dict[int, int] = {}    # input index -> data_ptr the graph reads
        self.static_args: list[Any] = list(inputs)
        self.copied: list[int] = []          # input indices refilled before each replay
        self.static_outputs: list[Any] = []  # keeps the pool memory alive
        self.output_specs: list[tuple] = []
        self.storages: list[tuple[int, int]] = []  # (data_ptr, nbytes) per output storage group
        self.handed_out: list[StorageWeakRef] = []
        self.seq = 0
        self.placeholder_streams: set = set()

    # -- capture --------------------------------------------------------

    def capture(self, inputs: list[Any]) -> None:
        import torch_kiln.kiln as kiln

        owner = self.owner
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                continue
            if i not in owner.copy_idxs and (i in owner.static_input_idxs
                                             or _manager.is_graph_output(x)):
                self.inplace[i] = x.data_ptr()
            else:
                placeholder = _static_like(x)
                _copy_into(placeholder, x)
                self.static_args[i] = placeholder
                self.copied.append(i)
        graph = kiln.KilnGraph()
        with kiln.graph(graph, pool=owner.pool), _current_stream_object(kiln.current_stream()):
            outputs = owner.model(list(self.static_args))
        self.graph = graph
        self.static_outputs = list(outputs)
        self._describe_outputs()
        owner.records_captured += 1
        _stats["graphs_captured"] += 1
        self.seq = owner.pool_state.next_seq()
        owner.pool_state.records.add(self)
        ref = weakref.ref(self)
        for ptr, _ in self.storages:
            _manager.output_ptrs[ptr] = ref

    def _describe_outputs(self) -> None:
        owner = self.owner
        arg_storages = {}
        for i, arg in enumerate(self.static_args):
            if isinstance(arg, torch.Tensor):
                arg_storages.setdefault(arg.untyped_storage().data_ptr(), i)
        constant_storages = {c.untyped_storage().data_ptr() for c in owner.constants}
        groups: dict[int, int] = {}
        for out in self.static_outputs:
            if not isinstance(out, torch.Tensor):
                self.output_specs.append(("value", out))
                continue
            ptr = out.untyped_storage().data_ptr()
            if ptr in arg_storages:  # a view of an input: rebuilt from the caller's input
                i = arg_storages[ptr]
                delta = out.storage_offset() - self.static_args[i].storage_offset()
                self.output_specs.append(("input", i, tuple(out.size()), tuple(out.stride()), delta))
            elif ptr in constant_storages or out.numel() == 0 and out.untyped_storage().nbytes() == 0:
                self.output_specs.append(("value", out))
            else:
                if ptr not in groups:
                    groups[ptr] = len(self.storages)
                    self.storages.append((ptr, out.untyped_storage().nbytes()))
                self.output_specs.append(("pool", groups[ptr], out.dtype, tuple(out.size()),
                                          tuple(out.stride()), out.storage_offset()))

    # -- replay ---------------------------------------------------------

    def matches(self, inputs: list[Any]) -> bool:
        return all(inputs[i].data_ptr() == ptr for i, ptr in self.inplace.items())

    def replay(self, inputs: list[Any]) -> list[Any]:
        # The graph replays on its device's current stream, whatever device is current.
        stream = torch.kiln.current_stream(self.owner.device_index)
        state = self.owner.pool_state
        if state.last_stream is not None and state.last_stream != stream:
            stream.wait_stream(state.last_stream)  # the pool's memory was last used there
        if stream not in self.placeholder_streams:
            for i in self.copied:
                self.static_args[i].record_stream(stream)
            self.placeholder_streams.add(stream)
        for i in self.copied:
            dst, src = self.static_args[i], inputs[i]
            if dst.data_ptr() != src.data_ptr():
                _copy_into(dst, src)
        self.graph.replay()
        state.last_stream = stream
        _stats["graph_replays"] += 1
        return self.outputs(inputs)

    def outputs(self, inputs: list[Any]) -> list[Any]:
        device = self.owner.device
        storages = [torch._C._construct_storage_from_data_pointer(ptr, device, nbytes)
                    for ptr, nbytes in self.storages]
        self.handed_out = [StorageWeakRef(s) for s in storages]
        if storages:
            _manager.handed_out.add(self)
        result = []
        for spec in self.output_specs:
            kind = spec[0]
            if kind == "value":
                result.append(spec[1])
            elif kind == "input":
                _, i, size, stride, delta = spec
                x = inputs[i]
                result.append(x.as_strided(size, stride, x.storage_offset() + delta))
            else:
                _, group, dtype, size, stride, offset = spec
                t = torch.empty(0, dtype=dtype, device=device)
                result.append(t.set_(storages[group], offset, size, stride))
        return result

    def outputs_alive(self) -> bool:
        return any(not ref.expired() for ref in self.handed_out)

    def mark_outputs(self) -> None:
        """Makes every output this record handed out raise on access (a new generation)."""
        from torch_kiln import _C

        traces = self.owner.stack_traces or []
        trace = next((t.strip() for t in traces if t), "[Could not find stack trace]")
        for ref in self.handed_out:
            if not ref.expired():
                _C._set_storage_access_error_msg(ref.cdata, _MARKED.format(trace=trace))
        self.handed_out = []

    def __del__(self) -> None:
        # The outputs handed out alias memory this record owns: once it is
        # freed they must raise, not read whatever the pool holds next.
        try:
            self.mark_outputs()
        except Exception:
            pass
        for ptr, _ in self.storages:
            ref = _manager.output_ptrs.get(ptr)
            if ref is not None and ref() is None:
                _manager.output_ptrs.pop(ptr, None)


class _PoolState:
    """The private memory pool shared by the graphs of one compile."""

    def __init__(self) -> None:
        import torch_kiln.kiln as kiln

        self.handle = kiln.graph_pool_handle()
        self.records: "weakref.WeakSet[_Record]" = weakref.WeakSet()
        self.last_stream = None
        self._seq = 0

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq


_pools: "weakref.WeakValueDictionary[tuple, _PoolState]" = weakref.WeakValueDictionary()


def _pool_for_compile(device_index: int) -> _PoolState:
    compile_id = torch._guards.CompileContext.current_compile_id()
    if compile_id is None:
        return _PoolState()
    key = (device_index, str(compile_id))
    state = _pools.get(key)
    if state is None:
        state = _pools[key] = _PoolState()
    return state


# --------------------------------------------------------------------------
# The graphed function.


class KilnGraphedFunction:
    """A compiled Inductor callable (boxed: takes a list of inputs) run through kiln graphs.

    See Note [Kiln graphs for reduce-overhead]. ``inputs`` are those of the
    compiled graph: kiln tensors, ints (symbolic sizes) and other values;
    returns the graph's outputs (tensors alias the graph's pool)."""

    _boxed_call = True

    def __init__(self, model: Callable, static_input_idxs: Sequence[int], *, device_index: int,
                 is_backward: bool, is_inference: bool, stack_traces: Optional[list] = None,
                 constants: Sequence[torch.Tensor] = (), mutated_input_idxs: Sequence[int] = (),
                 placeholders: Sequence[Any] = (), inputs_to_check: Sequence[int] = ()) -> None:
        from torch._inductor.cudagraph_utils import get_mutation_stack_trace

        self.model = model
        self.static_input_idxs = frozenset(static_input_idxs)
        self.device_index = device_index
        self.device = torch.device("kiln", device_index)
        self.is_backward = is_backward
        self.is_inference = is_inference
        self.stack_traces = stack_traces
        self.constants = tuple(constants)
        self.inputs_to_check = tuple(inputs_to_check)
        self.pool_state = _pool_for_compile(device_index)
        self.pool = self.pool_state.handle
        self.records: dict[tuple, list[_Record]] = {}
        self.warmed_up: set[tuple] = set()
        self.records_captured = 0
        self.rerecords = 0
        # Inputs used in place at first whose address then changed (a saved
        # forward input a backward reads, say): copied from then on, unless
        # the graph mutates them (then each new address is a new capture).
        self.copy_idxs: set[int] = set()
        self.mutated_input_idxs = frozenset(mutated_input_idxs)
        self.disabled: Optional[str] = None
        self._warned_busy = False
        self._warned_shapes = False
        mutated = [i for i in mutated_input_idxs if i not in self.static_input_idxs]
        if mutated:
            self.disabled = get_mutation_stack_trace(placeholders, mutated)
            _skip(self.disabled)

    def __call__(self, inputs: list[Any]) -> Any:
        args = list(inputs)
        inputs.clear()  # boxed calling convention: the callee owns the list
        with _manager.lock:
            _manager.begin_call(self.is_backward)
            record = None
            if self.disabled is not None:
                outputs = self._run_eagerly(args, "eager_runs")
            else:
                outputs, record = self._call(args)
            if not self.is_backward and not self.is_inference:
                # Its backward is pending while its outputs live (a replay's),
                # or until a backward runs (an eager run's, not tracked).
                _manager.pending_backward.append(None if record is None else weakref.ref(record))
            return outputs

    def _call(self, args: list[Any]) -> tuple[Any, Optional[_Record]]:
        from torch._inductor import config

        key = _signature(args)
        if key not in self.warmed_up:
            self.warmed_up.add(key)
            limit = config.triton.cudagraph_dynamic_shape_warn_limit
            if limit is not None and len(self.warmed_up) > limit and not self._warned_shapes:
                self._warned_shapes = True
                warnings.warn(
                    "kiln: mode='reduce-overhead' records a new kiln graph for each distinct input "
                    f"size; {len(self.warmed_up)} distinct sizes seen for this graph. Consider "
                    "padding inputs to a few fixed shapes, or set torch._inductor.config.triton."
                    "cudagraph_skip_dynamic_graphs=True (no graphs for dynamic-shape graphs); "
                    "torch._inductor.config.triton.cudagraph_dynamic_shape_warn_limit=None "
                    "silences this warning.", stacklevel=4)
            return self._run_eagerly(args, "warmup_runs"), None
        record = next((r for r in self.records.get(key, ()) if r.matches(args)), None)
        if record is None and key in self.records:
            self.rerecords += 1
            latest = self.records[key][-1]
            for i, ptr in latest.inplace.items():
                if args[i].data_ptr() != ptr and i not in self.mutated_input_idxs:
                    self.copy_idxs.add(i)
        if record is None:
            if self.rerecords > config.triton.cudagraph_unexpected_rerecord_limit:
                self.disabled = ("skipping cudagraphs due to exceeding the re-record limit "
                                 f"({config.triton.cudagraph_unexpected_rerecord_limit}: "
                                 "torch._inductor.config.triton.cudagraph_unexpected_rerecord_limit)"
                                 " on a graph whose static input addresses keep changing")
                _skip(self.disabled)
                return self._run_eagerly(args, "eager_runs"), None
            record = _Record(self, args)
            try:
                with torch.kiln.device(self.device_index):  # the capture stream is per device
                    record.capture(args)
            except RuntimeError as error:
                self.disabled = f"skipping cudagraphs due to a kiln graph capture error: {error}"
                _skip(self.disabled)
                return self._run_eagerly(args, "eager_runs"), None
            self.records.setdefault(key, []).append(record)
        else:
            busy = self._busy(record)
            if busy:
                if not self._warned_busy:
                    self._warned_busy = True
                    warnings.warn(f"kiln: mode='reduce-overhead': {busy}; this call runs without "
                                  "its kiln graph (same results). Consider running with "
                                  "torch.no_grad() or calling "
                                  "torch.compiler.cudagraph_mark_step_begin() before each model "
                                  "invocation.", stacklevel=4)
                return self._run_eagerly(args, "eager_runs"), None
        # The capturing call replays too: a capture records the work without running it.
        return record.replay(args), record

    def _busy(self, record: _Record) -> Optional[str]:
        if record.outputs_alive():
            return ("outputs of this graph's previous replay are still alive in the same step "
                    "(a forward whose backward has not run yet, or outputs kept from this step)")
        later = [r for r in self.pool_state.records if r.seq > record.seq and r.outputs_alive()]
        if later:
            return ("outputs of a graph captured later in the same memory pool are still alive "
                    "in the same step")
        return None

    def _run_eagerly(self, args: list[Any], stat: str) -> Any:
        from torch._inductor.utils import copy_misaligned_inputs

        _stats[stat] += 1
        if self.inputs_to_check:
            copy_misaligned_inputs(args, self.inputs_to_check)
        return self.model(args)


# --------------------------------------------------------------------------
# Inductor hooks.


def _skip_reason(compiled_graph: Any) -> Optional[str]:
    if compiled_graph.disabled_cudagraphs_reason:
        return compiled_graph.disabled_cudagraphs_reason
    info = compiled_graph.cudagraph_info
    if info is not None and info.cudagraph_fail_reasons:
        return f"skipping cudagraphs due to {info.cudagraph_fail_reasons}"
    return None


def _notify_backward(model: Callable) -> Callable:
    """A backward that runs without kiln graphs still ends its forward's pending state."""

    def run(inputs: list[Any]) -> Any:
        with _manager.lock:
            _manager.begin_call(is_backward=True)
        return model(inputs)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _policy_base():
    from torch._inductor.cudagraph_utils import CUDAGraphPolicy

    return CUDAGraphPolicy


class _Pending(threading.local):
    graph: Any = None


_pending = _Pending()


def _make_policy_class():
    CUDAGraphPolicy = _policy_base()

    class KilnGraphPolicy(CUDAGraphPolicy):
        """``config.cudagraph_policy``: kiln graphs for kiln graphs, PyTorch's
        CUDA graph trees for everything else."""

        def should_wrap(self, compiled_graph: Any) -> bool:
            if "kiln" not in getattr(compiled_graph, "device_types", ()):
                return super().should_wrap(compiled_graph)
            reason = _skip_reason(compiled_graph)
            if reason is not None:
                _skip(reason)
                if compiled_graph.fx_kwargs.get("is_backward") and compiled_graph.current_callable:
                    compiled_graph.current_callable = _notify_backward(compiled_graph.current_callable)
                return False  # Inductor then runs the graph as in the default mode
            _pending.graph = compiled_graph
            return True

        def cudagraphify(self, model, example_inputs, static_input_idxs, *, device_index,
                         is_backward, is_inference, **kwargs):
            compiled_graph, _pending.graph = _pending.graph, None
            if compiled_graph is None or "kiln" not in compiled_graph.device_types:
                return super().cudagraphify(model, example_inputs, static_input_idxs,
                                            device_index=device_index, is_backward=is_backward,
                                            is_inference=is_inference, **kwargs)
            return KilnGraphedFunction(
                model, static_input_idxs, device_index=device_index, is_backward=is_backward,
                is_inference=is_inference, stack_traces=kwargs.get("stack_traces"),
                constants=kwargs.get("constants", ()),
                mutated_input_idxs=kwargs.get("mutated_input_idxs", ()),
                placeholders=kwargs.get("placeholders", ()),
                inputs_to_check=getattr(compiled_graph, "inputs_to_check", ()))

    return KilnGraphPolicy


KilnGraphPolicy: Any = None  # the class, made by install() (it subclasses an Inductor class)


def _check_lowering(original: Callable) -> Callable:
    """Inductor's check_lowering_disable_cudagraph, answering for kiln graphs."""

    def check(device_node_mapping: dict) -> Optional[str]:
        from torch._inductor import config
        from torch._inductor.cudagraph_utils import format_default_skip_message
        from torch._inductor.utils import any_is_symbolic, get_first_incompatible_cudagraph_node
        from torch._inductor.virtualized import V

        devices = [d for d in device_node_mapping if d.type != "meta"]
        if not any(d.type == "kiln" for d in devices):
            return original(device_node_mapping)
        cpu = device_node_mapping.get(torch.device("cpu"))
        if cpu is not None:
            return format_default_skip_message(f"cpu device ({cpu.name})")
        if len(devices) > 1:
            return format_default_skip_message(
                f"multiple devices: {', '.join(repr(d) for d in devices)}")
        gm = V.graph.module
        # Stream ops may sit in a higher-order op's subgraph (control_deps).
        nodes = [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]
        for node in nodes:
            if node.op == "call_function" and getattr(node.target, "namespace", None) == "streams":
                if "synchronize" in str(node.target):
                    return (f"skipping cudagraphs due to a synchronization in the graph ({node.target}): "
                            "a kiln graph capture refuses it")
                # Other stream ops (side streams, events) are captured: side
                # streams join the capture (Note [Cross-stream capture]) once
                # the registry's current stream is the capture stream
                # (_current_stream_object).
        if config.graph_partition:
            # compile_fx skips these two checks when graph partitioning is on
            # (partitions split such ops out on CUDA); kiln graphs are not
            # partitioned, so they are made here.
            node = get_first_incompatible_cudagraph_node(gm)
            if node is not None:
                return f"disabling cudagraphs due to incompatible op {node.target}"
            if config.triton.cudagraph_skip_dynamic_graphs and any(
                    any_is_symbolic(n.meta.get("val")) for n in gm.graph.nodes
                    if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)):
                return ("graph with symbolic shapes inputs and "
                        "config.triton.cudagraph_skip_dynamic_graphs=True.")
        return None

    check._kiln_original = original  # type: ignore[attr-defined]
    return check


def install() -> None:
    """Installs the policy (unless one is set) and the lowering check. Idempotent."""
    global KilnGraphPolicy
    from torch._inductor import config, cudagraph_utils

    if KilnGraphPolicy is None:
        KilnGraphPolicy = _make_policy_class()
    if config.cudagraph_policy is None:
        config.cudagraph_policy = KilnGraphPolicy()
    if not hasattr(cudagraph_utils.check_lowering_disable_cudagraph, "_kiln_original"):
        cudagraph_utils.check_lowering_disable_cudagraph = _check_lowering(
            cudagraph_utils.check_lowering_disable_cudagraph)
