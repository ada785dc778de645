"""Which ATen operators ran on kiln, and which ones stalled the device.

Every operator a kiln kernel executes is counted under its ATen name
(``"aten::add.out"``); operators that forced the host to wait for the device
(``item()``, ``nonzero``, ``masked_select``, blocking copies to the host,
printing, ...) are also counted as sync ops. Use them to see what a model
runs and where it synchronizes, the way one reads a CUDA profile::

    torch.kiln.clear_op_tracking()
    loss = model(x).sum(); print(loss.item())
    torch.kiln.get_sync_ops()   # {'aten::_local_scalar_dense': 1}

``set_sync_debug_mode("warn" | "error")`` turns each of those into a warning
or an error at the line that caused it, as ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

from torch_kiln import _C


def _sorted(counts: dict[str, int]) -> dict[str, int]:
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def get_executed_ops() -> dict[str, int]:
    """Counts of ATen operators executed on kiln since the last
    ``clear_op_tracking()``, most frequent first."""
    return _sorted(_C._get_executed_ops())


def get_sync_ops() -> dict[str, int]:
    """Counts of operators that forced a host-device synchronization since the
    last ``clear_op_tracking()``, most frequent first."""
    return _sorted(_C._get_sync_ops())


def get_fused_ops() -> dict[str, int]:
    """How often each sequence of queued ops ran fused as one kiln task since
    the last ``clear_op_tracking()`` (adaptive eager fusion,
    ``KILN_ADAPTIVE_EAGER=1``; empty while it is off), most frequent first::

        {'aten::add.out, aten::mul.out, aten::relu': 12}

    Keys list the ops of the sequence in issue order by their ATen names; the
    ops are still counted one by one in ``get_executed_ops()``. See
    docs/performance.md ("Adaptive eager fusion")."""
    return _sorted(_C._get_fused_ops())


def clear_op_tracking() -> None:
    """Reset the executed-op, sync-op and fused-op counters."""
    _C._clear_op_tracking()


_SYNC_DEBUG_MODES = {"default": 0, "warn": 1, "error": 2}


def set_sync_debug_mode(debug_mode: int | str) -> None:
    """Warn or raise when an operation makes the host wait for the device, as
    ``torch.cuda.set_sync_debug_mode`` does.

    Args:
        debug_mode: ``"default"`` or 0: allow it silently; ``"warn"`` or 1:
            warn (``UserWarning``) naming the operation, e.g. ``called a
            synchronizing kiln operation: aten::nonzero ...``; ``"error"`` or 2:
            raise ``RuntimeError`` naming it, before it waits.

    What counts: the operations ``get_sync_ops()`` counts (``item()``,
    ``nonzero``, ``masked_select``, printing, blocking copies to the host and
    from pageable host memory, sparse compute, ...) and
    ``torch.kiln.Stream.synchronize()``, as CUDA's mode covers
    ``Stream.synchronize()``. Not covered, as on CUDA: ``torch.kiln.synchronize()``
    and ``Event.synchronize()`` (explicit waits), and kiln's one-time layout
    checks of an op's first call (``"<op> (layout check)"`` in ``get_sync_ops()``).
    The mode is process-wide. Note [Sync debug mode] in
    ``torch_kiln/csrc/core/KilnFunctions.cc``.

    Raises:
        RuntimeError: an unknown mode (CUDA's error type).
        TypeError: ``debug_mode`` is neither a str nor an int.
    """
    if isinstance(debug_mode, str):
        if debug_mode not in _SYNC_DEBUG_MODES:
            raise RuntimeError(f"invalid value of debug_mode {debug_mode!r}, expected one of "
                               "`default`, `warn`, `error` (or 0, 1, 2)")
        debug_mode = _SYNC_DEBUG_MODES[debug_mode]
    elif isinstance(debug_mode, bool) or not isinstance(debug_mode, int):
        raise TypeError(f"set_sync_debug_mode: debug_mode must be 'default', 'warn', 'error' or "
                        f"0, 1, 2, got {type(debug_mode).__name__} {debug_mode!r}.")
    elif debug_mode not in (0, 1, 2):
        raise RuntimeError(f"invalid value of debug_mode {debug_mode}, expected one of 0, 1, 2 "
                           "(or `default`, `warn`, `error`)")
    _C._set_sync_debug_mode(debug_mode)


def get_sync_debug_mode() -> int:
    """The current sync debug mode: 0 (default), 1 (warn) or 2 (error)."""
    return _C._get_sync_debug_mode()
