"""What the audit knows: the categories of CUDA lock-in, and for each CUDA
API it recognises, what that API does on kiln today and its portable
replacement.

``on_kiln`` always describes the *unmodified* line on a machine with kiln and
a CPU-only PyTorch (no CUDA), as measured with torch 2.13.0: for example
``torch.cuda.is_available()`` returns False there (``silently different``:
the program takes its non-CUDA path), ``torch.cuda.synchronize()`` raises
(``fails``).
"""

from __future__ import annotations

import dataclasses

__all__ = ["Category", "CATEGORIES", "TORCH_CUDA_API", "TORCH_CUDA_RENAMES", "CUDA_ONLY_PACKAGES",
           "CUDA_SETTINGS", "category"]

DEVICE = "device = torch.accelerator.current_accelerator()"


@dataclasses.dataclass(frozen=True)
class Category:
    """One kind of CUDA lock-in, with the defaults its findings take."""

    name: str
    title: str
    severity: str
    on_kiln: str
    effort: str
    replacement: str


_CATEGORY_LIST = [
    # --- static: read from the source --------------------------------------------------------
    Category("device-string", 'hard-coded "cuda" device', "high", "fails", "mechanical",
             f'{DEVICE} once, then pass `device` instead of "cuda"'),
    Category("dot-cuda", ".cuda() call", "high", "fails", "mechanical",
             f".to(device) with {DEVICE}"),
    Category("torch-cuda", "torch.cuda API", "high", "fails", "mechanical",
             "the torch.accelerator equivalent"),
    Category("cuda-branch", "branch on CUDA", "medium", "silently different", "needs a decision",
             'test for an accelerator (`device.type != "cpu"`, '
             "`torch.accelerator.is_available()`) instead of for CUDA"),
    Category("cuda-amp", "torch.cuda.amp", "medium", "silently different", "mechanical",
             'torch.autocast(device_type=device.type, ...) and torch.amp.GradScaler(device.type)'),
    Category("cuda-setting", "CUDA-only setting", "low", "works", "mechanical",
             "no effect off CUDA; keep it, or use the portable knob named in the message"),
    Category("nccl", '"nccl" process-group backend', "high", "fails", "mechanical",
             "backend=torch.distributed.get_default_backend_for_device(device)"),
    Category("cuda-graphs", "CUDA graphs", "high", "fails", "needs a decision",
             "torch.accelerator.Graph (or torch.kiln.graph / KilnGraph, which mirror "
             "torch.cuda's), or torch.compile(mode=\"reduce-overhead\"), which captures "
             "kiln graphs on kiln"),
    Category("nvtx", "NVTX range", "medium", "fails", "mechanical",
             'torch.profiler.record_function("name") (a context manager; works on every device)'),
    Category("cuda-extension", "custom CUDA extension", "high", "fails", "needs a kernel rewrite",
             "a torch.library custom op with a kernel per device: for kiln a C++ kernel "
             "built with torch_kiln.kernels.load_inline and registered with "
             "torch_kiln.kernels.custom_op (docs/kernels.md); keep the CUDA kernel for CUDA"),
    Category("triton-kernel", "Triton kernel", "high", "fails", "needs a kernel rewrite",
             "the same computation in PyTorch ops (torch.compile generates the kernel), or a "
             "torch.library custom op with a kiln kernel"),
    Category("cuda-library", "CUDA-only library", "high", "fails", "needs a decision",
             "the PyTorch built-in named in the message"),
    # --- run time: seen while the program ran on kiln -----------------------------------------
    Category("sync", "device synchronization", "medium", "slower", "needs a decision",
             "keep the value on the device (accumulate a tensor, read it once per log interval)"),
    Category("op-failure", "operator failed on kiln", "high", "fails", "needs a decision",
             "follow the error's advice; an operator CUDA runs and kiln does not is a kiln "
             "gap: report it"),
    Category("dtype-change", "dtype change", "medium", "works", "needs a decision",
             "ask for the dtype the program means where the data enters"),
    Category("graph-break", "torch.compile graph break", "medium", "slower", "needs a decision",
             "move the breaking line out of the compiled region, or make it traceable"),
    Category("recompilation", "torch.compile recompilation", "low", "slower", "needs a decision",
             "mark the changing dimension dynamic (torch._dynamo.mark_dynamic) or pad shapes"),
    Category("run-failure", "the run failed", "high", "fails", "needs a decision",
             "fix the error shown; run with --map-cuda if it is a CUDA device the program asked for"),
    Category("syntax-error", "file could not be parsed", "high", "fails", "needs a decision",
             "fix the syntax error; the rest of this file was not audited"),
]

CATEGORIES: dict[str, Category] = {c.name: c for c in _CATEGORY_LIST}


def category(name: str) -> Category:
    """The category called ``name``; raises ``KeyError`` naming the known ones."""
    try:
        return CATEGORIES[name]
    except KeyError:
        raise KeyError(f"unknown audit category {name!r}; known: {', '.join(CATEGORIES)}") from None


@dataclasses.dataclass(frozen=True)
class Api:
    """A recognised CUDA API: its category, portable replacement and
    behaviour on kiln (``None`` fields take the category's default)."""

    category: str
    replacement: str
    on_kiln: str | None = None
    effort: str | None = None
    severity: str | None = None


_SD = "silently different"

# torch.cuda.<name> (and torch.cuda.<sub>.<name>): keys are the part after "torch.cuda.".
TORCH_CUDA_API: dict[str, Api] = {
    "is_available": Api("torch-cuda", "torch.accelerator.is_available()", _SD, severity="medium"),
    "device_count": Api("torch-cuda", "torch.accelerator.device_count()", _SD, severity="medium"),
    "current_device": Api("torch-cuda", "torch.accelerator.current_device_index()"),
    "set_device": Api("torch-cuda", "torch.accelerator.set_device_index(index)"),
    "device": Api("torch-cuda", "torch.accelerator.device_index(index) (a context manager)"),
    "synchronize": Api("torch-cuda", "torch.accelerator.synchronize()"),
    "current_stream": Api("torch-cuda", "torch.accelerator.current_stream()"),
    "set_stream": Api("torch-cuda", "torch.accelerator.set_stream(stream)"),
    "Stream": Api("torch-cuda", "torch.Stream(device=device)"),
    "stream": Api("torch-cuda", "torch.Stream(device=device) used as a context manager"),
    "Event": Api("torch-cuda", "torch.Event(device=device)"),
    "manual_seed": Api("torch-cuda", "torch.manual_seed(seed) (seeds every device)", _SD,
                       severity="medium"),
    "manual_seed_all": Api("torch-cuda", "torch.manual_seed(seed) (seeds every device)", _SD,
                           severity="medium"),
    "empty_cache": Api("torch-cuda", "torch.accelerator.empty_cache()", "works", severity="low"),
    "memory_allocated": Api("torch-cuda", "torch.accelerator.memory_allocated()", _SD,
                            severity="low"),
    "max_memory_allocated": Api("torch-cuda", "torch.accelerator.max_memory_allocated()", _SD,
                                severity="low"),
    "memory_reserved": Api("torch-cuda", "torch.accelerator.memory_reserved()", _SD,
                           severity="low"),
    "max_memory_reserved": Api("torch-cuda", "torch.accelerator.max_memory_reserved()", _SD,
                               severity="low"),
    "memory_stats": Api("torch-cuda", "torch.accelerator.memory_stats()", _SD, severity="low"),
    "reset_peak_memory_stats": Api("torch-cuda", "torch.accelerator.reset_peak_memory_stats()"),
    "mem_get_info": Api("torch-cuda", "torch.accelerator.get_memory_info()"),
    "get_device_capability": Api("torch-cuda", "torch.accelerator.get_device_capability()",
                                 effort="needs a decision"),
    "get_device_name": Api("torch-cuda", "torch.accelerator.current_accelerator() (or "
                           "torch.kiln.get_device_name() on kiln)", effort="needs a decision"),
    "get_device_properties": Api("torch-cuda", "the device module's get_device_properties "
                                 "(torch.get_device_module(device))", effort="needs a decision"),
    "is_bf16_supported": Api("torch-cuda", "torch.get_device_module(device).is_bf16_supported()",
                             _SD, severity="medium"),
    # The same class as torch.OutOfMemoryError, which kiln raises: works.
    "OutOfMemoryError": Api("torch-cuda", "torch.OutOfMemoryError (the same class)", "works",
                            severity="low"),
    # torch.cuda.amp: deprecated aliases of torch.amp that pin device_type="cuda".
    "amp": Api("cuda-amp", 'torch.amp (torch.autocast(device_type=device.type), '
               "torch.amp.GradScaler(device.type))"),
    "amp.autocast": Api("cuda-amp", "torch.autocast(device_type=device.type, dtype=...)"),
    "amp.GradScaler": Api("cuda-amp", "torch.amp.GradScaler(device.type)"),
    "amp.custom_fwd": Api("cuda-amp", 'torch.amp.custom_fwd(device_type=device.type)'),
    "amp.custom_bwd": Api("cuda-amp", 'torch.amp.custom_bwd(device_type=device.type)'),
    # CUDA graphs.
    "graph": Api("cuda-graphs", 'torch.compile(mode="reduce-overhead"), or torch.accelerator.Graph'),
    "CUDAGraph": Api("cuda-graphs", "torch.accelerator.Graph"),
    "make_graphed_callables": Api("cuda-graphs", 'torch.compile(mode="reduce-overhead")'),
    "graph_pool_handle": Api("cuda-graphs", "torch.accelerator.Graph's pool"),
    # NVTX.
    "nvtx": Api("nvtx", 'torch.profiler.record_function("name")'),
}

# The torch.cuda functions ``--fix`` renames (torch_kiln/audit/fix.py): the
# part after "torch.cuda." -> the part after "torch." of a function that takes
# the same positional arguments on every device (the torch.accelerator ones
# are positional-only, so a call with keyword arguments is listed, not
# rewritten). Only these are rewritten; the other
# TORCH_CUDA_API entries are listed in the diff's header. manual_seed[_all]
# become torch.manual_seed, which also reseeds the CPU generator.
TORCH_CUDA_RENAMES: dict[str, str] = {
    "is_available": "accelerator.is_available",
    "device_count": "accelerator.device_count",
    "current_device": "accelerator.current_device_index",
    "set_device": "accelerator.set_device_index",
    "synchronize": "accelerator.synchronize",
    "current_stream": "accelerator.current_stream",
    "set_stream": "accelerator.set_stream",
    "manual_seed": "manual_seed",
    "manual_seed_all": "manual_seed",
    "empty_cache": "accelerator.empty_cache",
    "memory_allocated": "accelerator.memory_allocated",
    "max_memory_allocated": "accelerator.max_memory_allocated",
    "memory_reserved": "accelerator.memory_reserved",
    "max_memory_reserved": "accelerator.max_memory_reserved",
    "memory_stats": "accelerator.memory_stats",
    "reset_peak_memory_stats": "accelerator.reset_peak_memory_stats",
    "mem_get_info": "accelerator.get_memory_info",
}

# Third-party packages that need CUDA, and the built-in to use instead.
CUDA_ONLY_PACKAGES: dict[str, str] = {
    "apex": "torch.amp for apex.amp, torch.optim (fused=True where supported) for apex.optimizers, "
            "torch.nn.LayerNorm/RMSNorm for apex.normalization, DistributedDataParallel for apex.parallel",
    "flash_attn": "torch.nn.functional.scaled_dot_product_attention",
    "xformers": "torch.nn.functional.scaled_dot_product_attention (memory_efficient_attention)",
    "bitsandbytes": "torch.optim for 8-bit optimizers; torchao for quantized weights",
    "transformer_engine": "torch.autocast with bfloat16 (FP8 has no portable equivalent yet)",
    "pycuda": "torch tensors and ops on `device`",
    "cupy": "torch tensors on `device` (NumPy-like API: torch)",
    "pynvml": "torch.accelerator memory queries (torch.accelerator.get_memory_info())",
    "nvidia": "the PyTorch built-in for the NVIDIA library used",
    "tensorrt": "torch.compile, or torch.export for deployment",
    "torch_tensorrt": "torch.compile, or torch.export for deployment",
    "deepspeed.ops": "the PyTorch built-in for the fused op (torch.optim fused, SDPA)",
    "numba.cuda": "PyTorch ops on `device`, or a torch.library custom op",
}

# Environment variables that only CUDA (or its libraries) read, as string
# literals (os.environ["CUDA_VISIBLE_DEVICES"] = "0") -> what to use instead.
CUDA_ENVIRONMENT: dict[str, str] = {
    "CUDA_VISIBLE_DEVICES": "no effect on kiln: KILN_VISIBLE_DEVICES selects kiln devices",
    "CUDA_LAUNCH_BLOCKING": "no effect on kiln: KILN_LAUNCH_BLOCKING=1 makes launches wait",
    "CUBLAS_WORKSPACE_CONFIG": "a cuBLAS setting (for torch.use_deterministic_algorithms on "
                               "CUDA); no effect off CUDA",
    "PYTORCH_CUDA_ALLOC_CONF": "CUDA's caching-allocator settings; no effect on kiln's",
    "CUDA_DEVICE_ORDER": "no effect off CUDA",
}

# Settings that only mean something on CUDA: dotted name -> portable knob.
CUDA_SETTINGS: dict[str, str] = {
    "torch.backends.cuda.matmul.allow_tf32":
        'TF32 matmuls: torch.set_float32_matmul_precision("high") is the portable knob',
    "torch.backends.cudnn.allow_tf32":
        'TF32 convolutions: torch.set_float32_matmul_precision("high") is the portable knob',
    "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction":
        "reduced-precision fp16 reductions are a cuBLAS setting",
    "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction":
        "reduced-precision bf16 reductions are a cuBLAS setting",
    "torch.backends.cudnn.benchmark": "cuDNN autotuning; no effect off CUDA",
    "torch.backends.cudnn.deterministic":
        "use torch.use_deterministic_algorithms(True), which every device honours",
    "torch.backends.cudnn.enabled": "selects cuDNN; no effect off CUDA",
    "torch.backends.cuda.enable_flash_sdp": "SDPA backend selection: torch.nn.attention.sdpa_kernel",
    "torch.backends.cuda.enable_mem_efficient_sdp":
        "SDPA backend selection: torch.nn.attention.sdpa_kernel",
    "torch.backends.cuda.enable_math_sdp": "SDPA backend selection: torch.nn.attention.sdpa_kernel",
}
