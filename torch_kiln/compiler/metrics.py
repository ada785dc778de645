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
        "kiln_graphs": {               # mode="reduce-overhead" (inductor/reduce_overhead.py)
            "graphs_captured": int,    # kiln graphs recorded
            "graph_replays": int,      # calls served by a replay
            "warmup_runs": int,        # calls that ran the compiled code to warm up
            "eager_runs": int,         # calls that ran it without a graph (fallbacks)
            "skips": {reason: count},  # graphs that run without kiln graphs, and why
        },
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


def _kiln_graph_stats() -> dict:
    module = sys.modules.get("torch_kiln.compiler.inductor.reduce_overhead")
    if module is None:  # nothing used reduce-overhead on kiln
        return {"graphs_captured": 0, "graph_replays": 0, "warmup_runs": 0, "eager_runs": 0,
                "skips": {}}
    return module.get_stats()


def get_metrics() -> dict:
    """The counts described in this module's docstring, since the process
    started or since the last :func:`reset_metrics`."""
    utils = _dynamo_utils()
    if utils is None:  # nothing was compiled: Dynamo was never imported
        return {"graphs_compiled": 0, "frames_compiled": 0, "graph_breaks": {},
                "graph_break_count": 0, "recompilations": 0, "recompilation_reasons": [],
                "compile_seconds": 0.0, "kiln_graphs": _kiln_graph_stats()}
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
        "kiln_graphs": _kiln_graph_stats(),
    }


def reset_metrics() -> None:
    """Sets every count of :func:`get_metrics` back to zero."""
    module = sys.modules.get("torch_kiln.compiler.inductor.reduce_overhead")
    if module is not None:
        module.reset_stats()
    utils = _dynamo_utils()
    if utils is None:
        return
    utils.counters.clear()
    utils.guard_failures.clear()
    utils.compilation_time_metrics.clear()
