"""The static half of the audit: read the program's source with :mod:`ast`
and report every construct that ties it to CUDA.

:func:`scan_program` reads the script and, following its ``import``
statements, every module it imports from the user's own tree (the script's
directory and below; never ``site-packages``). :func:`scan_source` reads one
file. Names are resolved through the file's imports, so ``import torch as
th; th.cuda.synchronize()`` and ``from torch.cuda.amp import autocast;
autocast()`` are both ``torch.cuda`` calls, and a method merely named like a
CUDA API is not.

A file that does not parse yields a ``syntax-error`` finding; its tokens are
then read (:mod:`tokenize`, Python's own lexer) for the lock-ins that need no
syntax tree: ``"cuda"``/``"nccl"`` strings, ``.cuda(`` calls and
``torch.cuda.`` references, marked ``detail["from"] == "tokens"``.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from typing import Iterable

from torch_kiln.audit import catalog
from torch_kiln.audit.findings import Finding

__all__ = ["scan_program", "scan_source", "scan_file"]

# Applied to the *value* of a string literal, never to source text.
_CUDA_DEVICE = re.compile(r"cuda(:\d+)?")
# The start of a device string completed by %, .format or +: "cuda:%d",
# "cuda:{}", "cuda:{rank}", "cuda:".
_CUDA_DEVICE_TEMPLATE = re.compile(r"cuda:(%[-#0 +]*\d*[sdir]|\{[^{}]*\})?")
# A process-group backend spec: "nccl", "cpu:gloo,cuda:nccl".
_BACKEND_SPEC = re.compile(r"[a-z]+(:[a-z]+)?(,[a-z]+(:[a-z]+)?)*")
_CUDA_SOURCE_SUFFIXES = (".cu", ".cuh")

_EXTENSION_BUILDERS = {"torch.utils.cpp_extension.load_inline", "torch.utils.cpp_extension.load"}
_CUDA_EXTENSION_TYPES = {"torch.utils.cpp_extension.CUDAExtension"}
_TRITON_DECORATORS = {"triton.jit", "triton.autotune", "triton.heuristics"}


def _is_nccl(value: str) -> bool:
    """A backend spec naming NCCL ("nccl", "cpu:gloo,cuda:nccl"), not prose."""
    return bool(_BACKEND_SPEC.fullmatch(value)) and "nccl" in re.split(r"[:,]", value)


def _is_cuda_source_name(value: str) -> bool:
    """A file name ending in .cu/.cuh (no whitespace: not prose)."""
    return value.endswith(_CUDA_SOURCE_SUFFIXES) and len(value) > 3 and not any(
        c.isspace() for c in value)


def _finding(category: str, file: str, line: int | None, message: str, code: str = "",
             replacement: str | None = None, on_kiln: str | None = None,
             effort: str | None = None, severity: str | None = None, **detail) -> Finding:
    cat = catalog.category(category)
    return Finding(category=category, file=file, line=line, message=message,
                   replacement=replacement or cat.replacement, severity=severity or cat.severity,
                   on_kiln=on_kiln or cat.on_kiln, effort=effort or cat.effort, source="static",
                   code=code, detail=detail)


class _Imports(ast.NodeVisitor):
    """Local name -> dotted name it stands for, from every import in a file
    (flow-insensitive: an import in any scope counts for the whole file)."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.names[alias.asname] = alias.name
            else:  # `import torch.cuda` binds `torch`
                top = alias.name.split(".")[0]
                self.names[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module:
            return
        for alias in node.names:
            if alias.name != "*":
                self.names[alias.asname or alias.name] = f"{node.module}.{alias.name}"


class _Scanner(ast.NodeVisitor):
    """One pass over one module's tree; findings accumulate in ``found``."""

    def __init__(self, file: str, lines: list[str], imports: dict[str, str]) -> None:
        self.file = file
        self.lines = lines
        self.imports = imports
        self.found: list[Finding] = []
        # (finding, the node it was found at), for --fix (torch_kiln/audit/fix.py).
        self.sites: list[tuple[Finding, ast.AST]] = []
        self.parents: dict[int, ast.AST] = {}
        self.covered: set[int] = set()  # nodes inside an already-reported extension build

    # --- helpers ---------------------------------------------------------------------------
    def code(self, node: ast.AST) -> str:
        line = getattr(node, "lineno", None)
        return self.lines[line - 1].strip() if line and line <= len(self.lines) else ""

    def add(self, category: str, node: ast.AST, message: str, **kwargs) -> None:
        finding = _finding(category, self.file, getattr(node, "lineno", None), message,
                           self.code(node), **kwargs)
        self.found.append(finding)
        self.sites.append((finding, node))

    def qualified(self, node: ast.AST) -> str | None:
        """The dotted name an expression stands for, through the imports."""
        if isinstance(node, ast.Name):
            return self.imports.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.qualified(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def parent(self, node: ast.AST) -> ast.AST | None:
        return self.parents.get(id(node))

    def is_outermost_name(self, node: ast.AST) -> bool:
        """True unless ``node`` is the object of a longer dotted name."""
        parent = self.parent(node)
        return not (isinstance(parent, ast.Attribute) and parent.value is node)

    def in_comparison(self, node: ast.AST) -> bool:
        """Whether a literal is compared against (``==``, ``in``, ``startswith``),
        possibly inside a tuple/list/set: then it selects a branch."""
        parent = self.parent(node)
        while isinstance(parent, (ast.Tuple, ast.List, ast.Set)):
            node, parent = parent, self.parent(parent)
        if isinstance(parent, ast.Compare):
            return True
        if (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute)
                and parent.func.attr in ("startswith", "endswith") and node in parent.args):
            return True
        return False

    def run(self, tree: ast.AST) -> list[Finding]:
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[id(child)] = node
        self.visit(tree)
        return self.found

    # --- rules -----------------------------------------------------------------------------
    def visit_Constant(self, node: ast.Constant) -> None:
        if not isinstance(node.value, str) or id(node) in self.covered:
            return
        value = node.value
        if _CUDA_DEVICE.fullmatch(value):
            if self.in_comparison(node):
                self.add("cuda-branch", node, f"compares a device with {value!r}: on kiln the "
                         "CUDA side of this branch is not taken")
            else:
                self.add("device-string", node, f"hard-coded device {value!r}")
        elif _CUDA_DEVICE_TEMPLATE.fullmatch(value) and self._is_template_of_a_string(node):
            # "cuda:%d" % rank, "cuda:{}".format(rank), "cuda:" + str(rank)
            self.add("device-string", node, f"hard-coded device built from {value!r}",
                     replacement="f\"{device.type}:{index}\" or torch.device(device.type, index)")
        elif _is_nccl(value):
            self.add("nccl", node, f"process-group backend {value!r}: NCCL exists only on CUDA")
        elif value in catalog.CUDA_ENVIRONMENT:
            self.add("cuda-setting", node, f"environment variable {value}: "
                     f"{catalog.CUDA_ENVIRONMENT[value]}")
        elif _is_cuda_source_name(value):
            self.add("cuda-extension", node, f"names CUDA source {value!r}")

    def _is_template_of_a_string(self, node: ast.Constant) -> bool:
        """Whether the string is formatted or extended into another string:
        the left operand of ``%`` or ``+``, or the object of ``.format``."""
        parent = self.parent(node)
        if isinstance(parent, ast.BinOp) and parent.left is node:
            return isinstance(parent.op, (ast.Mod, ast.Add))
        return isinstance(parent, ast.Attribute) and parent.attr == "format"

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        first = node.values[0] if node.values else None
        if (isinstance(first, ast.Constant) and isinstance(first.value, str)
                and first.value.startswith("cuda:") and len(node.values) > 1):
            self.add("device-string", node, 'hard-coded device f"cuda:{...}"',
                     replacement="f\"{device.type}:{index}\" or torch.device(device.type, index)")
            return  # the literal parts are not separate findings
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr == "is_cuda" and self.qualified(node) is None:
            self.add("cuda-branch", node, "tests Tensor.is_cuda: False on kiln",
                     replacement="x.device.type == device.type (or != \"cpu\")")
        if self.is_outermost_name(node):
            self.check_name(node)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if self.is_outermost_name(node) and node.id in self.imports:
            self.check_name(node)

    def check_name(self, node: ast.AST) -> None:
        name = self.qualified(node)
        if not name:
            return
        if name.startswith("torch.cuda."):
            self.torch_cuda(node, name)
        elif name == "torch.version.cuda":
            self.add("cuda-branch", node, "reads torch.version.cuda: None on kiln (a CPU build "
                     "of PyTorch), so a branch on it takes its non-CUDA side")
        elif name in ("torch.backends.cuda.is_built", "torch.backends.cudnn.is_available",
                      "torch.backends.cudnn.version"):
            self.add("cuda-branch", node, f"{name}(): False or None on kiln (a query, not a "
                     "setting), so a branch on it takes its non-CUDA side")
        elif name in catalog.CUDA_SETTINGS:
            self.add("cuda-setting", node, f"{name}: {catalog.CUDA_SETTINGS[name]}")
        elif name.startswith(("torch.backends.cudnn.", "torch.backends.cuda.")):
            self.add("cuda-setting", node, f"{name}: a CUDA backend setting; no effect off CUDA")

    def torch_cuda(self, node: ast.AST, name: str) -> None:
        rest = name[len("torch.cuda."):]
        parts = rest.split(".")
        api = None
        for end in range(len(parts), 0, -1):  # longest known prefix: amp.autocast, then amp
            api = catalog.TORCH_CUDA_API.get(".".join(parts[:end]))
            if api:
                break
        if api is None:
            self.add("torch-cuda", node, f"{name}: no torch.accelerator equivalent is known",
                     replacement=f"torch.get_device_module(device).{rest} where the device "
                     "module has it (torch.kiln mirrors torch.cuda)", effort="needs a decision")
            return
        self.add(api.category, node, f"{name}", replacement=api.replacement,
                 on_kiln=api.on_kiln, effort=api.effort, severity=api.severity)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = self.qualified(func)
        if isinstance(func, ast.Attribute) and func.attr == "cuda" and name is None:
            self.add("dot-cuda", node, ".cuda() moves to a CUDA device")
        if name in _EXTENSION_BUILDERS:
            keywords = {k.arg for k in node.keywords}
            sources = [a for a in ast.walk(node) if isinstance(a, ast.Constant)
                       and isinstance(a.value, str) and _is_cuda_source_name(a.value)]
            if "cuda_sources" in keywords or sources:
                self.add("cuda-extension", node, f"{name.rsplit('.', 1)[1]}() builds a CUDA "
                         "extension")
                self.covered.update(id(a) for a in sources)
        elif name in _CUDA_EXTENSION_TYPES:
            self.add("cuda-extension", node, "CUDAExtension builds CUDA kernels")
            self.covered.update(id(a) for a in ast.walk(node))
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        for decorator in node.decorator_list:
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            if self.qualified(target) in _TRITON_DECORATORS:
                self.add("triton-kernel", decorator, f"Triton kernel {node.name}()",
                         kernel=node.name)
                break
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.check_import(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module:
            return
        if not self.check_import(node, node.module):
            for alias in node.names:
                if self.check_import(node, f"{node.module}.{alias.name}"):
                    break

    def check_import(self, node: ast.AST, module: str) -> bool:
        parts = module.split(".")
        for end in range(len(parts), 0, -1):
            key = ".".join(parts[:end])
            if key in catalog.CUDA_ONLY_PACKAGES:
                self.add("cuda-library", node, f"imports {module}, which needs CUDA",
                         replacement=catalog.CUDA_ONLY_PACKAGES[key], package=key)
                return True
        if parts[0] == "nvtx":
            self.add("nvtx", node, "imports nvtx (NVIDIA Tools Extension)")
            return True
        return False


def _token_fallback(file: str, text: str, lines: list[str]) -> list[Finding]:
    """Lock-ins recognisable from tokens alone, for a file that does not parse."""
    found: list[Finding] = []
    skip = (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)
    tokens = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type not in skip:
                tokens.append(token)
    except (tokenize.TokenError, SyntaxError):
        pass  # keep the tokens before the lexing error (e.g. an unclosed bracket)

    def add(category: str, line: int, message: str) -> None:
        found.append(_finding(category, file, line, message, lines[line - 1].strip()
                              if line <= len(lines) else "", **{"from": "tokens"}))

    for i, tok in enumerate(tokens):
        if tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):
                continue
            if isinstance(value, str) and _CUDA_DEVICE.fullmatch(value):
                add("device-string", tok.start[0], f"hard-coded device {value!r}")
            elif isinstance(value, str) and _is_nccl(value):
                add("nccl", tok.start[0], f"process-group backend {value!r}")
        elif tok.type == tokenize.NAME and tok.string == "cuda" and i > 0 and tokens[i - 1].string == ".":
            nxt = tokens[i + 1].string if i + 1 < len(tokens) else ""
            prev = tokens[i - 2].string if i > 1 else ""
            if prev == "torch" and nxt == ".":
                add("torch-cuda", tok.start[0], "torch.cuda reference")
            elif nxt == "(":
                add("dot-cuda", tok.start[0], ".cuda() moves to a CUDA device")
    return found


def scan_source(text: str, file: str) -> tuple[list[Finding], ast.Module | None]:
    """Findings for one module's source ``text`` (reported under ``file``),
    and its syntax tree (``None`` if it does not parse, in which case the
    findings start with a ``syntax-error`` one)."""
    lines = text.splitlines()
    try:
        tree = ast.parse(text, filename=file)
    except SyntaxError as error:
        line = error.lineno
        found = [_finding("syntax-error", file, line, f"SyntaxError: {error.msg}",
                          lines[line - 1].strip() if line and line <= len(lines) else "")]
        return found + _token_fallback(file, text, lines), None
    imports = _Imports()
    imports.visit(tree)
    found = _Scanner(file, lines, imports.names).run(tree)
    return _merge(found), tree


def read_source(path: str, errors: str = "replace") -> tuple[str, str]:
    """``(text, encoding)`` of the Python file at ``path``, decoded as Python
    would (its coding cookie, else UTF-8); ``errors`` as for ``bytes.decode``."""
    with open(path, "rb") as handle:
        data = handle.read()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError:
        encoding = "utf-8"
    return data.decode(encoding, errors=errors), encoding


def scan_file(path: str) -> tuple[list[Finding], ast.Module | None]:
    """:func:`scan_source` on the file at ``path`` (decoded as Python would;
    undecodable bytes are replaced)."""
    return scan_source(read_source(path)[0], path)


def _merge(found: list[Finding]) -> list[Finding]:
    """One finding per (line, category, message): repeats count."""
    merged: dict[tuple, Finding] = {}
    for finding in found:
        key = (finding.file, finding.line, finding.category, finding.message)
        if key in merged:
            merged[key].count += 1
        else:
            merged[key] = finding
    return list(merged.values())


def _is_third_party(path: str) -> bool:
    parts = set(os.path.normpath(path).split(os.sep))
    return bool(parts & {"site-packages", "dist-packages"})


def _module_files(tree: ast.Module, file: str, root: str) -> Iterable[str]:
    """Files under ``root`` that ``file``'s imports name (absolute and
    relative imports; ``from pkg import sub`` tries ``pkg/sub.py`` too)."""
    here = os.path.dirname(file)
    for node in ast.walk(tree):
        candidates: list[list[str]] = []
        base = root
        if isinstance(node, ast.Import):
            candidates = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here
                for _ in range(node.level - 1):
                    base = os.path.dirname(base)
            module = node.module.split(".") if node.module else []
            candidates = [module] + [module + [alias.name] for alias in node.names
                                     if alias.name != "*"]
            if node.level == 0:
                # A sibling import of a script run from its own directory.
                base = root
        for parts in candidates:
            if not parts:
                continue
            for prefix_len in range(1, len(parts) + 1):
                stem = os.path.join(base, *parts[:prefix_len])
                for path in (stem + ".py", os.path.join(stem, "__init__.py")):
                    if os.path.isfile(path):
                        yield os.path.realpath(path)


def scan_program(script: str, root: str | None = None) -> tuple[list[Finding], list[str]]:
    """Static findings for ``script`` and every module it imports, directly
    or not, from ``root`` (default: the script's directory) and below.

    Returns ``(findings, files_scanned)``; ``.cu``/``.cuh`` files next to a
    scanned module are listed as ``cuda-extension`` findings of their own
    (at line 1, ``detail["lines"]`` their length). Raises
    ``FileNotFoundError`` if ``script`` does not exist.
    """
    script = os.path.realpath(script)
    if not os.path.isfile(script):
        raise FileNotFoundError(f"no such script: {script}")
    root = os.path.realpath(root or os.path.dirname(script))
    findings: list[Finding] = []
    scanned: list[str] = []
    queue = [script]
    seen = {script}
    directories: list[str] = []
    while queue:
        path = queue.pop(0)
        scanned.append(path)
        found, tree = scan_file(path)
        findings.extend(found)
        if os.path.dirname(path) not in directories:
            directories.append(os.path.dirname(path))
        if tree is None:
            continue
        for module in _module_files(tree, path, root):
            if module not in seen and module.startswith(root + os.sep) and not _is_third_party(module):
                seen.add(module)
                queue.append(module)
    for directory in directories:
        for name in sorted(os.listdir(directory)):
            if name.endswith(_CUDA_SOURCE_SUFFIXES):
                path = os.path.join(directory, name)
                with open(path, "rb") as handle:
                    count = handle.read().count(b"\n")
                findings.append(_finding("cuda-extension", path, 1,
                                         f"CUDA source file ({count} lines)", lines=count))
    return findings, scanned
