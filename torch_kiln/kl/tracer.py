"""Tracing a kl kernel: run the Python function on proxy tiles, record IR.

``trace(fn, name, params, tensor_specs, scalar_kinds, constexprs)`` calls the
kernel once with TensorArg proxies (dtype and rank known, sizes runtime),
scalar-argument tiles and the constexpr values; every language call records
an ir.Op (language.py checks each tile against the tile model first). A
``kl.range`` loop is traced by running its body once with a symbolic
induction variable (``_Range``); loop-carried tiles are found by comparing
the caller's local variables before and after the body. After tracing,
``scratch_peak`` computes the program's peak scratch use per partition
(live tiles' bytes) and raises KernelError at the op where it exceeds the
tile model's capacity.
"""

from __future__ import annotations

import os
import sys

import torch

from torch_kiln.kl import ir, tile_model
from torch_kiln.kl.errors import KernelError, error, state, user_location
from torch_kiln.kl.tile import TensorArg, Tile



def _affine_add(a, b, shape, sign="+"):
    base = f"({a[0]} {sign} {b[0]})"
    r = len(shape)
    ca = _align(a, shape)
    cb = _align(b, shape)
    coeffs = []
    for x, y in zip(ca, cb):
        if y == "0":
            coeffs.append(x)
        elif x == "0":
            coeffs.append(y if sign == "+" else f"(-{y})")
        else:
            coeffs.append(f"({x} {sign} {y})")
    assert len(coeffs) == r
    return base, tuple(coeffs)


def _align(aff, shape):
    """aff's coefficients right-aligned to ``shape`` (broadcast dims get 0)."""
    coeffs = aff[1]
    pad = len(shape) - len(coeffs)
    return ("0",) * pad + tuple(coeffs)


_KL_DIR = os.path.dirname(os.path.abspath(__file__))


class Tracer:
    def __init__(self, name: str):
        self.name = name
        self.blocks = [ir.Block()]
        self.scope: list[int] = []
        self.open_loops: list[_Range] = []  # kl.range loops whose body is being traced
        self._loop_ids = iter(range(1, 1 << 30))
        self._value_ids = iter(range(1 << 62))
        self.written: set[str] = set()
        self.deps: dict[int, set] = {}  # value id -> the Values its affine form reads

    # -------------------------------------------------------------- values
    def describe(self, tile: Tile) -> str:
        return f"Tile(shape={tile.shape}, dtype={tile_model.dtype_name(tile.dtype)}, traced)"

    def _value(self, tile: Tile, loc) -> ir.Value:
        v = tile.handle
        if tuple(v.scope) != tuple(self.scope[:len(v.scope)]):
            raise error(f"a tile of shape {v.shape} {tile_model.dtype_name(v.dtype)} made inside a "
                        "kl.range loop is used after the loop; make it a tile before the loop "
                        "(kl.zeros / kl.full; then it is loop-carried) or use it only inside",
                        loc)
        return v

    def new_value(self, shape, dtype) -> ir.Value:
        # ids count from 0 in each trace, so the same kernel lowers to the
        # same source (the disk cache's key) every time
        return ir.Value(tuple(shape), dtype, scope=tuple(self.scope), id=next(self._value_ids))

    def emit(self, kind, operands, result, attrs, loc):
        self.blocks[-1].ops.append(ir.Op(kind, result, operands, attrs, loc))

    def op(self, kind, operands, shape, dtype, attrs) -> Tile | None:
        loc = user_location()
        ops = []
        for o in operands:
            if isinstance(o, Tile):
                o = self._value(o, loc)
            elif isinstance(o, TensorArg):
                o = o.name
            ops.append(o)
        if kind == "store":
            self.written.add(ops[0])
            self.emit(kind, ops, None, dict(attrs, shape=shape), loc)
            return None
        result = self.new_value(shape, dtype)
        if kind == "expand_dims":
            base = ops[0]
            result.alias_of = base.alias_of or base
        result.affine = self._affine(kind, ops, result, attrs)
        self.emit(kind, ops, result, attrs, loc)
        return Tile(shape, dtype, result)

    def _affine(self, kind, ops, result, attrs):
        if result.dtype != torch.int64:
            return None
        if result.shape == ():
            self.deps[result.id] = {result}
            return (result.name, ())

        def aff(o):
            if isinstance(o, bool):
                return None
            if isinstance(o, int):
                return (str(o), ())
            if isinstance(o, ir.Value):
                return o.affine
            return None

        deps = set()
        for o in ops:
            if isinstance(o, ir.Value):
                # the operand itself too: a form built from a tile's form is
                # wrong once that tile is loop-carried (finalize drops both)
                deps |= self.deps.get(o.id, set()) | {o}
        if kind == "arange":
            out = (str(attrs["start"]), ("1",))
        elif kind in ("add", "sub") and all(aff(o) is not None for o in ops):
            a, b = aff(ops[0]), aff(ops[1])
            a = (a[0], _bcast(a, ops[0], result.shape))
            b = (b[0], _bcast(b, ops[1], result.shape))
            out = _affine_add(a, b, result.shape, "+" if kind == "add" else "-")
        elif kind == "mul" and all(aff(o) is not None for o in ops):
            a, b = ops
            if isinstance(b, int) or (isinstance(b, ir.Value) and b.shape == ()):
                tile, s = a, aff(b)[0]
            elif isinstance(a, int) or (isinstance(a, ir.Value) and a.shape == ()):
                tile, s = b, aff(a)[0]
            else:
                return None
            t = aff(tile)
            coeffs = _bcast(t, tile, result.shape)
            out = (f"({t[0]} * {s})",
                   tuple("0" if c == "0" else f"({c} * {s})" for c in coeffs))
        elif kind == "expand_dims" and ops[0].affine is not None:
            src = iter(ops[0].affine[1])
            out = (ops[0].affine[0], tuple("0" if d in attrs["inserted"] else next(src)
                                           for d in range(len(result.shape))))
        else:
            return None
        self.deps[result.id] = deps
        return out

    # --------------------------------------------------------------- loops
    def range(self, start, end, step):
        return _Range(self, start, end, step, user_location())


def _bcast(aff, operand, shape):
    """The coefficients of ``operand``'s affine form on ``shape``'s dims
    (right-aligned; a size-1 dim of the operand contributes 0)."""
    oshape = operand.shape if isinstance(operand, ir.Value) else ()
    coeffs = list(_align(aff, shape))
    pad = len(shape) - len(oshape)
    for d, size in enumerate(oshape):
        if size == 1:
            coeffs[pad + d] = "0"
    return tuple(coeffs)


class _Range:
    """Traces ``for i in kl.range(...)``: yields the induction variable once,
    records the body, then finds the loop-carried locals of the caller."""

    def __init__(self, tracer: Tracer, start, end, step, loc):
        self.tracer, self.start, self.end, self.step, self.loc = tracer, start, end, step, loc
        self.stage = 0

    def __iter__(self):
        return self

    def __next__(self):
        frame = sys._getframe(1)
        t = self.tracer
        if self.stage == 0:
            self.stage = 1
            self.before = {k: v for k, v in frame.f_locals.items() if isinstance(v, Tile)}
            self.before_values = {k: v.handle for k, v in self.before.items()}
            self.before_numbers = {k: v for k, v in frame.f_locals.items()
                                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
            self.loop_id = next(t._loop_ids)
            start = t._value(self.start, self.loc) if isinstance(self.start, Tile) else self.start
            end = t._value(self.end, self.loc) if isinstance(self.end, Tile) else self.end
            t.scope.append(self.loop_id)
            var = t.new_value((), torch.int64)
            var.affine = (var.name, ())
            t.deps[var.id] = {var}
            self.loop = ir.Loop(var, ir.Block())
            self.op = ir.Op("for", None, [start, end], {"loop": self.loop, "step": self.step},
                            self.loc)
            t.blocks.append(self.loop.body)
            t.open_loops.append(self)
            return Tile((), torch.int64, var)
        if self.stage == 1:
            self.stage = 2
            after = frame.f_locals
            carried = []  # (name, outer, the Tile the name holds at the end of the body)
            for name, outer in self.before_values.items():
                now = after.get(name)
                if isinstance(now, Tile) and now.handle is self.loop.var:
                    # The name holds this loop's variable (`last = k`, or the
                    # loop's own name reused): carried, so after the loop it
                    # holds the last trip's value (or its value before the
                    # loop if there was no trip), as in Python. A reused name
                    # of another shape or dtype, or one that held a tile
                    # made inside an earlier loop (its variable: `for k` in
                    # two loops), is left as it was.
                    usable = tuple(outer.scope) == tuple(t.scope[:len(outer.scope)])
                    if usable and now.shape == outer.shape and now.dtype == outer.dtype:
                        carried.append((name, outer, now))
                    continue
                if not isinstance(now, Tile):
                    if name in after:
                        raise error(f"'{name}' is a tile before the kl.range loop and "
                                    f"{type(now).__name__} {now!r} at the end of its body; a "
                                    f"loop-carried name must stay a tile (kl.full(shape, "
                                    f"value, dtype))", self.loc)
                    continue
                if now.handle is outer:
                    continue
                inner = now.handle
                if inner.shape != outer.shape or inner.dtype != outer.dtype:
                    raise error(f"loop-carried '{name}' is a tile of shape {outer.shape} "
                                f"{tile_model.dtype_name(outer.dtype)} before the kl.range loop "
                                f"and {inner.shape} {tile_model.dtype_name(inner.dtype)} at the "
                                "end of its body; it must keep shape and dtype (cast it)",
                                self.loc)
                t._value(now, self.loc)
                carried.append((name, outer, now))
            self._check_numbers(after)
            self._check_state_is_its_own(frame, after, carried)
            # Every carried name's value at the end of the body, read before
            # any Tile is pointed at its state below.
            inners = [now.handle for _, _, now in carried]
            outers = {outer.id for _, outer, _ in carried}
            for (name, outer, now), inner in zip(carried, inners):
                if inner is self.loop.var or (inner.alias_of or inner).id in outers:
                    # Note [kl loop-carried state]: the name ends the body
                    # holding another carried tile's state (a, b = b, a), which
                    # the copy-back below may overwrite first: copy it here.
                    inner = t.op("cast", [Tile(inner.shape, inner.dtype, inner)], outer.shape,
                                 outer.dtype, {}).handle
                self.loop.carried.append((outer, inner))
            for name, outer, now in carried:
                # After the loop the name holds the carried storage.
                now.handle = outer
            t.blocks.pop()
            t.scope.pop()
            t.open_loops.pop()
            t.blocks[-1].ops.append(self.op)
            raise StopIteration
        raise StopIteration

    def _check_numbers(self, after) -> None:
        """A name holding a Python number before the loop and a tile at the
        end of its body (``s = 0.0``, then ``s = s + kl.load(...)``) would be
        carried by Python's names in the simulator but is not a loop state:
        an error naming it."""
        for name, value in self.before_numbers.items():
            now = after.get(name)
            if isinstance(now, Tile) and now.handle is not self.loop.var:
                raise error(f"'{name}' is the Python number {value!r} before the kl.range loop "
                            f"and a tile at the end of its body; make it a tile before the "
                            f"loop to carry it ({name} = kl.full((), {value!r}, kl.float32), or "
                            f"kl.zeros(shape))", self.loc)

    def _check_state_is_its_own(self, frame, after, carried) -> None:
        """Note [kl loop-carried state]: a loop-carried name's tile before
        the loop becomes the loop's state, updated in place at the end of
        every iteration; the traced body reads that one value wherever the
        tile was read, and after the loop the Tile object the name holds is
        pointed at the state. The simulator runs Python's names, so any other
        name that shares one of those tiles would read another name's state
        in compiled code only (silently different results). Each such case
        raises kl.KernelError naming both names and the fix (a copy, ``* 1``):

        - two names hold the same tile when the loop starts, in this frame
          or a caller's (``a = b = kl.zeros(...)``; ``acc = t``; a helper
          function's loop over its argument);
        - a carried name ends the body holding the same tile as another name
          that held a tile before the loop (``a = b = a + 1``; ``a = c``);
        - a name ends the body holding a carried name's tile of the start of
          the iteration (``old = a; a = a + 1``): after the loop it would
          read the final state.

        The copy-back at the end of an iteration (lowering's op_for) writes
        the states one after another, so a name that ends the body holding
        another carried name's state (``a, b = b, a``; ``a, b = a + 1, a``)
        gets a copy of it made in the body, before any state is written."""
        names = {name for name, _, _ in carried}
        for name, outer, now in carried:
            # (other name, where it is: "" in this frame, else " (in <function>)")
            others = [(other, "") for other, value in self.before_values.items()
                      if other != name and value is outer]
            caller = frame.f_back
            while not others and caller is not None and caller.f_code is not trace.__code__:
                others = [(other, f" (in {caller.f_code.co_name})")
                          for other, value in caller.f_locals.items()
                          if isinstance(value, Tile) and value.handle is outer]
                caller = caller.f_back
            if others:
                other, where = others[0]
                raise error(f"'{name}' and '{other}'{where} hold the same tile when the kl.range "
                            f"loop starts, and the loop assigns '{name}' (a loop-carried "
                            f"tile): give '{name}' a tile of its own before the loop, for "
                            f"example {name} = kl.zeros(...) or {name} = {other} * 1", self.loc)
            # (a name made in the body may share it, m_i = m_new: after the
            # loop both read the final state, which is both names' value)
            sharing = [other for other, value in after.items()
                       if other != name and value is now and other in self.before]
            if sharing:
                raise error(f"'{name}' and '{sharing[0]}' hold the same tile at the end of the "
                            f"kl.range loop's body, and '{name}' is loop-carried: give it a "
                            f"tile of its own, for example {name} = {sharing[0]} * 1", self.loc)
        starts = {id(self.before[name]): name for name in names}
        for other, value in after.items():
            if other not in names and id(value) in starts and \
                    self.before.get(other) is not value:
                carried_name = starts[id(value)]
                raise error(f"'{other}' holds the value '{carried_name}' had at the start of "
                            f"an iteration of the kl.range loop, and the loop assigns "
                            f"'{carried_name}': after the loop '{other}' would read its final "
                            f"value; copy it ({other} = {carried_name} * 1)", self.loc)


def _user_frame(tb) -> tuple[str, int] | None:
    """(file, line) of the innermost frame of traceback ``tb`` outside
    torch_kiln/kl and torch (the user's kernel or a helper it calls)."""
    found = None
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    while tb is not None:
        filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if os.path.dirname(filename) != _KL_DIR and not filename.startswith(torch_dir + os.sep):
            found = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return found


def trace(fn, name, params, tensor_specs, scalar_kinds, constexprs) -> ir.Trace:
    """The ir.Trace of ``fn`` for one specialisation (see module docstring)."""
    tracer = Tracer(name)
    args = []
    previous = (state.backend, state.kernel)
    state.backend, state.kernel = tracer, name
    try:
        for p in params:
            if p.kind == "tensor":
                dtype, ndim = tensor_specs[p.name]
                sizes, strides = [], []
                for d in range(ndim):
                    for kind, out in (("size", sizes), ("stride", strides)):
                        v = tracer.new_value((), torch.int64)
                        v.affine = (v.name, ())
                        tracer.deps[v.id] = {v}
                        tracer.emit("tensor_" + kind, [p.name], v, {"dim": d}, ("<args>", 0))
                        out.append(Tile((), torch.int64, v))
                args.append(TensorArg(p.name, dtype, ndim, p.name, sizes, strides))
            elif p.kind == "scalar":
                dtype = torch.int64 if scalar_kinds[p.name] == "int" else torch.float32
                v = tracer.new_value((), dtype)
                if dtype == torch.int64:
                    v.affine = (v.name, ())
                    tracer.deps[v.id] = {v}
                tracer.emit("scalar_arg", [p.name], v, {}, ("<args>", 0))
                args.append(Tile((), dtype, v))
            else:
                args.append(constexprs[p.name])
        try:
            fn(*args)
        except KernelError:
            raise
        except Exception as e:
            # A Python error in the body (v ** 2, v[0] = 1, torch.exp(v), a
            # NameError): named like the language's own errors, at the user's
            # line, with the original chained.
            raise error(f"{type(e).__name__}: {e}", _user_frame(e.__traceback__)) from e
        if tracer.open_loops:
            # named at the loop's own line: the stack here is the launcher's
            raise error("a kl.range loop was left early (break or return inside it); kl.range "
                        "loops must run their body to the end (mask the rest of the work, or "
                        "give the loop the trip count it needs)", tracer.open_loops[-1].loc)
    finally:
        state.backend, state.kernel = previous
    result = ir.Trace(name, params, dict(tensor_specs), dict(scalar_kinds), dict(constexprs),
                      tracer.blocks[0], written=set(tracer.written))
    finalize(result, tracer.deps)
    previous_kernel = state.kernel
    state.kernel = name
    try:
        result.peak_scratch_bytes = scratch_peak(result)
    finally:
        state.kernel = previous_kernel
    return result


def finalize(trace: ir.Trace, deps) -> None:
    """Drops affine forms the lowering cannot compute in place: loop-carried
    values, and index tiles whose form reads a loop-carried scalar or was
    built from a loop-carried tile's form (its value changes after the tile
    was made: ``offs = offs + BK`` in the loop, ``offs[None, :]`` read)."""
    carried = set()
    for op in ir.walk(trace.block):
        if op.kind == "for":
            for outer, inner in op.attrs["loop"].carried:
                carried.add(outer.id)
                carried.add(inner.id)
    for op in ir.walk(trace.block):
        v = op.result
        if v is None or v.affine is None or v.shape == ():
            continue
        if v.id in carried or any(d.id in carried for d in deps.get(v.id, ())):
            v.affine = None
    for op in ir.walk(trace.block):
        v = op.result
        # an alias of a carried tile made before the loop would see the
        # loop's updates: give every alias of a carried tile its own copy.
        if v is not None and v.alias_of is not None and (
                v.alias_of.id in carried or v.id in carried):
            v.alias_of = None


def needs_storage(v: ir.Value) -> bool:
    """Whether a value has its own scratch buffer (tiles that are not index
    expressions computed in place nor aliases of another tile)."""
    return v.shape != () and v.affine is None and v.alias_of is None


def scratch_peak(trace: ir.Trace) -> int:
    """Peak scratch bytes per partition over the program (live tiles with
    storage), raising KernelError where it exceeds the tile model."""
    order: list[ir.Op] = []
    last_use: dict[int, int] = {}
    defined: dict[int, int] = {}
    values: dict[int, ir.Value] = {}

    def visit(block, loop_stack):
        for op in block.ops:
            pos = len(order)
            order.append(op)
            for o in op.operands:
                if isinstance(o, ir.Value):
                    base = o.alias_of or o
                    last_use[base.id] = pos
                    for start in loop_stack:  # used in a loop: live through the loop
                        if defined.get(base.id, -1) < start:
                            loop_stack[start].add(base.id)
            if op.result is not None and needs_storage(op.result):
                defined[op.result.id] = pos
                values[op.result.id] = op.result
                last_use.setdefault(op.result.id, pos)
            if op.kind == "for":
                loop = op.attrs["loop"]
                stack = dict(loop_stack)
                stack[pos] = set()
                visit(loop.body, stack)
                end = len(order) - 1
                for vid in stack[pos]:
                    last_use[vid] = max(last_use[vid], end)
                for outer, inner in loop.carried:
                    for v in (outer, inner):
                        b = v.alias_of or v
                        if b.id in last_use:
                            last_use[b.id] = max(last_use[b.id], end)
                for vid in stack[pos]:
                    for s in loop_stack:
                        loop_stack[s].add(vid)

    visit(trace.block, {})
    events = []
    for vid, v in values.items():
        size = tile_model.bytes_per_partition(v.shape, v.dtype)
        events.append((defined[vid], 0, size, v))
        events.append((last_use[vid] + 1, -1, -size, v))
    events.sort(key=lambda e: (e[0], e[1]))
    live, peak = 0, 0
    for pos, kind, size, v in events:
        live += size
        if live > tile_model.SCRATCH_BYTES_PER_PARTITION and kind == 0:
            op = order[pos]
            raise error(f"the program's tiles need {live} bytes of scratch per partition here "
                        f"(this tile: shape {v.shape} {tile_model.dtype_name(v.dtype)}, "
                        f"{size} bytes); the kiln tile model has "
                        f"{tile_model.SCRATCH_BYTES_PER_PARTITION} per partition "
                        "(torch.kiln.get_device_properties().tile_scratch_bytes_per_partition): "
                        "use smaller tiles or fewer live at once", op.loc)
        peak = max(peak, live)
    return peak
