"""Autograd's kiln device threads hold no Python object when the interpreter
finalizes (Note [Autograd device threads at exit]).

Note [Autograd device threads at exit]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The backward pass of kiln tensors runs on autograd's device thread for that
kiln device ("pt_autograd_<index>"), as it does for CUDA. Since PyTorch 2.13,
``torch.autograd.backward`` stashes a ``contextvars.Context`` in thread-local
storage, and the engine's GraphTask copies it (``at::ThreadLocalState``).
The device thread drops its reference to a finished GraphTask a moment after
waking the caller; if the caller's thread was the last other holder and the
program then ends, the device thread frees the GraphTask, and so the Context,
while Python finalizes. Freeing a Python object takes the GIL, a thread that
asks for the GIL during finalization is ended with ``pthread_exit``, and that
unwinds through a ``noexcept`` destructor: ``std::terminate``, and the
process aborts after the program finished (seen as "std::terminate called on
thread 'pt_autograd_0'" in kiln's terminate report, about every second run of
a script whose last statement was a kiln backward, on 2 busy cores).

So at exit, before finalization (an ``atexit`` handler, run before kiln's own
shutdown), each kiln device that has an autograd thread runs a one-node
backward pass through that thread (``_C._drain_autograd_device_thread``,
python/AutogradExit.cc). The device thread takes work in order and frees a
finished GraphTask before it takes the next task, so once that pass has run,
the program's last GraphTask is gone. The pass itself is all C++: its
tensors have no Python objects and it stashes nothing, so freeing its
GraphTask later never needs the GIL. (Freeing a tensor that has a Python
object does: PyTorch 2.13's TensorImpl takes the GIL when its C++ count
drops back to the Python object's own reference, even if that object lives
on; a first version of this drain, written in Python, aborted the same way
on its own tensors.) The pass waits in a helper thread for at most
``_EXIT_DRAIN_S`` (a daemon thread may keep the device thread busy with its
own backward); past that, exit goes on.
"""

from __future__ import annotations

import os
import threading

import torch

from torch_kiln import _C

_EXIT_DRAIN_S = 2.0


def _devices_with_autograd_threads() -> list[int]:
    """Kiln device indices whose autograd device thread exists, from the
    thread names in /proc (empty where /proc is unavailable)."""
    names: set[str] = set()
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names.add(f.read().strip())
            except OSError:
                continue
    except OSError:
        return []
    count = torch.kiln.device_count()
    return [d for d in range(count) if f"pt_autograd_{d}" in names]


def drain_autograd_device_threads() -> None:
    """Runs a tiny backward through each kiln autograd device thread so that
    none still holds a GraphTask (Note [Autograd device threads at exit])."""
    devices = _devices_with_autograd_threads()
    if not devices:
        return

    def drain() -> None:
        for device in devices:
            try:
                _C._drain_autograd_device_thread(device)
            except Exception:  # a failed device: nothing more to do at exit
                pass

    try:
        helper = threading.Thread(target=drain, name="kiln-autograd-exit", daemon=True)
        helper.start()
    except RuntimeError:  # no new threads at this point of shutdown
        return
    helper.join(_EXIT_DRAIN_S)
