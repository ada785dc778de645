"""Which ATen operators ran on kiln, and which ones stalled the device.

Every operator a kiln kernel executes is counted under its ATen name
(``"aten::add.out"``); operators that forced the host to wait for the device
(``item()``, ``nonzero``, ``masked_select``, blocking copies to the host,
printing, ...) are also counted as sync ops. Use them to see what a model
runs and where it synchronizes, the way one reads a CUDA profile::

    torch.kiln.clear_op_tracking()
    loss = model(x).sum(); print(loss.item())
    torch.kiln.get_sync_ops()   # {'aten::_local_scalar_dense': 1}
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
