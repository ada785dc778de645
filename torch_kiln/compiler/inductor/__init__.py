"""Inductor for the kiln device.

``register()`` (idempotent) makes Inductor compile graphs whose tensors are on
kiln: the scheduling (``KilnScheduling``, Inductor's C++ code generator), the
wrapper (``KilnPythonWrapperCodegen``), the device op overrides, the cache-key
pass, and narrow fixes for places where Inductor assumes that C++ code means
device cpu (``fixes.py``). Importing Inductor takes seconds, so nothing here
runs at ``import torch``; see ``_lazy_registration`` for when it runs.

Note [Compiled code runs in stream order]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Eager kiln ops return at once and run later, in order, on a stream worker
(Note [How an eager op runs on kiln]). A compiled graph must fit into that
order without making the calling thread wait, exactly as a CUDA graph's
Triton kernels fit between CUDA's eager kernels:

* The wrapper Inductor generates (Python, ``KilnPythonWrapperCodegen``) runs
  on the calling thread, like CUDA's. It never touches tensor data.
* Each generated C++ kernel is *launched* as a task on the current stream of
  the graph's kiln device: ``kernel.launch(device, *args)``
  (``torch_kiln._C._GeneratedKernel``, aten/GeneratedKernels.h) packs the
  arguments — data pointers of kiln tensors, integers, doubles — and enqueues
  one call of the kernel's ``_kiln_entry`` trampoline through ``launchTask``,
  the mechanism eager ops use. The kernel therefore reads its inputs after
  all work queued before it (eager ops, copies, other compiled kernels) has
  written them, and writes its outputs before any work queued after it reads
  them. Calling the kernel on the Python thread instead — what Inductor does
  for CPU — reads inputs before queued eager work wrote them: a prototype got
  silently wrong results that way.
* Extern kernels (``extern_kernels.mm``, convolution, fallbacks to ATen ops)
  are eager kiln ops: they enqueue themselves on the same current stream.
* Buffers come from kiln's caching allocator (``empty_strided`` on
  ``kiln:N``), which is stream-ordered: a buffer the wrapper frees (``del
  buf0``) may be reused by later work on the same stream, which runs after
  every task that used it; use from another stream follows CUDA's
  ``record_stream`` rule (Note [Kiln caching allocator]).
* Nothing waits: no synchronize, no ``.item()``, no host copy is emitted, so a
  compiled step adds nothing to ``torch.kiln.get_sync_ops()``. A kernel's
  error (an index out of range) becomes the stream's sticky error, raised at
  the next synchronization like an eager kernel's, and the storages it
  should have written are marked (Note [Results of failed kernels]).
* The graph runs on the stream current *when it is called* (``with
  torch.kiln.stream(s): compiled(x)`` puts every kernel on ``s``), on the
  device the wrapper names: every launch (``launch(N, ...)``) and allocation
  (``device='kiln:N'``) names the graph's device, and the wrapper enters
  ``torch.kiln.device(N)`` around extern kernels as CUDA's does. (Inductor
  flushes C++ kernels after it closes the guard, so a launch may stand
  outside it; naming the device makes that harmless.)
* Intra-op threads: a generated kernel is the C++ Inductor writes for CPU
  at the compiling thread's ``torch.get_num_threads()`` T (which loops run in
  parallel, how reductions split), so compiled kiln gives compiled CPU's
  bits; it runs with the stream worker's count, which the task sets from the
  launching thread's (Note [Intra-op threads of kiln kernels]), capped at T
  (Note [Generated kernels use at most their compile-time thread count] in
  kernels.py).
* Errors inside OpenMP regions: a C++ exception leaving ``#pragma omp
  parallel`` terminates the process, so kernels with an indirect-index check
  are built without OpenMP (``kernels.needs_serial_build``). Integer division
  by zero uses Inductor's own error flag instead of throwing; that flag is
  one pointer for the whole process, so kernels that divide integers hold a
  mutex around their use of it (Note [Inductor's integer-division flag on
  kiln] in kernels.py).
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Registers Inductor's kiln backend (idempotent, thread-safe).

    Imports Inductor (seconds on a cold start), registers kiln's Dynamo
    DeviceInterface, ``register_backend_for_device("kiln", ...)`` and
    ``register_device_op_overrides("kiln", ...)``, and installs the narrow
    fixes of ``fixes.py``."""
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return
        from torch._inductor.codegen.common import (
            register_backend_for_device,
            register_device_op_overrides,
        )

        import torch._dynamo.device_interface  # noqa: F401  (kiln's interface registers on import)

        from torch_kiln.compiler import register_dynamo_hooks
        from torch_kiln.compiler.inductor import fixes, reduce_overhead
        from torch_kiln.compiler.inductor.cache_key import KilnCodegenPass
        from torch_kiln.compiler.inductor.device_op_overrides import KilnDeviceOpOverrides
        from torch_kiln.compiler.inductor.scheduling import KilnScheduling
        from torch_kiln.compiler.inductor.wrapper import (
            KilnCppWrapperCodegen,
            KilnPythonWrapperCodegen,
        )

        # Inductor looks the device's DeviceInterface up (decode_device,
        # reductions); the Dynamo half registers it (Note [Registering with
        # Dynamo lazily]); this makes sure it is in place.
        register_dynamo_hooks()
        register_device_op_overrides("kiln", KilnDeviceOpOverrides())
        register_backend_for_device(
            "kiln",
            KilnScheduling,
            KilnPythonWrapperCodegen,
            KilnCppWrapperCodegen,
            device_custom_pass=KilnCodegenPass(),
        )
        fixes.install()
        # mode="reduce-overhead": kiln graphs (Note [Kiln graphs for reduce-overhead]).
        reduce_overhead.install()
        _registered = True
