"""Train a small character-level GPT on Tiny Shakespeare — plain PyTorch.

The device is the only thing that differs between a CPU run and an
accelerator run: it comes from --device, by default the current accelerator
(``torch.accelerator.current_accelerator()``, e.g. ``kiln``) or else the CPU.

    python examples/train_char_gpt.py                     # on kiln, 500 steps
    python examples/train_char_gpt.py --device cpu        # the same on CPU
    python examples/train_char_gpt.py --max-steps 100 --json run.json
    python examples/train_char_gpt.py --kl-attention      # attention in kl kernels
    KILN_DEVICE_COUNT=2 torchrun --standalone --nproc_per_node=2 \
        examples/train_char_gpt.py --parallel fsdp    # ddp | fsdp | tp | fsdp+tp

Model (after Karpathy's nanoGPT, github.com/karpathy/nanoGPT): token +
position embeddings, --layers pre-LayerNorm blocks of causal self-attention
(torch.nn.functional.scaled_dot_product_attention) and a GELU MLP, a final
LayerNorm, and an output head tied to the token embedding. AdamW, gradient
clipping at norm 1.0; --amp bf16|fp16 trains under torch.autocast (fp16 with
a GradScaler). --parallel trains across the ranks of a torchrun job with
the same global batch (examples/parallelism.py). Data:
data/tinyshakespeare.txt (1.1 MB), first 90% for training, the rest for
validation; batches of --block-size characters.

--kl-attention replaces scaled_dot_product_attention by the causal
flash-attention kernels written in Kiln's kl tile language
(examples/kernels/kl_attention.py: the forward, and FlashAttention-2's
backward in kl_attention_backward.py; docs/kernels.md), on kiln (compiled
kernels) or CPU tensors (the kl simulator, slow). The losses track the SDPA
run's closely, not bit for bit (another summation order).

With --json PATH it writes {"device", "seed", "steps" (per-step training
losses), "val_loss" (mean cross-entropy in nats on 20 validation batches),
"tokens_per_s" (training tokens per second), "seconds" (training wall time),
"compile", "parallel", "world_size", "kl_attention"}; under --parallel rank 0 writes it, with
the losses over the global batch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "tinyshakespeare.txt")


def causal_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    def __init__(self, width: int, heads: int, attention=causal_sdpa):
        super().__init__()
        self.head_dim = width // heads
        # attention(q, k, v) -> causal attention of (batch, heads, time, head_dim)
        self.attention = attention
        self.ln1 = nn.LayerNorm(width)
        # Separate query, key and value projections (not one fused qkv) so
        # that tensor parallelism can split them by heads (--parallel tp).
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        batch, time_, _ = x.shape
        h = self.ln1(x)
        # -1: the heads this process holds (all of them unless --parallel tp).
        q, k, v = (f(h).view(batch, time_, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = self.attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, time_, -1))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, width: int, layers: int, heads: int,
                 attention=causal_sdpa):
        super().__init__()
        self.block_size = block_size
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(block_size, width)
        self.blocks = nn.Sequential(*[Block(width, heads, attention) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.token.weight  # weight tying
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.token(idx) + self.position(positions)
        return self.head(self.ln(self.blocks(x)))


def batch_of(data: torch.Tensor, batch: int, block: int, generator: torch.Generator):
    starts = torch.randint(len(data) - block - 1, (batch,), generator=generator)
    x = torch.stack([data[s:s + block] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + 1 + block] for s in starts.tolist()])
    return x, y


@torch.no_grad()
def validation_loss(model, data, args, device) -> float:
    model.eval()
    generator = torch.Generator().manual_seed(1234)
    total = torch.zeros((), device=device)
    for _ in range(20):
        x, y = batch_of(data, args.batch_size, args.block_size, generator)
        logits = model(x.to(device))
        total += F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten())
    model.train()
    return total.item() / 20


@torch.no_grad()
def sample(model, prompt: torch.Tensor, length: int, device) -> list[int]:
    model.eval()
    idx = prompt.to(device).unsqueeze(0)
    for _ in range(length):
        logits = model(idx[:, -model.block_size:])[:, -1]
        next_id = torch.multinomial(F.softmax(logits / 0.8, dim=-1), 1)
        idx = torch.cat([idx, next_id], dim=1)
    model.train()
    return idx[0].tolist()


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def main() -> None:
    default_device = torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=str(default_device))
    parser.add_argument("--epochs", type=positive_int, default=1, help="passes of --max-steps steps")
    parser.add_argument("--max-steps", type=positive_int, default=500, help="training steps per epoch")
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--block-size", type=positive_int, default=64)
    parser.add_argument("--width", type=positive_int, default=128)
    parser.add_argument("--layers", type=positive_int, default=3)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-length", type=int, default=200)
    parser.add_argument("--amp", choices=["bf16", "fp16"], default=None,
                        help="mixed precision: torch.autocast in this dtype (fp16 adds a GradScaler)")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="train with torch.compile(model, backend=BACKEND) (default backend: "
                             "inductor); evaluation stays eager")
    parser.add_argument("--parallel", choices=["ddp", "fsdp", "tp", "fsdp+tp"], default=None,
                        help="train across the ranks of a torchrun job (examples/parallelism.py); "
                             "--batch-size stays the global batch")
    parser.add_argument("--kl-attention", action="store_true",
                        help="attention (forward and backward) by the kl tile-language kernels of "
                             "examples/kernels/kl_attention.py instead of "
                             "scaled_dot_product_attention")
    parser.add_argument("--json", default=None, help="write the run's results to this file")
    args = parser.parse_args()
    if args.width % args.heads:
        parser.error(f"--width {args.width} must be a multiple of --heads {args.heads}")
    if args.kl_attention and args.width // args.heads > 128:
        parser.error(f"--kl-attention: the head size --width / --heads is "
                     f"{args.width // args.heads}; the kl attention kernels allow at most 128")
    if args.parallel and (args.amp or args.compile):
        parser.error(f"--parallel {args.parallel} does not combine with --amp or --compile yet")
    device = torch.device(args.device)
    par = None
    if args.parallel:
        import parallelism  # examples/parallelism.py, next to this script

        par = parallelism.init(args.parallel, device.type, args.heads, args.batch_size)
        device = par.device
    report = print if par is None or par.is_main else (lambda *a, **k: None)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    with open(DATA, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    encode = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([encode[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    if args.block_size >= len(val_data):
        parser.error(f"--block-size {args.block_size} must be below the validation text's "
                     f"{len(val_data)} characters")

    attention = causal_sdpa
    if args.kl_attention:
        from kernels import kl_attention  # examples/kernels, next to this script

        attention = kl_attention.causal_attention
    torch.manual_seed(args.seed)
    model = CharGPT(len(chars), args.block_size, args.width, args.layers, args.heads,
                    attention).to(device)
    step_model = torch.compile(model, backend=args.compile) if args.compile else model
    if par is not None:
        step_model = parallelism.parallelize(model, par)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1,
                                  **(parallelism.optimizer_options(par) if par else {}))
    clip_grad_norm_ = parallelism.clip_grad_norm_ if par else torch.nn.utils.clip_grad_norm_
    torch.manual_seed(args.seed)  # sampling randomness restarts from the seed on every device
    order = torch.Generator().manual_seed(args.seed)
    report(f"device {device}, {sum(p.numel() for p in model.parameters())} parameters, "
           f"{len(chars)} characters, {len(train_data)} training tokens"
           + (f", autocast {args.amp}" if args.amp else "")
           + (f", compiled ({args.compile})" if args.compile else "")
           + (", kl attention" if args.kl_attention else "")
           + (f", {args.parallel} over {parallelism.dist.get_world_size()} ranks" if par else ""))

    losses: list[float] = []
    seconds = 0.0
    val = float("nan")
    for epoch in range(args.epochs):
        start = time.perf_counter()
        for step in range(args.max_steps):
            x, y = batch_of(train_data, args.batch_size, args.block_size, order)
            if par is not None:  # this rank's rows of the global batch
                x, y = parallelism.local_rows(x, par), parallelism.local_rows(y, par)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = F.cross_entropy(step_model(x.to(device)).flatten(0, 1), y.to(device).flatten())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            losses.append(parallelism.global_mean(loss, par) if par else loss.item())
            if (step + 1) % 100 == 0:
                report(f"step {len(losses)}: train loss {sum(losses[-100:]) / 100:.4f}")
        elapsed = time.perf_counter() - start
        seconds += elapsed
        val = validation_loss(model, val_data, args, device)
        tokens = args.max_steps * args.batch_size * args.block_size
        report(f"epoch {epoch + 1}: val loss {val:.4f}, {elapsed:.1f} s, {tokens / elapsed:.0f} tokens/s")

    text_ids = sample(model, data[:1], args.sample_length, device)
    report("sample:\n" + "".join(chars[i] for i in text_ids))
    result = {"device": str(device), "seed": args.seed, "compile": args.compile,
              "parallel": args.parallel, "kl_attention": args.kl_attention,
              "world_size": parallelism.dist.get_world_size() if par else 1, "steps": losses,
              "val_loss": val,
              "tokens_per_s": len(losses) * args.batch_size * args.block_size / seconds if seconds else 0.0,
              "seconds": seconds}
    if args.json and (par is None or par.is_main):
        with open(args.json, "w") as f:
            json.dump(result, f)
        print(f"results written to {args.json}")
    if par is not None:
        parallelism.finish()


if __name__ == "__main__":
    main()
