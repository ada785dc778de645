"""torch.compile support for kiln.

What lives here:

* ``device_interface``: Dynamo's ``DeviceInterface`` for the ``kiln`` device
  (current device, streams, events, synchronize, properties, the Worker API
  for Inductor's compile subprocesses), registered under ``"kiln"`` and
  ``"kiln:N"`` as ``torch._dynamo.device_interface`` does for ``"cuda"``.
* ``metrics``: :func:`get_metrics` / :func:`reset_metrics`, what
  ``torch.compile`` did in this process (graphs, graph breaks and their
  reasons, recompilations, compile seconds), read from Dynamo's own counters.
* ``fake_convolution``: FakeTensorMode gives kiln convolutions the output
  strides of CPU's kernel, which kiln runs.
* ``normalization``: LayerNorm, BatchNorm and GroupNorm rules (fake and
  Inductor's decompositions) take their CPU branch for kiln tensors, whose
  kernels are CPU's.
* ``small_matmuls``: Inductor's mm, addmm and bmm decompositions take their
  CPU branch for kiln tensors (which small products become sums).
* ``inductor``: Inductor for kiln (not imported from here: it registers
  itself when Inductor first looks up the kiln backend, through Inductor's
  PrivateUse1 hook on ``torch.kiln``, or from ``backend="kiln"``).

Importing ``torch._dynamo`` costs seconds, and most programs never compile,
so ``torch_kiln`` does not import it. Instead :func:`register_dynamo_hooks`
(called when ``torch_kiln`` loads) registers each of the above right after
the Dynamo module it extends is first imported by anyone — Dynamo, Inductor
or user code — so it is in place before Dynamo reads its registry (See Note
[Registering with Dynamo lazily]).

The stock backends need nothing else from kiln: ``backend="eager"`` and
``"aot_eager"`` run the traced graph with kiln's eager kernels, which trace
under ``FakeTensorMode`` (Note [Kiln kernels under FakeTensorMode],
``torch_kiln/csrc/aten/FakeKernels.cc``), and ``torch.kiln``'s stream and
device functions trace like CUDA's (Note [torch.kiln under torch.compile],
``torch_kiln/kiln/streams.py``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading

from torch_kiln.compiler.metrics import get_metrics, reset_metrics

# Note [Registering with Dynamo lazily]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Dynamo reads its registries when it first traces, and caches some of what
# it reads (the device interfaces behind TorchInGraphFunctionVariable's
# handlers); Inductor looks the interface up per device. So kiln must be
# registered before the first trace, but registering eagerly would make
# `import torch` import torch._dynamo: about 0.9 s more on the idle 2-core
# development machine (3 s when busy). A post-import hook gives both: a meta-path finder
# that, when one of the Dynamo modules in _AFTER_IMPORT is imported, lets the
# normal loader execute it and then runs kiln's registration with it, before
# the import statement returns (the registration only uses that module,
# which is complete by then, though its package may still be initialising).
# A module imported before torch_kiln (TORCH_DEVICE_BACKEND_AUTOLOAD=0 and an
# explicit import later) gets its registration at once. The finder removes
# itself once every module has been seen.
#
# Not registered (deliberately): a Dynamo variable for `with
# torch.kiln.device(i):` (register_device_context_manager, as Dynamo has for
# torch.cuda.device). With it the block traces, but under aot_eager a
# factory inside it without a device index (device="kiln") was measured to
# allocate on the outer device at run time, as AOTAutograd drops the device
# switch; without it Dynamo breaks the graph at the block and runs it eagerly,
# which is correct.


def _register_device_interface() -> None:
    from torch_kiln.compiler.device_interface import register

    register()


def _register_trace_rules() -> None:
    """Dynamo skips torch.cuda's RNG state getters and setters (files under
    torch/ are skipped unless allow-listed, and trace_rules marks them
    SkipFunctionVariable): a call graph-breaks and runs eagerly, because
    AOTAutograd would drop them from the graph. Kiln's live outside torch/,
    so Dynamo traced into them, and even compiled their frames when they ran
    eagerly (OpInfo's seeded wrappers call them under no_dispatch(), where
    that fails). Adding their file to Dynamo's skip list gives them CUDA's
    treatment: never traced, never compiled."""
    import torch._dynamo.trace_rules as trace_rules

    trace_rules.add("torch_kiln.kiln.random")


def _register_fake_rules() -> None:
    from torch_kiln.compiler import fake_convolution, normalization, traced_compositions

    fake_convolution.register()
    normalization.register_fake_rules()
    traced_compositions.register()


def _register_decompositions() -> None:
    # Before AOTAutograd decomposes the first graph with Inductor's table
    # (registering when Inductor first looks up kiln's scheduling was too
    # late for the first graph of a process).
    from torch_kiln.compiler import normalization, small_matmuls

    normalization.register_decompositions()
    small_matmuls.register_decompositions()


_AFTER_IMPORT = {
    "torch._dynamo.device_interface": _register_device_interface,
    "torch._dynamo.trace_rules": _register_trace_rules,
    # Loaded by `import torch` today, so this runs when torch_kiln loads.
    "torch._subclasses.fake_impls": _register_fake_rules,
    "torch._inductor.decomposition": _register_decompositions,
}
_lock = threading.Lock()
_done: set[str] = set()


def _register(module_name: str) -> None:
    with _lock:
        if module_name in _done:
            return
        _done.add(module_name)
    _AFTER_IMPORT[module_name]()


class _RegisterAfterExec(importlib.abc.Loader):
    """Runs the real loader, then kiln's registration for the module."""

    def __init__(self, loader: importlib.abc.Loader, module_name: str):
        self._loader = loader
        self._module_name = module_name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _register(self._module_name)


class _DynamoImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loaders of the modules in _AFTER_IMPORT."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _AFTER_IMPORT or fullname in _done:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfterExec(spec.loader, fullname)
        if _done.union([fullname]) >= _AFTER_IMPORT.keys():
            _remove_hook()
        return spec


_hook: _DynamoImportHook | None = None


def _remove_hook() -> None:
    global _hook
    if _hook is not None and _hook in sys.meta_path:
        sys.meta_path.remove(_hook)
    _hook = None


def register_dynamo_hooks() -> None:
    """Make Dynamo know the kiln device: register kiln's DeviceInterface
    (``torch_kiln.compiler.device_interface``) now if
    ``torch._dynamo.device_interface`` is loaded, else as soon as it is
    (Note [Registering with Dynamo lazily]). Idempotent; never imports
    ``torch._dynamo`` itself."""
    global _hook
    pending = False
    for name in _AFTER_IMPORT:
        if name in sys.modules:
            _register(name)
        elif name not in _done:
            pending = True
    if pending and _hook is None:
        _hook = _DynamoImportHook()
        sys.meta_path.insert(0, _hook)


__all__ = ["get_metrics", "register_dynamo_hooks", "reset_metrics"]
