"""``--fix``: a unified diff that makes the audit's mechanical findings
portable. Files are never edited; the diff is written for the user to read
and apply (``cd ROOT && patch -p1 < fix.diff``, or ``git apply fix.diff``).

:func:`make_fix` reads each file with :mod:`ast` (the same
:class:`~torch_kiln.audit.static._Scanner` that produces the static
findings, so the fix and the report agree on every site) and turns each
finding it can rewrite into a minimal edit at the node's exact source
position (``ast`` columns are UTF-8 byte offsets; they are converted to
characters per line). What it rewrites, with ``device`` the accelerator
(Note [The device --fix adds]):

=====================================  ==============================================
``x.cuda()``, ``x.cuda(non_blocking=   ``x.to(device)``, ``x.to(device, non_blocking=
True)``, ``m.cuda(1)``                 True)``, ``m.to(torch.device(device.type, 1))``
``"cuda"``, ``"cuda:1"``,              ``device.type``, ``f"{device.type}:1"``,
``f"cuda:{rank}"``                     ``f"{device.type}:{rank}"``
``torch.cuda.amp.autocast(...)``       ``torch.autocast(device_type=device.type,
                                       dtype=torch.float16, ...)`` (CUDA's default
                                       dtype kept; positional arguments named)
``torch.cuda.amp.GradScaler(...)``     ``torch.amp.GradScaler(device.type, ...)``
``torch.cuda.amp.custom_fwd/bwd``      ``torch.amp.custom_fwd/bwd(device_type=...)``
``torch.cuda.synchronize`` and the     ``torch.accelerator.synchronize`` ...
renames of ``catalog.TORCH_CUDA_       (``manual_seed[_all]`` -> ``torch.manual_seed``)
RENAMES``
``"nccl"``                             ``torch.distributed.get_default_backend_for_
                                       device(device)``
=====================================  ==============================================

Everything else (``"cuda" in device`` branches, TF32 and cuDNN flags, CUDA
graphs, streams, NVTX, extensions, Triton, CUDA-only libraries, calls the
table cannot rewrite exactly) is not rewritten but listed, with its
file:line and the suggested replacement, in ``#`` comment lines at the top
of the diff (``patch`` and ``git apply`` skip text before the first file).

Files that are never patched: a file that does not parse (its static
findings come from tokens; the header says it was not patched), a file
outside the user's tree (``root``) or under ``site-packages``, and a file
whose rewritten text would not parse (a safety net: the header says so).

Note [The device --fix adds]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each patched file that needs it gets one definition after its leading
imports (with ``import torch`` if the file binds no ``torch`` there)::

    device = torch.accelerator.current_accelerator() or torch.device("cpu")

``current_accelerator()`` is CUDA on a CUDA machine, kiln with kiln, and
``None`` with no accelerator, hence the CPU fallback: the patched program
still runs on CUDA, runs on kiln, and runs on a CPU-only PyTorch. The name is
``device`` unless the file already binds ``device`` somewhere (a parameter,
a variable: it might hold a string), then ``accelerator`` or
``accelerator_device``. ``"cuda"`` strings become ``device.type`` (a
string, like the literal: ``argparse`` defaults, ``"cuda" in args.device``
and ``torch.device(...)`` keep working); ``.cuda()`` becomes
``.to(device)``. A branch such as ``"cuda" in args.device`` is not changed,
so with a ``--device`` default of ``device.type`` it is False on kiln and the
program takes its CPU path there: the header lists it first, as a decision.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import os
import re

from torch_kiln.audit import catalog
from torch_kiln.audit.findings import Finding
from torch_kiln.audit.static import _Imports, _Scanner, _is_third_party, read_source

__all__ = ["FixResult", "make_fix", "fix_source"]

_DEVICE_NAMES = ("device", "accelerator", "accelerator_device", "kiln_audit_device")
_CUDA_INDEX = re.compile(r"cuda:(\d+)")
_FSTRING_START = re.compile(r"([rRbBuU]?[fF][rR]?|[rR]?[fF])(\"\"\"|'''|\"|')cuda:")
_NEWLINE = re.compile(r"\r\n|\r|\n")
_PATCH_LINE = re.compile(r"[^\n]*\n|[^\n]+$")
# Why a category is never rewritten (the diff's header says it per item).
_NOT_REWRITTEN = {
    "cuda-branch": "a decision: after the patch this branch still tests for CUDA, so on kiln "
                   "or any other accelerator it takes its non-CUDA side",
    "cuda-setting": "kept: valid everywhere, and without effect off CUDA",
    "nvtx": "push/pop pairs become one `with` block: by hand",
    "cuda-graphs": "a decision: capture and replay have no drop-in portable form",
    "cuda-extension": "a kernel rewrite",
    "triton-kernel": "a kernel rewrite",
    "cuda-library": "a decision: another library's API",
}
# torch.cuda.amp.autocast(enabled, dtype, cache_enabled): the positional order.
_AUTOCAST_POSITIONAL = ("enabled", "dtype", "cache_enabled")


@dataclasses.dataclass
class FixResult:
    """What :func:`make_fix` produced.

    ``diff``: the unified diff with its ``#`` header (``""`` never: the header
    always says what was done). ``fixed``: findings rewritten.
    ``unfixed``: ``(finding, reason)`` not rewritten. ``skipped``: ``(path,
    reason)`` files not patched at all. ``files``: paths the diff changes.
    """

    diff: str
    fixed: list[Finding]
    unfixed: list[tuple[Finding, str]]
    skipped: list[tuple[str, str]]
    files: list[str]


@dataclasses.dataclass
class _Edit:
    start: int  # character offsets into the file's text
    end: int
    text: str


class _Source:
    """A file's text with ``ast`` positions converted to character offsets."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines: list[str] = []
        self.starts: list[int] = []
        offset = 0
        for match in _NEWLINE.finditer(text):
            self.starts.append(offset)
            self.lines.append(text[offset:match.end()])
            offset = match.end()
        if offset < len(text) or not text:
            self.starts.append(offset)
            self.lines.append(text[offset:])
        newlines = _NEWLINE.findall(text)
        self.newline = max(set(newlines), key=newlines.count) if newlines else "\n"

    def offset(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode("utf-8")[:col].decode("utf-8", "replace"))

    def start(self, node: ast.AST) -> int:
        return self.offset(node.lineno, node.col_offset)

    def end(self, node: ast.AST) -> int:
        return self.offset(node.end_lineno, node.end_col_offset)

    def segment(self, node: ast.AST) -> str:
        return self.text[self.start(node):self.end(node)]

    def span(self, node: ast.AST) -> tuple[int, int]:
        """``node``'s (start, end) offsets, checked against its own source
        (the text there must parse to the same tree): ``ast`` positions inside
        f-strings are unreliable before Python 3.12, and an edit at a wrong
        position could still parse. Raises _Unfixable on a mismatch."""
        text = self.segment(node)
        try:  # the text at the position must parse to the same tree
            ok = ast.dump(ast.parse(f"({text}\n)", mode="eval").body) == ast.dump(node)
        except SyntaxError:
            ok = False
        if not ok:
            raise _Unfixable("its source position is not exact (inside an f-string?)")
        return self.start(node), self.end(node)


def _bound_names(tree: ast.AST) -> set[str]:
    """Every name the file binds or reads (so an added name cannot clash)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            names.update(node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
    return names


class _Unfixable(Exception):
    """A site the fix leaves alone; the message says why (for the header)."""


class _Fixer:
    """Edits for one parsed file."""

    def __init__(self, source: _Source, tree: ast.Module, scanner: _Scanner) -> None:
        self.source = source
        self.tree = tree
        self.scanner = scanner
        names = _bound_names(tree)
        self.device = next(n for n in _DEVICE_NAMES if n not in names)
        self.insert_after, early_torch = self._leading_block()
        # The name edits use for torch: the one the leading imports bind, else
        # `torch`, imported by the prelude.
        self.torch = early_torch or "torch"
        self.import_torch = early_torch is None
        self.uses_device = False
        self.uses_torch = False

    def _leading_block(self) -> tuple[ast.stmt | None, str | None]:
        """The last statement of the module's docstring and leading imports
        (the definition goes after it), and the name those imports bind to
        ``torch`` (``None`` if they bind none)."""
        body = self.tree.body
        last = None
        index = 0
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            last, index = body[0], 1
        alias = None
        while index < len(body) and isinstance(body[index], (ast.Import, ast.ImportFrom)):
            stmt = body[index]
            if isinstance(stmt, ast.Import):
                for a in stmt.names:
                    if a.asname is None and a.name.split(".")[0] == "torch":
                        alias = "torch"  # `import torch` / `import torch.nn` bind `torch`
                    elif a.asname and a.name == "torch" and alias is None:
                        alias = a.asname
            last, index = stmt, index + 1
        return last, alias

    # --- names the edits use ---------------------------------------------------------------
    def dev(self) -> str:
        self.uses_device = True
        self.uses_torch = True  # the definition needs torch
        return self.device

    def t(self, rest: str) -> str:
        self.uses_torch = True
        return f"{self.torch}.{rest}"

    # --- helpers ---------------------------------------------------------------------------
    def open_paren(self, call: ast.Call) -> int:
        """Offset just after the ``(`` of ``call``."""
        text = self.source.text
        position = text.index("(", self.source.end(call.func))
        return position + 1

    def call_of(self, node: ast.AST) -> ast.Call | None:
        parent = self.scanner.parent(node)
        return parent if isinstance(parent, ast.Call) and parent.func is node else None

    # --- per category ----------------------------------------------------------------------
    def edits_for(self, finding: Finding, node: ast.AST) -> list[_Edit]:
        handler = {"dot-cuda": self.dot_cuda, "device-string": self.device_string,
                   "torch-cuda": self.torch_cuda, "cuda-amp": self.cuda_amp,
                   "nccl": self.nccl}.get(finding.category)
        if handler is None:
            reason = _NOT_REWRITTEN.get(finding.category, finding.effort)
            if finding.category == "cuda-branch":
                test = self.accelerator_test(node)
                if test:
                    reason += f"; for \"any accelerator\", write `{test}`"
            raise _Unfixable(reason)
        if finding.detail.get("from") == "tokens":
            raise _Unfixable("read from tokens")
        return handler(node)

    def accelerator_test(self, node: ast.AST) -> str | None:
        """For a branch on CUDA, the same test for "an accelerator" (the
        device is not the CPU), when its shape is a simple one: ``"cuda" in
        x``, ``x == "cuda"``, ``x != "cuda"``, ``x.startswith("cuda")``,
        ``x.is_cuda``; else None. A suggestion for the header, not an edit."""
        parent = self.scanner.parent(node)
        text = self.source.segment
        if isinstance(node, ast.Attribute) and node.attr == "is_cuda":
            return f'{text(node.value)}.device.type != "cpu"'
        if isinstance(parent, ast.Compare) and len(parent.ops) == 1:
            left, op, right = parent.left, parent.ops[0], parent.comparators[0]
            other = right if left is node else left
            if isinstance(op, ast.In) and left is node or isinstance(op, ast.Eq):
                return f'{text(other)} != "cpu"'
            if isinstance(op, ast.NotEq):
                return f'{text(other)} == "cpu"'
        if (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute)
                and parent.func.attr == "startswith" and parent.args == [node]):
            return f'{text(parent.func.value)} != "cpu"'
        return None

    def dot_cuda(self, call: ast.Call) -> list[_Edit]:
        func = call.func
        _, end = self.source.span(func)
        if self.source.text[end - 4:end] != "cuda":
            raise _Unfixable("the call is not written `.cuda(`")
        if any(isinstance(a, ast.Starred) for a in call.args) or any(
                k.arg is None for k in call.keywords):
            raise _Unfixable("*args/**kwargs: the target device is not known")
        edits = [_Edit(end - 4, end, "to")]
        device_kw = [k for k in call.keywords if k.arg == "device"]
        index = call.args[0] if call.args else (device_kw[0].value if device_kw else None)
        # A storage's .to takes the device by keyword only: in torch.load's
        # map_location=lambda storage, loc: storage.cuda(), .to(device) raised
        # TypeError (found by a fresh user), so there the device is named.
        name = "device=" if self._in_map_location(call) and not device_kw else ""
        if index is None or (isinstance(index, ast.Constant) and index.value is None):
            if index is not None:  # .cuda(None) / .cuda(device=None): the current device
                edits.append(_Edit(*self.source.span(index), name + self.dev()))
            else:
                rest = ", " if call.keywords else ""
                position = self.open_paren(call)
                edits.append(_Edit(position, position, name + self.dev() + rest))
            return edits
        if not (isinstance(index, ast.Constant) and isinstance(index.value, int)
                and not isinstance(index.value, bool)):
            raise _Unfixable("a device index that is not a literal integer: "
                             f"use torch.device({self.device}.type, index)")
        replacement = f"{name}{self.t('device')}({self.dev()}.type, {index.value})"
        edits.append(_Edit(*self.source.span(index), replacement))
        return edits

    def _in_map_location(self, node: ast.AST) -> bool:
        """Whether ``node`` is inside a lambda given as ``map_location=``."""
        parent = self.scanner.parent(node)
        while parent is not None:
            if isinstance(parent, ast.Lambda):
                holder = self.scanner.parent(parent)
                if isinstance(holder, ast.keyword) and holder.arg == "map_location":
                    return True
            node, parent = parent, self.scanner.parent(parent)
        return False

    def device_string(self, node: ast.AST) -> list[_Edit]:
        parent = self.scanner.parent(node)
        if isinstance(node, ast.JoinedStr):
            start = self.source.start(node)
            match = _FSTRING_START.match(self.source.text, start)
            if not match:
                raise _Unfixable('the f-string does not start with "cuda:"')
            position = match.end() - len("cuda:")
            return [_Edit(position, position + len("cuda"), "{" + self.dev() + ".type}")]
        if isinstance(parent, (ast.JoinedStr, ast.FormattedValue, ast.MatchValue)) or (
                isinstance(parent, ast.Expr)):
            raise _Unfixable("a string that is not an expression on its own")
        self._check_device_use(node, parent)
        value = node.value
        if value != "cuda" and not _CUDA_INDEX.fullmatch(value):
            raise _Unfixable("a device string completed by %, .format or +: write "
                             f'f"{{{self.device}.type}}:{{index}}"')
        index = _CUDA_INDEX.fullmatch(value)
        start, end = self.source.span(node)
        replacement = (f'f"{{{self.dev()}.type}}:{index.group(1)}"' if index
                       else f"{self.dev()}.type")
        if value == "cuda" and self._autocast_without_dtype(node, parent):
            # CUDA's autocast defaults to float16, the CPU's (and kiln's) to
            # bfloat16: the patched program would have run in another
            # precision (found by a fresh user); CUDA's default is kept.
            replacement += f", dtype={self.t('float16')}"
        return [_Edit(start, end, replacement)]

    def _autocast_without_dtype(self, node: ast.AST, parent: ast.AST | None) -> bool:
        """Whether ``node`` is the device type of a torch.autocast /
        torch.amp.autocast call that gives no dtype (and takes no *args or
        **kwargs)."""
        call = parent
        if isinstance(parent, ast.keyword):
            if parent.arg != "device_type":
                return False
            call = self.scanner.parent(parent)
        elif not (isinstance(parent, ast.Call) and parent.args[:1] == [node]):
            return False
        if not isinstance(call, ast.Call) or self.scanner.qualified(call.func) not in (
                "torch.autocast", "torch.amp.autocast", "torch.amp.autocast_mode.autocast"):
            return False
        return (len(call.args) <= 1 and not any(isinstance(a, ast.Starred) for a in call.args)
                and all(k.arg not in ("dtype", None) for k in call.keywords))

    @staticmethod
    def _check_device_use(node: ast.AST, parent: ast.AST | None) -> None:
        """Raises _Unfixable where the string is a name among names, not
        obviously a device: a dict key, an index, an attribute name, one
        string of a list of strings (["cuda", "mps"])."""
        if isinstance(parent, ast.Dict) and any(k is node for k in parent.keys):
            raise _Unfixable("a dict key: decide which device the mapping means")
        if isinstance(parent, ast.Subscript) and parent.slice is node:
            raise _Unfixable("an index: decide which device the lookup means")
        if (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name)
                and parent.func.id in ("hasattr", "getattr", "setattr", "delattr")):
            raise _Unfixable("an attribute name, not a device")
        if isinstance(parent, (ast.List, ast.Tuple, ast.Set)) and sum(
                isinstance(e, ast.Constant) and isinstance(e.value, str)
                for e in parent.elts) > 1:
            raise _Unfixable("one of a list of names: decide which device it means")

    def torch_cuda(self, node: ast.AST) -> list[_Edit]:
        name = self.scanner.qualified(node) or ""
        rest = name[len("torch.cuda."):]
        target = catalog.TORCH_CUDA_RENAMES.get(rest)
        if target is None:
            raise _Unfixable("no exact torch.accelerator equivalent")
        call = self.call_of(node)
        if call is not None and call.keywords:
            raise _Unfixable(f"torch.{target} takes positional arguments only")
        if not isinstance(getattr(node, "ctx", ast.Load()), ast.Load):
            raise _Unfixable("assigned to, not called")
        start, end = self.source.span(node)
        return [_Edit(start, end, self.t(target))]

    def cuda_amp(self, node: ast.AST) -> list[_Edit]:
        name = self.scanner.qualified(node) or ""
        rest = name[len("torch.cuda.amp."):] if name.startswith("torch.cuda.amp.") else ""
        call = self.call_of(node)
        start, end = self.source.span(node)
        if rest in ("custom_fwd", "custom_bwd"):
            if call is None:
                return [_Edit(start, end,
                              f"{self.t('amp.' + rest)}(device_type={self.dev()}.type)")]
            position = self.open_paren(call)
            more = ", " if call.args or call.keywords else ""
            return [_Edit(start, end, self.t("amp." + rest)),
                    _Edit(position, position, f"device_type={self.dev()}.type{more}")]
        if call is None or rest not in ("autocast", "GradScaler"):
            raise _Unfixable("not a call of torch.cuda.amp.autocast or GradScaler")
        if any(isinstance(a, ast.Starred) for a in call.args) or any(
                k.arg is None for k in call.keywords):
            raise _Unfixable("*args/**kwargs: the arguments cannot be renamed safely")
        position = self.open_paren(call)
        more = ", " if call.args or call.keywords else ""
        if rest == "GradScaler":
            return [_Edit(start, end, self.t("amp.GradScaler")),
                    _Edit(position, position, f"{self.dev()}.type{more}")]
        if len(call.args) > len(_AUTOCAST_POSITIONAL):
            raise _Unfixable("too many positional arguments for torch.cuda.amp.autocast")
        named = {k.arg for k in call.keywords} | set(_AUTOCAST_POSITIONAL[:len(call.args)])
        first = [f"device_type={self.dev()}.type"]
        if "dtype" not in named:  # torch.cuda.amp.autocast's default; kiln's may differ
            first.append(f"dtype={self.t('float16')}")
        edits = [_Edit(start, end, self.t("autocast")),
                 _Edit(position, position, ", ".join(first) + more)]
        for keyword, arg in zip(_AUTOCAST_POSITIONAL, call.args):
            position = self.source.span(arg)[0]
            edits.append(_Edit(position, position, keyword + "="))
        return edits

    def nccl(self, node: ast.AST) -> list[_Edit]:
        if not (isinstance(node, ast.Constant) and node.value == "nccl"):
            raise _Unfixable('a backend spec other than "nccl": name each device\'s backend')
        if self.scanner.in_comparison(node):
            raise _Unfixable("a test for NCCL: decide what the other backends do")
        self._check_device_use(node, self.scanner.parent(node))
        dist = [a.asname for stmt in self.tree.body if isinstance(stmt, ast.Import)
                for a in stmt.names if a.name == "torch.distributed" and a.asname] + [
                a.asname or a.name for stmt in self.tree.body if isinstance(stmt, ast.ImportFrom)
                and stmt.module == "torch" and not stmt.level for a in stmt.names
                if a.name == "distributed"]  # module-level bindings only
        function = (f"{dist[0]}.get_default_backend_for_device" if dist
                    else self.t("distributed.get_default_backend_for_device"))
        start, end = self.source.span(node)
        return [_Edit(start, end, f"{function}({self.dev()})")]

    # --- the definition ----------------------------------------------------------------------
    def prelude(self) -> _Edit | None:
        """The ``import torch`` / device definition, after the leading imports."""
        lines = []
        if self.uses_torch and self.import_torch:
            lines.append("import torch")
        if self.uses_device:
            lines.append(f"{self.device} = {self.torch}.accelerator.current_accelerator() or "
                         f'{self.torch}.device("cpu")  # kiln-audit --fix: CUDA, kiln, ... '
                         "or the CPU")
        if not lines:
            return None
        nl = self.source.newline
        if self.insert_after is None:
            position = self._after_leading_comments()
            return _Edit(position, position, nl.join(lines) + nl)
        line = self.insert_after.end_lineno
        if line < len(self.source.starts):
            position = self.source.starts[line]
            return _Edit(position, position, nl.join(lines) + nl)
        position = len(self.source.text)  # the imports end the file
        lead = "" if self.source.text.endswith(("\n", "\r")) else nl
        return _Edit(position, position, lead + nl.join(lines) + nl)

    def _after_leading_comments(self) -> int:
        position = 0
        for start, line in zip(self.source.starts, self.source.lines):
            if line.startswith("#"):
                position = start + len(line)
            else:
                break
        return position


def fix_source(text: str, file: str) -> tuple[str | None, list[Finding],
                                               list[tuple[Finding, str]], str]:
    """Rewrites one file's ``text``: returns ``(new_text, fixed, unfixed,
    skip_reason)``; ``new_text`` is ``None`` when the file is not patched
    (``skip_reason`` then says why: a syntax error, or a rewrite that would
    not parse)."""
    try:
        tree = ast.parse(text, filename=file)
    except SyntaxError as error:
        return None, [], [], (f"SyntaxError at line {error.lineno} ({error.msg}): a file that "
                              "does not parse cannot be rewritten safely; its findings were "
                              "read from its tokens")
    imports = _Imports()
    imports.visit(tree)
    scanner = _Scanner(file, text.splitlines(), imports.names)
    scanner.run(tree)
    source = _Source(text)
    fixer = _Fixer(source, tree, scanner)
    edits: list[_Edit] = []
    fixed: list[Finding] = []
    unfixed: list[tuple[Finding, str]] = []
    pending = []
    for finding, node in scanner.sites:
        try:
            pending.append((finding, fixer.edits_for(finding, node)))
        except (_Unfixable, ValueError) as why:
            unfixed.append((finding, str(why)))
    taken: list[tuple[int, int]] = []
    for finding, site_edits in pending:
        if any(a.start < e and s < a.end or (a.start == a.end == s == e)
               for a in site_edits for s, e in taken):
            unfixed.append((finding, "overlaps another rewrite"))
            continue
        taken.extend((a.start, a.end) for a in site_edits)
        edits.extend(site_edits)
        fixed.append(finding)
    prelude = fixer.prelude()
    if prelude is not None:
        edits.append(prelude)
    new = text
    # From the end back, so offsets stay valid; of two insertions at one
    # offset, the one made later in `edits` ends up after the other.
    for _, edit in sorted(enumerate(edits), key=lambda p: (p[1].start, p[1].end, p[0]),
                          reverse=True):
        new = new[:edit.start] + edit.text + new[edit.end:]
    try:
        ast.parse(new, filename=file)
    except SyntaxError as error:
        return None, [], [(f, "not patched") for f in fixed] + unfixed, (
            f"the rewritten file would not parse (SyntaxError at line {error.lineno}: "
            f"{error.msg}); this is a kiln-audit bug, please report it")
    return new, fixed, unfixed, ""


def _diff(old: str, new: str, name: str) -> list[str]:
    """A unified diff of two texts; a missing final newline is marked as
    ``diff`` marks it, so ``patch`` and ``git apply`` reproduce the bytes."""
    marker = "\x00"

    def lines(text: str) -> list[str]:
        # Lines as patch reads them: ended by "\n" only (str.splitlines would
        # also split at form feeds and other separators Python allows).
        result = _PATCH_LINE.findall(text)
        if result and not result[-1].endswith("\n"):
            result[-1] += marker + "\n"
        return result

    out = []
    for line in difflib.unified_diff(lines(old), lines(new), f"a/{name}", f"b/{name}"):
        if line.endswith(marker + "\n"):
            line = line[:-2] + "\n\\ No newline at end of file\n"
        out.append(line if line.endswith("\n") else line + "\n")
    return out


def _inside(path: str, root: str) -> bool:
    return path.startswith(root.rstrip(os.sep) + os.sep) and not _is_third_party(path)


def make_fix(files: list[str], root: str, findings: list[Finding] | None = None) -> FixResult:
    """The ``--fix`` diff for ``files`` (the audit's ``files_scanned``),
    with paths relative to ``root`` (``a/<path>``, ``b/<path>``: apply with
    ``patch -p1`` or ``git apply`` in ``root``). Files outside ``root`` or in
    ``site-packages`` are never patched. ``findings`` (the report's) adds the
    ones no file rewrite covers (run-time findings are not listed: they are
    in the report) to the header's list; only static findings are rewritten.
    """
    root = os.path.realpath(root)
    fixed: list[Finding] = []
    unfixed: list[tuple[Finding, str]] = []
    skipped: list[tuple[str, str]] = []
    body: list[str] = []
    changed: list[str] = []
    for path in files:
        real = os.path.realpath(path)
        if not real.endswith(".py"):
            continue
        if not _inside(real, root):
            skipped.append((real, f"outside the user's tree ({root}): never patched"))
            continue
        try:
            text, encoding = read_source(real, errors="strict")
        except (OSError, UnicodeDecodeError) as error:
            skipped.append((real, f"cannot be read: {error}"))
            continue
        if encoding != "utf-8":
            # The diff is UTF-8 without a BOM; patch would not find this file's lines.
            skipped.append((real, f"encoded as {encoding}, not plain UTF-8: not patched"))
            continue
        new, file_fixed, file_unfixed, reason = fix_source(text, real)
        fixed.extend(file_fixed)
        unfixed.extend(file_unfixed)
        if new is None:
            skipped.append((real, reason))
        elif new != text:
            body.extend(_diff(text, new, os.path.relpath(real, root).replace(os.sep, "/")))
            changed.append(real)
    covered = {(f.file, f.line, f.category) for f in fixed} | {
        (f.file, f.line, f.category) for f, _ in unfixed}
    for finding in findings or []:
        if finding.source == "static" and (finding.file, finding.line,
                                           finding.category) not in covered:
            unfixed.append((finding, "not rewritten by --fix"))
    header = _header(root, fixed, unfixed, skipped, changed) + _needs_accelerator(root, fixed)
    return FixResult(diff="".join(header) + "".join(body), fixed=fixed, unfixed=unfixed,
                     skipped=skipped, files=changed)


# torch.accelerator functions that answer without an accelerator; the other
# renames raise on a CPU-only PyTorch, as their torch.cuda originals do there.
_NO_ACCELERATOR_NEEDED = {"accelerator.is_available", "accelerator.device_count", "manual_seed"}


def _needs_accelerator(root: str, fixed: list[Finding]) -> list[str]:
    """Header lines naming the rewritten calls that raise when there is no
    accelerator (torch.accelerator.synchronize(), ...)."""
    sites = []
    for finding in fixed:
        target = catalog.TORCH_CUDA_RENAMES.get(finding.message.removeprefix("torch.cuda."))
        if finding.category == "torch-cuda" and target and target not in _NO_ACCELERATOR_NEEDED:
            sites.append(f"{_display(finding.file, root)}:{finding.line} torch.{target}")
    if not sites:
        return []
    return ["# rewritten, but raise without an accelerator, as the torch.cuda calls do without "
            "CUDA (guard them with torch.accelerator.is_available() to run on a CPU-only "
            "PyTorch too):\n"] + [f"#   {site}\n" for site in sites]


def _display(path: str | None, root: str) -> str:
    if not path:
        return "?"
    return os.path.relpath(path, root) if _inside(path, root) else path


def _header(root: str, fixed: list[Finding], unfixed: list[tuple[Finding, str]],
            skipped: list[tuple[str, str]], changed: list[str]) -> list[str]:
    out = [f"# kiln-audit --fix: {len(fixed)} finding(s) rewritten in {len(changed)} file(s) "
           "(mechanical rewrites; nothing was edited)\n",
           f"# apply in {root}: patch -p1 < THIS.diff (or git apply THIS.diff)\n"]
    # Branches first: they decide whether the patched program uses the accelerator.
    order = {"cuda-branch": 0}
    if unfixed:
        out.append(f"# not rewritten: {len(unfixed)} finding(s) that need a decision or more "
                   "work:\n")
        seen = set()
        for finding, reason in sorted(unfixed, key=lambda u: (order.get(u[0].category, 1),
                                                              u[0].file or "", u[0].line or 0)):
            key = (finding.file, finding.line, finding.category, finding.message)
            if key in seen:
                continue
            seen.add(key)
            where = _display(finding.file, root) + (f":{finding.line}" if finding.line else "")
            out.append(f"#   {where}: {finding.category} [{finding.effort}]: "
                       f"{finding.code or finding.message}\n")
            # A setting's message names its portable knob; other findings' replacement does.
            suggested = finding.message if finding.category == "cuda-setting" else \
                finding.replacement
            out.append(f"#       not rewritten: {reason}; suggested: {suggested}\n")
    for path, reason in skipped:
        out.append(f"# not patched: {_display(path, root)}: {reason}\n")
    if not fixed and not skipped and not unfixed:
        out.append("# nothing to rewrite: no mechanical findings\n")
    return out
