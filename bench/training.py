"""Training throughput of the two examples, and kiln's peak memory while
training them.

The models and batch code are imported from examples/train_fashion_mnist.py
(SmallCNN, load, find_data_dir) and examples/train_char_gpt.py (CharGPT,
batch_of, DATA); the hyper-parameters are those scripts' defaults. One
training step is exactly the scripts' step (host batch -> .to(device),
forward, cross-entropy, zero_grad, backward, [clip_grad_norm_,] optimizer
step) except that the scripts' per-step bookkeeping `loss.item()` is left
out: it synchronizes every step, and the benchmark measures the device
running ahead of Python, synchronizing once at the end of a repetition.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
import torch.nn.functional as F

import harness
from harness import CPU, DEVICES, KILN, Row, Target, interleaved, row_from_samples, sync, timed

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
MIB = 1 << 20


def _example(name: str):
    """Imports examples/<name>.py as a module (they are plain scripts; their
    main() only runs under __main__)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def compiled(model: torch.nn.Module, backend: str | None):
    """The model's forward as a trainer calls it: the module itself, or
    torch.compile(model, backend=backend) (compiled on its first step)."""
    return model if backend is None else torch.compile(model, backend=backend)


# ---------------------------------------------------------------- CNN

class CnnTrainer:
    """examples/train_fashion_mnist.py: SmallCNN, batch 64, AdamW lr 1e-3,
    seed 0, on `device`. step(k) runs k training steps on consecutive
    batches of a seeded permutation of the training set."""

    batch_size = 64
    items_per_step = batch_size
    unit = "images"

    _data = None

    @classmethod
    def data(cls):
        if cls._data is None:
            ex = _example("train_fashion_mnist")
            try:
                train_x, train_y, _, _ = ex.load(ex.find_data_dir(None))
                source = "Fashion-MNIST training set"
            except SystemExit as e:  # the script exits when the data is missing
                print(f"warning: {e}; using random images of the same shape", file=sys.stderr)
                g = torch.Generator().manual_seed(0)
                train_x = torch.randn(60000, 1, 28, 28, generator=g)
                train_y = torch.randint(0, 10, (60000,), generator=g)
                source = "random images (Fashion-MNIST not found)"
            cls._data = (train_x, train_y, source)
        return cls._data

    def __init__(self, device: str, compile_backend: str | None = None):
        ex = _example("train_fashion_mnist")
        self.device = torch.device(device)
        self.train_x, self.train_y, _ = self.data()
        torch.manual_seed(0)
        self.model = ex.SmallCNN().to(self.device)
        self.forward = compiled(self.model, compile_backend)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        torch.manual_seed(0)
        self.permutation = torch.randperm(len(self.train_x), generator=torch.Generator().manual_seed(0))
        self.position = 0

    def step(self, k: int) -> None:
        optimizer, device = self.optimizer, self.device
        for _ in range(k):
            if self.position + self.batch_size > len(self.permutation):
                self.position = 0
            batch = self.permutation[self.position:self.position + self.batch_size]
            self.position += self.batch_size
            x, y = self.train_x[batch].to(device), self.train_y[batch].to(device)
            loss = F.cross_entropy(self.forward(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


# ---------------------------------------------------------------- GPT

class GptTrainer:
    """examples/train_char_gpt.py: CharGPT with the script's defaults (3
    layers, width 128, 4 heads, block 64), batch 32, AdamW lr 2e-3 weight
    decay 0.1, gradient clipping at 1.0, seed 0, on `device`."""

    batch_size, block_size, width, layers, heads = 32, 64, 128, 3, 4
    items_per_step = batch_size * block_size
    unit = "tokens"

    _data = None

    @classmethod
    def data(cls):
        if cls._data is None:
            ex = _example("train_char_gpt")
            with open(ex.DATA, encoding="utf-8") as f:
                text = f.read()
            chars = sorted(set(text))
            encode = {c: i for i, c in enumerate(chars)}
            data = torch.tensor([encode[c] for c in text], dtype=torch.long)
            cls._data = (data[:int(0.9 * len(data))], len(chars))
        return cls._data

    def __init__(self, device: str, compile_backend: str | None = None):
        ex = _example("train_char_gpt")
        self.batch_of = ex.batch_of
        self.device = torch.device(device)
        self.train_data, vocab = self.data()
        torch.manual_seed(0)
        self.model = ex.CharGPT(vocab, self.block_size, self.width, self.layers,
                                self.heads).to(self.device)
        self.forward = compiled(self.model, compile_backend)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=2e-3, weight_decay=0.1)
        torch.manual_seed(0)
        self.order = torch.Generator().manual_seed(0)

    def step(self, k: int) -> None:
        model, optimizer, device = self.model, self.optimizer, self.device
        for _ in range(k):
            x, y = self.batch_of(self.train_data, self.batch_size, self.block_size, self.order)
            loss = F.cross_entropy(self.forward(x.to(device)).flatten(0, 1),
                                   y.to(device).flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()


MODELS = [
    ("Fashion-MNIST CNN", CnnTrainer, {"quick": (5, 30, 5), "full": (10, 100, 9)}),
    ("char GPT", GptTrainer, {"quick": (2, 8, 5), "full": (3, 30, 9)}),
]


KILN_FUSED = "kiln, adaptive eager on"


class FusedSteps:
    """A trainer on kiln whose steps run with adaptive eager on (Note
    [Adaptive eager fusion]); fusion is switched back off after each call."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.items_per_step = trainer.items_per_step

    def step(self, k: int) -> None:
        import torch_kiln

        torch_kiln._C._set_adaptive_eager(True)
        try:
            self.trainer.step(k)
        finally:
            torch_kiln._C._set_adaptive_eager(False)

    def warm_up(self, steps: int) -> None:
        """`steps` steps, then as many as make every run of ops hot (its own
        generated kernel is asked for after that many runs), then waits for
        the builds: the timed steps run what a long training run runs."""
        import torch_kiln
        from torch_kiln.kiln import _fused_kernels

        self.step(steps + torch_kiln._C._FUSED_KERNEL_HOT_PLAN_RUNS)
        sync(KILN)
        if not _fused_kernels.wait(1800):
            raise RuntimeError(f"fused kernel builds still running: {_fused_kernels.stats()}")


def throughput(quick: bool) -> list[Row]:
    """Training throughput (images/s, tokens/s) of both examples: CPU, kiln,
    and kiln with adaptive eager on (a third trainer, warmed up until its
    generated kernels are built): after `warmup` untimed steps per trainer,
    repetitions of `steps` steps each, interleaved; a repetition ends with
    torch.kiln.synchronize() on kiln. Targets: kiln >= 0.9x CPU; with
    adaptive eager on (issue 16) >= 1.15x CPU for the CNN, >= 1.3x for the
    char GPT."""
    rows = []
    for name, trainer_class, plan in MODELS:
        warmup, steps, repetitions = plan["quick" if quick else "full"]
        trainers = {d: trainer_class(d) for d in DEVICES}
        for trainer in trainers.values():
            trainer.step(warmup)
        trainers[KILN_FUSED] = FusedSteps(trainer_class(KILN))
        trainers[KILN_FUSED].warm_up(warmup)
        sync(KILN)
        reps = {d: timed(KILN if d == KILN_FUSED else d, lambda t=t: t.step(steps),
                         steps * t.items_per_step)
                for d, t in trainers.items()}
        samples = interleaved(reps, repetitions, warmup=0)
        note = f"{steps} steps x {repetitions} reps"
        if trainer_class is CnnTrainer:
            note += f"; data: {CnnTrainer.data()[2]}"
        fused = {CPU: samples[CPU], KILN: samples.pop(KILN_FUSED)}
        rows.append(row_from_samples(
            "training", f"{name} training", f"{trainer_class.unit}/s", samples,
            lambda s: 1.0 / s, higher_is_better=True, target=Target("ratio>=", 0.9), note=note))
        fused_target = 1.15 if trainer_class is CnnTrainer else 1.3
        rows.append(row_from_samples(
            "training", f"{name} training, adaptive eager on", f"{trainer_class.unit}/s", fused,
            lambda s: 1.0 / s, higher_is_better=True, target=Target("ratio>=", fused_target),
            note=note + "; KILN_ADAPTIVE_EAGER=1 for kiln"))
        del trainers, reps
    return rows


def throughput_at_default_threads(quick: bool) -> list[Row]:
    """Training throughput of both examples, CPU and kiln (adaptive eager
    off), at PyTorch's default intra-op thread count for this machine
    (harness.DEFAULT_INTRA_OP_THREADS, read before run.py applies --threads)
    instead of the run's --threads; the run's setting is restored afterwards.
    Issue 16's default-threads target: kiln >= 1.0x CPU on every row. Here
    kiln's Python thread, its stream worker and the worker's OpenMP team
    share the cores that CPU eager's one thread and its team use."""
    threads = harness.DEFAULT_INTRA_OP_THREADS
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # kiln's tasks follow it (Note [Intra-op threads of kiln kernels])
    try:
        worker_threads, _ = harness.kiln_task_threads()
        rows = []
        for name, trainer_class, plan in MODELS:
            warmup, steps, repetitions = plan["quick" if quick else "full"]
            trainers = {d: trainer_class(d) for d in DEVICES}
            for trainer in trainers.values():
                trainer.step(warmup)
            sync(KILN)
            reps = {d: timed(d, lambda t=t: t.step(steps), steps * t.items_per_step)
                    for d, t in trainers.items()}
            samples = interleaved(reps, repetitions, warmup=0)
            rows.append(row_from_samples(
                "training-default-threads", f"{name} training, {threads} threads (default)",
                f"{trainer_class.unit}/s", samples, lambda s: 1.0 / s, higher_is_better=True,
                target=Target("ratio>=", 1.0),
                note=f"{steps} steps x {repetitions} reps; torch.get_num_threads() = {threads} "
                     f"for CPU, {worker_threads} inside kiln tasks"))
            del trainers, reps
        return rows
    finally:
        torch.set_num_threads(previous)


def peak_memory(quick: bool) -> list[Row]:
    """Kiln only: peak memory_reserved / peak memory_allocated over a training
    run of each example from an empty cache (torch.kiln.empty_cache(), then
    reset_peak_memory_stats(), then model creation and `steps` steps).
    Target: <= 1.25."""
    rows = []
    steps = 10 if quick else 30
    for name, trainer_class, _ in MODELS:
        trainer_class.data()
        sync(KILN)
        torch.kiln.empty_cache()
        torch.kiln.reset_peak_memory_stats()
        trainer = trainer_class(KILN)
        trainer.step(steps)
        sync(KILN)
        reserved = torch.kiln.max_memory_reserved()
        allocated = torch.kiln.max_memory_allocated()
        rows.append(Row(
            "memory", f"{name}: peak reserved / peak allocated", "x", None,
            reserved / allocated, target=Target("kiln<=", 1.25),
            note=f"{steps} steps; peak reserved {reserved / MIB:.1f} MiB, "
                 f"peak allocated {allocated / MIB:.1f} MiB",
            samples={"max_memory_reserved": reserved, "max_memory_allocated": allocated}))
        del trainer
    torch.kiln.empty_cache()
    return rows
