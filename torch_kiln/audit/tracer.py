"""The run-time half of the audit: watch a program run on kiln and record,
at the user's own line, what ties it to CUDA or slows it there.

:class:`RunTracer` is a context manager around the program. While it is
active, a ``TorchFunctionMode`` sees every call into a torch function
(operators, ``Tensor`` methods, ``torch.device``) made outside torch itself,
and:

- **synchronizations**: compares kiln's count of sync ops
  (``torch.kiln.get_sync_ops()``: ``item()``, ``nonzero``, blocking copies to
  the host, printing, ...) before and after the call; a call that raised it
  is recorded with the sync op's ATen name and the user's line;
- **failures**: an operator that raised ``RuntimeError`` (which includes
  ``NotImplementedError``) is recorded with its error, then re-raised
  unchanged; the first time a site fails, the call is replayed on CPU
  copies of its inputs (:mod:`torch_kiln.audit.replay`) to tell
  "unsupported on kiln" from "fails on CPU too";
- **dtype changes**: a call that puts a float64 (or complex128) tensor on
  kiln from inputs that had none there ("float64 crept in": a NumPy array, a
  Python float list, ``.double()``; not PyTorch's own calls, such as
  GradScaler's float64 reciprocal), and an ``autocast`` region that PyTorch
  disabled because kiln's autocast does not support the dtype asked for
  (kiln's are float16, bfloat16 and float32);
- with ``map_cuda=True``, rewrites CUDA devices to kiln
  (Note [Mapping CUDA to kiln] in :mod:`torch_kiln.audit.mapping`).

On exit it reads Dynamo's graph-break reasons (with the user's line) and
recompilations (with the compiled function's first line).

Note [The audit under torch.compile]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Dynamo traces an active ``TorchFunctionMode``'s ``__torch_function__`` into
the graphs it builds. While tracing, the mode only applies the CUDA mapping
(plain Python Dynamo can trace) and calls the function; the sync and failure
bookkeeping (which calls into kiln's C++ counters, untraceable) runs only in
eager code. So compiled regions report the graph breaks and recompilations
the program has without the audit, and syncs inside compiled code are
counted in the run's totals (``unattributed_syncs``) but not by line.

"The user's line" is the innermost frame of the call stack whose file is
under ``root`` and not in ``site-packages``: a sync inside
``GradScaler.step`` is reported at the script's ``scaler.step(opt)``.
The mode costs a few microseconds per torch call; it is for audits, not
production runs.
"""

from __future__ import annotations

import functools
import linecache
import os
import re
import sys
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

# PyTorch's own Python code (its calls are not the program's).
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep

from torch_kiln.audit import catalog
from torch_kiln.audit.findings import Finding

__all__ = ["RunTracer"]

_AUDIT_DIR = os.path.dirname(os.path.realpath(__file__))
# Kiln counts the first run of an op on a new layout as a sync op named
# "aten::relu (layout check)": once per op and process, kiln's own work, not
# something the program can change, so it is not a finding (the run's
# sync_ops totals still show it).
_KILN_INTERNAL_SYNC = " (layout check)"
_COPY_OPS = {"aten::_copy_from", "aten::copy_", "aten::_to_copy"}
_RESUME = re.compile(r"torch_dynamo_resume_in_(.+)_at_\d+")


def _sync_ops() -> dict[str, int]:
    from torch_kiln import _C

    return _C._get_sync_ops()  # unsorted: cheaper than torch.kiln.get_sync_ops()


def _op_name(func: Callable) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    module = getattr(func, "__module__", None)
    if name.startswith("TensorBase."):
        name = "Tensor." + name[len("TensorBase."):]
    elif name.startswith("_VariableFunctionsClass."):  # torch.add and friends
        name = "torch." + name[len("_VariableFunctionsClass."):]
    elif module and module.startswith("torch") and "." not in name:
        name = f"{module}.{name}" if module != "torch._C._VariableFunctions" else f"torch.{name}"
    return name


_WIDE = (torch.float64, torch.complex128)


def _new_wide_dtype(result: Any, args: tuple, kwargs: dict) -> torch.dtype | None:
    """The float64/complex128 dtype of a kiln tensor ``result`` when no kiln
    tensor input had one (so the call brought it onto the device), else None."""
    outputs = result if isinstance(result, (tuple, list)) else (result,)
    wide = [t.dtype for t in outputs if isinstance(t, torch.Tensor) and t.dtype in _WIDE
            and t.device.type == "kiln"]
    if not wide:
        return None
    leaves, _ = tree_flatten((args, kwargs))
    if any(isinstance(t, torch.Tensor) and t.dtype in _WIDE and t.device.type == "kiln"
           for t in leaves):
        return None
    return wide[0]


class _Mode(TorchFunctionMode):
    def __init__(self, tracer: "RunTracer") -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        tracer = self.tracer
        kwargs = kwargs or {}
        if tracer.map_cuda:
            func, args, kwargs = tracer._map_call(func, args, kwargs)
        if torch.compiler.is_compiling():
            # Dynamo traces this method into the user's graph: give it nothing
            # it cannot trace, or the audit would add graph breaks of its own.
            # See Note [The audit under torch.compile].
            return func(*args, **kwargs)
        before = tracer._sync_ops()
        try:
            result = func(*args, **kwargs)
        except RuntimeError as error:
            tracer._record_failure(func, error, args, kwargs)
            raise
        after = tracer._sync_ops()
        if after != before:
            tracer._record_sync(func, before, after)
        wide = _new_wide_dtype(result, args, kwargs)
        if wide is not None:
            tracer._record_wide(func, wide)
        return result


class RunTracer:
    """Records run-time findings for code run inside ``with RunTracer(...)``.

    ``root``: directory whose files count as the user's code (lines are
    reported there). ``map_cuda``: also map CUDA to kiln for the run
    (:class:`torch_kiln.audit.mapping.CudaMapping`). ``on_event``: called with
    a JSON-able dict the first time each site is seen (the audit's child
    process streams these to its parent so that a run killed by a timeout
    still reports). Raises ``RuntimeError`` on entry if kiln is unavailable.
    """

    def __init__(self, root: str, map_cuda: bool = False,
                 on_event: Callable[[dict], None] | None = None) -> None:
        self.root = os.path.realpath(root)
        self.map_cuda = map_cuda
        self.on_event = on_event
        self._sites: dict[tuple, dict[str, Any]] = {}
        self._user_file: dict[str, bool] = {}
        self._mode: _Mode | None = None
        self._mapping = None
        self._map_call = None
        self._kiln_syncs_at_start = 0
        self._replay_syncs = 0  # kiln syncs of the CPU replays' copies
        self._autocast_init = None

    # --- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "RunTracer":
        if not hasattr(torch, "kiln"):
            raise RuntimeError("the audit's run-time tracing needs the kiln device; "
                               "torch.kiln is missing (is torch_kiln installed?)")
        if self.map_cuda:
            from torch_kiln.audit.mapping import CudaMapping, map_call

            self._mapping = CudaMapping().__enter__()
            self._map_call = map_call
        self._kiln_syncs_at_start = sum(n for op, n in _sync_ops().items()
                                        if not op.endswith(_KILN_INTERNAL_SYNC))
        self._watch_autocast()
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def _watch_autocast(self) -> None:
        """Wraps ``torch.amp.autocast.__init__`` (after ``--map-cuda``'s own
        wrapper) to record regions PyTorch disables for an unsupported dtype."""
        init = torch.amp.autocast.__init__
        tracer = self

        @functools.wraps(init)
        def autocast_init(self_, *args, **kwargs):
            init(self_, *args, **kwargs)
            enabled = kwargs.get("enabled", args[2] if len(args) > 2 else True)
            if enabled and not self_._enabled and getattr(self_, "device", None) == "kiln":
                tracer._record_autocast(self_.fast_dtype)

        self._autocast_init = init
        torch.amp.autocast.__init__ = autocast_init

    def __exit__(self, *exc_info) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc_info)
                self._mode = None
            if self._autocast_init is not None:
                torch.amp.autocast.__init__ = self._autocast_init
                self._autocast_init = None
        finally:
            if self._mapping is not None:
                self._mapping.__exit__(*exc_info)
                self._mapping = None

    # --- recording -------------------------------------------------------------------------
    _sync_ops = staticmethod(_sync_ops)

    def _is_user_file(self, filename: str) -> bool:
        known = self._user_file.get(filename)
        if known is None:
            path = os.path.realpath(filename) if not filename.startswith("<") else ""
            parts = set(path.split(os.sep))
            known = (path.startswith(self.root + os.sep) and not path.startswith(_AUDIT_DIR)
                     and not parts & {"site-packages", "dist-packages"})
            self._user_file[filename] = known
        return known

    def user_site(self, frame=None) -> tuple[str | None, int | None]:
        """``(file, line)`` of the innermost user frame above ``frame``
        (default: the caller), or ``(None, None)``."""
        frame = frame or sys._getframe(1)
        while frame is not None:
            if self._is_user_file(frame.f_code.co_filename):
                return os.path.realpath(frame.f_code.co_filename), frame.f_lineno
            frame = frame.f_back
        return None, None

    def _site(self, kind: str, file, line, key: str, **fields) -> None:
        site = self._sites.get((kind, file, line, key))
        if site is not None:
            site["count"] += 1
            return
        site = {"kind": kind, "file": file, "line": line, "key": key, "count": 1, **fields}
        self._sites[(kind, file, line, key)] = site
        if self.on_event is not None:
            self.on_event(dict(site))

    def _record_sync(self, func: Callable, before: dict, after: dict) -> None:
        file, line = self.user_site(sys._getframe(2))
        aten = sorted(op for op, n in after.items() if n != before.get(op, 0))
        if all(op.endswith(_KILN_INTERNAL_SYNC) for op in aten):
            return  # kiln's own one-time check, not the program's doing
        self._site("sync", file, line, _op_name(func), op=_op_name(func), aten=aten)

    def _record_failure(self, func: Callable, error: BaseException, args: tuple = (),
                        kwargs: dict | None = None) -> None:
        file, line = self.user_site(sys._getframe(2))
        name = _op_name(func)
        if ("op-failure", file, line, name) in self._sites:
            self._site("op-failure", file, line, name)  # counted; replayed the first time
            return
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        from torch_kiln.audit.replay import replay_on_cpu

        before = sum(self._sync_ops().values())
        outcome, cpu_error = replay_on_cpu(func, args, kwargs or {}, error)
        self._replay_syncs += sum(self._sync_ops().values()) - before
        self._site("op-failure", file, line, name, op=name,
                   error=f"{type(error).__name__}: {first}"[:300], cpu_replay=outcome,
                   cpu_error=cpu_error)

    def _record_wide(self, func: Callable, dtype: torch.dtype) -> None:
        caller = sys._getframe(2)
        if caller.f_code.co_filename.startswith(_TORCH_DIR):
            # PyTorch's own wide arithmetic (GradScaler keeps its scale's
            # reciprocal in float64): not the program's data.
            return
        file, line = self.user_site(caller)
        name = _op_name(func)
        dtype_name = str(dtype).replace("torch.", "")
        self._site("dtype-change", file, line, f"{name} {dtype_name}", op=name,
                   dtype=dtype_name, on_kiln="works",
                   message=f"{name} put a {dtype_name} tensor on the device from inputs that "
                           f"had no {dtype_name} there ({dtype_name} crept in: a NumPy array, "
                           "a list of Python floats, .double()?)",
                   replacement=f"ask for float32 where the data enters (torch.from_numpy(a)"
                               ".float(), dtype=torch.float32): the same "
                               f"{dtype_name} runs on CUDA, at a fraction of float32's speed "
                               f"on most GPUs, and some accelerators have no {dtype_name} (MPS)")

    def _record_autocast(self, dtype: torch.dtype) -> None:
        file, line = self.user_site(sys._getframe(2))
        dtype_name = str(dtype).replace("torch.", "")
        supported = ", ".join(str(d).replace("torch.", "")
                              for d in torch.kiln.get_amp_supported_dtype())
        self._site("dtype-change", file, line, f"autocast {dtype_name}", op="torch.autocast",
                   dtype=dtype_name, on_kiln="silently different",
                   message=f"autocast(dtype={dtype_name}) was disabled on kiln: kiln's autocast "
                           f"supports {supported}; the region ran in the inputs' own dtypes",
                   replacement=f"ask autocast for one of {supported} "
                               "(torch.autocast(device_type=device.type, dtype=torch.bfloat16))")

    def record_event(self, event: dict) -> None:
        """Adds an event produced elsewhere (the run's own failure)."""
        self._site(event.pop("kind"), event.pop("file", None), event.pop("line", None),
                   event.pop("key", ""), **event)

    # --- results ---------------------------------------------------------------------------
    def compile_events(self) -> list[dict]:
        """Graph breaks (at the user's line) and recompilations (at the
        recompiled function's first line) from Dynamo's own records."""
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is None:
            return []
        events: dict[tuple, dict] = {}
        for reason in list(getattr(utils, "graph_break_reasons", [])):
            file = line = None
            for frame in reversed(list(getattr(reason, "user_stack", []) or [])):
                if self._is_user_file(frame.filename):
                    file, line = os.path.realpath(frame.filename), frame.lineno
                    break
            text = str(getattr(reason, "reason", reason)).strip()
            first = text.splitlines()[0] if text else "unknown"
            key = ("graph-break", file, line, first)
            if key in events:
                events[key]["count"] += 1
            else:
                events[key] = {"kind": "graph-break", "file": file, "line": line, "key": first,
                               "count": 1, "reason": text[:1000]}
        from torch_kiln.compiler.metrics import _FIRST_COMPILE

        # Dynamo compiles the code after a graph break as a function of its own,
        # torch_dynamo_resume_in_<name>_at_<line>; its recompilations are
        # reported with the function it resumes (same file, same name).
        functions = {(c.co_filename, c.co_name): c for c in utils.guard_failures
                     if hasattr(c, "co_name")}
        recompiled: dict[object, list[str]] = {}
        for code, failures in list(utils.guard_failures.items()):
            reasons = [_FIRST_COMPILE.sub("", str(f), count=1) for f in failures
                       if _FIRST_COMPILE.match(str(f))]
            if not reasons:
                continue
            resumed = _RESUME.fullmatch(getattr(code, "co_name", ""))
            owner = functions.get((code.co_filename, resumed.group(1))) if resumed else None
            recompiled.setdefault(owner or code, []).extend(reasons)
        for code, reasons in recompiled.items():
            filename = getattr(code, "co_filename", "")
            user = self._is_user_file(filename)
            file = os.path.realpath(filename) if user else None
            line = getattr(code, "co_firstlineno", None) if user else None
            name = getattr(code, "co_name", "?")
            events[("recompilation", file, line, name)] = {
                "kind": "recompilation", "file": file, "line": line, "key": name,
                "count": len(reasons), "reasons": reasons[:10]}
        return list(events.values())

    def events(self) -> list[dict]:
        """Every site recorded so far, plus the compile events."""
        return [dict(s) for s in self._sites.values()] + self.compile_events()

    def unattributed_syncs(self) -> int:
        """Sync ops kiln counted during the run that no traced call caused
        (e.g. inside compiled code or at exit), layout checks excluded."""
        # A traced call counts once even if it synchronized twice: a lower bound.
        traced = sum(s["count"] for s in self._sites.values() if s["kind"] == "sync")
        total = sum(n for op, n in _sync_ops().items() if not op.endswith(_KILN_INTERNAL_SYNC))
        return max(0, total - self._kiln_syncs_at_start - traced - self._replay_syncs)


def _replay_note(event: dict) -> str:
    """What replaying the failed call on the CPU showed (torch_kiln.audit.replay)."""
    outcome = event.get("cpu_replay")
    if outcome == "unsupported on kiln":
        return "; unsupported on kiln: the same call runs on the CPU"
    if outcome == "fails on CPU too":
        return f"; fails on CPU too ({event.get('cpu_error', '')}): not a kiln gap"
    if outcome:
        return f"; not replayed on the CPU: {event.get('cpu_error', '')}"
    return ""


def events_to_findings(events: list[dict]) -> list[Finding]:
    """Run-time events (from :meth:`RunTracer.events` or the child process)
    as findings, one per site."""
    findings = []
    for event in events:
        kind = event["kind"]
        cat = catalog.category(kind)
        count = int(event.get("count", 1))
        detail = {k: v for k, v in event.items() if k not in (
            "kind", "file", "line", "key", "count", "code", "message", "replacement", "on_kiln")}
        if kind == "sync":
            aten = ", ".join(event.get("aten", []))
            message = (f"{event['op']} forced the host to wait for the device"
                       + (f" ({aten})" if aten else ""))
        elif kind == "op-failure":
            message = f"{event['op']} failed: {event['error']}" + _replay_note(event)
        elif kind == "graph-break":
            message = f"graph break: {event['key']}"
        elif kind == "recompilation":
            message = (f"{event['key']}() recompiled ({count} guard failure(s)): "
                       f"{'; '.join(event.get('reasons', [])[:3])}")
        else:  # run-failure, dtype-change
            message = event.get("message", event["key"])
        file, line = event.get("file"), event.get("line")
        code = linecache.getline(file, line).strip() if file and line else ""
        replacement = event.get("replacement", cat.replacement)
        if kind == "op-failure" and event.get("cpu_replay") == "fails on CPU too":
            replacement = ("the program's own error (the CPU raises it too, and so would "
                           "CUDA): fix the call")
        elif kind == "op-failure" and event.get("cpu_replay") == "unsupported on kiln":
            replacement = ("a kiln gap (the CPU runs this call): report it; until then run "
                           "this op on the CPU (x.cpu()) and move the result back")
        if kind == "sync" and any(op in _COPY_OPS for op in event.get("aten", [])):
            replacement = ("a blocking copy between host and device: copy once before the loop, "
                           "or from pinned memory (pin_memory()) with non_blocking=True")
        findings.append(Finding(category=kind, file=file, line=line,
                                message=message, replacement=replacement, severity=cat.severity,
                                on_kiln=event.get("on_kiln", cat.on_kiln),
                                effort=cat.effort, source="runtime", code=code,
                                count=count, detail=detail))
    return findings
