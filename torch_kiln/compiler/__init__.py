"""torch.compile support for kiln.

What lives here:

* ``device_interface``: Dynamo's ``DeviceInterface`` for the ``kiln`` device
  (current device, streams, events, synchronize, properties, the Worker API
  for Inductor's compile subprocesses), registered under ``"kiln"`` and
  ``"kiln:N"`` as ``torch._dynamo.device_interface`` does for ``"cuda"``.
* ``inductor``: Inductor for kiln (in progress; not imported from here).

Importing ``torch._dynamo`` costs seconds, and most programs never compile,
so ``torch_kiln`` does not import it. Instead :func:`register_dynamo_hooks`
(called when ``torch_kiln`` loads) registers the kiln interface right after
``torch._dynamo.device_interface`` is first imported by anyone — Dynamo,
Inductor or user code — so the interface is in place before Dynamo reads the
registry (See Note [Registering with Dynamo lazily]).

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

# Note [Registering with Dynamo lazily]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Dynamo reads its device-interface registry (get_registered_device_interfaces)
# when it first traces, and caches some of what it reads (the handlers of
# TorchInGraphFunctionVariable); Inductor looks the interface up per device.
# So kiln's interface must be registered before the first trace, but
# registering eagerly would make `import torch` import torch._dynamo: about
# 3 s more on the 2-core development machine. A post-import hook gives both:
# a meta-path finder that, when torch._dynamo.device_interface is imported,
# lets the normal loader execute the module and then registers kiln before
# the import statement returns. If the module was imported before torch_kiln
# (TORCH_DEVICE_BACKEND_AUTOLOAD=0 and an explicit import later), kiln
# registers at once. The finder removes itself after its one use.

_DEVICE_INTERFACE_MODULE = "torch._dynamo.device_interface"
_lock = threading.Lock()
_registered = False


def _register_now() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
    from torch_kiln.compiler.device_interface import register

    register()


class _RegisterAfterExec(importlib.abc.Loader):
    """Runs the real loader, then registers kiln's interface."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _register_now()


class _DeviceInterfaceImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of Dynamo's device_interface."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _DEVICE_INTERFACE_MODULE:
            return None
        _remove_hook()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfterExec(spec.loader)
        return spec


_hook: _DeviceInterfaceImportHook | None = None


def _remove_hook() -> None:
    global _hook
    if _hook is not None and _hook in sys.meta_path:
        sys.meta_path.remove(_hook)
    _hook = None


def register_dynamo_hooks() -> None:
    """Make Dynamo know the kiln device: register
    ``torch_kiln.compiler.device_interface.KilnInterface`` for ``"kiln"`` now
    if ``torch._dynamo.device_interface`` is loaded, else as soon as it is
    (Note [Registering with Dynamo lazily]). Idempotent; never imports
    ``torch._dynamo`` itself."""
    global _hook
    if _DEVICE_INTERFACE_MODULE in sys.modules:
        _register_now()
        return
    if _hook is None:
        _hook = _DeviceInterfaceImportHook()
        sys.meta_path.insert(0, _hook)


__all__ = ["register_dynamo_hooks"]
