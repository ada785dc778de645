"""What the conformance run covers: dtypes, passes, quick-mode limits, paths.

Every other file of the harness takes these names from here, so changing the
scope of a run (a dtype more, a longer quick shard) is a one-line change.
"""

from __future__ import annotations

import pathlib

import torch

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent
KNOWN_FAILURES_FILE = HERE / "known_failures.txt"
# The compiled pass (compiled_cases.py) keeps its own list.
KNOWN_FAILURES_COMPILED_FILE = HERE / "known_failures_compiled.txt"

DEVICE = "kiln"

# The dtypes of issue 6, in the order reports list them.
DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64,
)
# Quick mode runs these (or, for an op supporting neither, its first dtype
# in DTYPES), so every op is exercised.
QUICK_DTYPES = (torch.float32, torch.int64)
# Quick mode runs the first few samples of each op and dtype.
QUICK_SAMPLES = 5
# Gradients are compared for these dtypes only.
BACKWARD_DTYPES = (torch.float32, torch.float64)
# ModuleInfo modules run in these dtypes (quick mode: the first).
MODULE_DTYPES = (torch.float32, torch.float64)

# Passes, in report order. "noncontiguous" reruns forward on
# SampleInput.noncontiguous() copies of the samples.
OP_PASSES = ("forward", "noncontiguous", "out", "inplace", "backward")
QUICK_OP_PASSES = ("forward", "backward")
PASSES = OP_PASSES + ("modules",)
# Opt-in passes: never run unless named with --passes (not in a default or
# --quick run). "compiled": torch.compile on kiln against eager kiln; slow
# (every case compiles C++ with g++), so it runs alone, with its own
# known-failures file and its own section of docs/conformance.md.
COMPILED_PASS = "compiled"
EXTRA_OP_PASSES = (COMPILED_PASS,)
ALL_PASSES = PASSES + EXTRA_OP_PASSES
# The compiled pass runs this many samples per op and dtype (sample_inputs,
# the first ones, as quick mode's shard).
COMPILED_SAMPLES = 1

# Seed for sample generation and before every random op call (CPU and kiln
# use the same Mersenne Twister, so seeded random ops compare exactly).
SEED = 0

# A worker that reports nothing for this long is taken as hung: its stack is
# dumped to its log, it is killed, and the case it was running fails.
DEFAULT_CASE_TIMEOUT_S = 300.0


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32."""
    return str(dtype).removeprefix("torch.")


DTYPE_BY_NAME = {dtype_name(d): d for d in DTYPES}
