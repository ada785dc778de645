"""What ``torch.compile`` did in this process: graphs, graph breaks,
recompilations and compile seconds (issue 11's metrics).

``get_metrics()`` reads the statistics TorchDynamo itself keeps (so it covers
every device, kiln or not) and returns a plain dictionary::

    {
        "graphs_compiled": int,        # FX graphs Dynamo captured and compiled
        "frames_compiled": int,        # Python frames Dynamo compiled (graph breaks
                                       # and recompilations compile more frames)
        "graph_breaks": {reason: count},  # first line of each break's reason
        "graph_break_count": int,
        "recompilations": int,         # compiles of a frame that had been compiled
                                       # before (its guards failed: new shapes, ...)
        "recompilation_reasons": [str],  # why the first compiled version no longer fit
        "compile_seconds": float,      # wall seconds in Dynamo's frame compiles,
                                       # backend (Inductor) compilation included
    }

``reset_metrics()`` starts the counts again (``torch._dynamo.reset()`` does
not clear them). Neither imports Dynamo if nothing has compiled yet.

Sources: ``torch._dynamo.utils.counters`` ("stats",
"graph_break"), ``torch._dynamo.utils.guard_failures`` (one reason per cache
entry whose guards failed when a frame recompiled; the entry compiled first,
compile id ``N/0``, fails at every recompilation, so its reasons count them)
and ``torch._dynamo.utils.compilation_time_metrics["_compile.compile_inner"]``
(Dynamo's timer around one frame's whole compilation: its samples are the
compile seconds, and their number the frames compiled).
"""

from __future__ import annotations

import re
import sys

__all__ = ["get_metrics", "reset_metrics"]

_FIRST_COMPILE = re.compile(r"^\[?\d+/0\]?:?\s*")


def _dynamo_utils():
    return sys.modules.get("torch._dynamo.utils")


def get_metrics() -> dict:
    """The counts described in this module's docstring, since the process
    started or since the last :func:`reset_metrics`."""
    utils = _dynamo_utils()
    if utils is None:  # nothing was compiled: Dynamo was never imported
        return {"graphs_compiled": 0, "frames_compiled": 0, "graph_breaks": {},
                "graph_break_count": 0, "recompilations": 0, "recompilation_reasons": [],
                "compile_seconds": 0.0}
    counters = utils.counters
    breaks: dict[str, int] = {}
    for reason, count in counters["graph_break"].items():
        first_line = str(reason).strip().splitlines()[0] if str(reason).strip() else "unknown"
        breaks[first_line] = breaks.get(first_line, 0) + count
    reasons = []
    for failures in utils.guard_failures.values():
        for failure in failures:
            if _FIRST_COMPILE.match(str(failure)):
                reasons.append(_FIRST_COMPILE.sub("", str(failure), count=1))
    seconds = utils.compilation_time_metrics.get("_compile.compile_inner", [])
    return {
        "graphs_compiled": int(counters["stats"]["unique_graphs"]),
        # One compile_inner timing per frame compiled. counters["frames"]
        # misses fullgraph=True compiles (Dynamo counts those elsewhere).
        "frames_compiled": len(seconds),
        "graph_breaks": breaks,
        "graph_break_count": sum(breaks.values()),
        "recompilations": len(reasons),
        "recompilation_reasons": reasons,
        "compile_seconds": float(sum(seconds)),
    }


def reset_metrics() -> None:
    """Sets every count of :func:`get_metrics` back to zero."""
    utils = _dynamo_utils()
    if utils is None:
        return
    utils.counters.clear()
    utils.guard_failures.clear()
    utils.compilation_time_metrics.clear()
