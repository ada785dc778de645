"""Train a small CNN on Fashion-MNIST — a plain PyTorch script.

The device is the only thing that differs between a CPU run and an
accelerator run: it comes from --device, by default the current accelerator
(``torch.accelerator.current_accelerator()``, e.g. ``kiln``) or else the CPU.

    python examples/train_fashion_mnist.py                    # on kiln
    python examples/train_fashion_mnist.py --device cpu       # the same on CPU
    python examples/train_fashion_mnist.py --max-steps 100 --json run.json

Data: the gzip'd IDX files of Debian's ``dataset-fashion-mnist`` package
(``apt-get install dataset-fashion-mnist``; ``make demo`` installs it), or
any directory given with --data-dir / FASHION_MNIST_DIR.

Model: conv(1->16, 3x3) - ReLU - maxpool 2 - conv(16->32, 3x3) - ReLU -
maxpool 2 - linear(1568->128) - ReLU - dropout(0.25) - linear(128->10),
cross-entropy, AdamW (lr 1e-3); --amp bf16|fp16 trains under torch.autocast
(fp16 with a GradScaler). Initialisation, data order and dropout are
seeded by --seed, so runs on different devices see the same numbers.

With --json PATH it writes {"device", "seed", "steps" (per-step training
losses), "test_accuracy" (fraction in [0, 1]), "images_per_s" (training
images per second), "seconds" (training wall time)}.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST training-set pixel statistics


def find_data_dir(explicit: str | None) -> str:
    """The directory holding the four IDX files, or exit with a clear message."""
    if explicit:
        if all(os.path.exists(os.path.join(explicit, f)) for f in FILES.values()):
            return explicit
        sys.exit(f"Fashion-MNIST not found in --data-dir {explicit}: expected " + ", ".join(FILES.values()))
    candidates = [os.environ.get("FASHION_MNIST_DIR"), "/usr/share/datasets/fashion-mnist"]
    try:  # wherever Debian's package put them
        listing = subprocess.run(["dpkg", "-L", "dataset-fashion-mnist"], capture_output=True,
                                 text=True, check=False).stdout.split()
        candidates += [os.path.dirname(p) for p in listing if p.endswith(FILES["train_images"])]
    except FileNotFoundError:
        pass
    for directory in candidates:
        if directory and all(os.path.exists(os.path.join(directory, f)) for f in FILES.values()):
            return directory
    sys.exit("Fashion-MNIST not found. Install Debian's package "
             "(sudo apt-get install dataset-fashion-mnist, or run `make demo`), or pass "
             "--data-dir / set FASHION_MNIST_DIR to a directory with " + ", ".join(FILES.values()))


def read_idx(path: str) -> torch.Tensor:
    """An IDX file (http://yann.lecun.com/exdb/mnist/) as a uint8 tensor."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return torch.frombuffer(bytearray(data[4 + 4 * ndim:]), dtype=torch.uint8).reshape(shape)


def load(data_dir: str):
    def images(name):  # (N, 1, 28, 28) float32, normalised
        return ((read_idx(os.path.join(data_dir, FILES[name])).float() / 255) - MEAN).div(STD).unsqueeze(1)

    def labels(name):
        return read_idx(os.path.join(data_dir, FILES[name])).long()

    return images("train_images"), labels("train_labels"), images("test_images"), labels("test_labels")


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.dropout = nn.Dropout(0.25)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout(F.relu(self.fc1(x.flatten(1))))
        return self.fc2(x)


def evaluate(model, images, labels, device, batch_size=1000) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(images), batch_size):
            logits = model(images[i:i + batch_size].to(device))
            correct += (logits.argmax(1) == labels[i:i + batch_size].to(device)).sum().item()
    model.train()
    return correct / len(images)


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
    parser.add_argument("--epochs", type=positive_int, default=1)
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--max-steps", type=positive_int, default=None, help="stop after this many steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--amp", choices=["bf16", "fp16"], default=None,
                        help="mixed precision: torch.autocast in this dtype (fp16 adds a GradScaler)")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="train with torch.compile(model, backend=BACKEND) (default backend: "
                             "inductor); evaluation stays eager")
    parser.add_argument("--json", default=None, help="write the run's results to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    train_x, train_y, test_x, test_y = load(find_data_dir(args.data_dir))
    if args.batch_size > len(train_x):
        parser.error(f"--batch-size {args.batch_size} is larger than the {len(train_x)} "
                     "training images")
    torch.manual_seed(args.seed)
    model = SmallCNN().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step_model = torch.compile(model, backend=args.compile) if args.compile else model
    # Training-time randomness (dropout) restarts from the seed on every
    # device's generator; data order comes from its own host generator.
    torch.manual_seed(args.seed)
    order = torch.Generator().manual_seed(args.seed)

    print(f"device {device}, {len(train_x)} training images, batch {args.batch_size}"
          + (f", autocast {args.amp}" if args.amp else "")
          + (f", compiled ({args.compile})" if args.compile else ""))
    losses: list[float] = []
    trained = 0
    seconds = 0.0
    accuracy = 0.0
    for epoch in range(args.epochs):
        start = time.perf_counter()
        permutation = torch.randperm(len(train_x), generator=order)
        epoch_loss = torch.zeros((), device=device)
        steps = 0
        for i in range(0, len(train_x) - args.batch_size + 1, args.batch_size):
            if args.max_steps is not None and len(losses) >= args.max_steps:
                break
            batch = permutation[i:i + args.batch_size]
            x, y = train_x[batch].to(device), train_y[batch].to(device)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = F.cross_entropy(step_model(x), y)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            epoch_loss += loss.detach()
            losses.append(loss.item())
            steps += 1
        elapsed = time.perf_counter() - start
        seconds += elapsed
        trained += steps * args.batch_size
        accuracy = evaluate(model, test_x, test_y, device)
        print(f"epoch {epoch + 1}: loss {epoch_loss.item() / max(steps, 1):.4f}, "
              f"test accuracy {accuracy:.4f}, {elapsed:.1f} s, "
              f"{steps * args.batch_size / elapsed:.0f} images/s")
        if args.max_steps is not None and len(losses) >= args.max_steps:
            break

    result = {"device": str(device), "seed": args.seed, "compile": args.compile, "steps": losses,
              "test_accuracy": accuracy, "images_per_s": trained / seconds if seconds else 0.0,
              "seconds": seconds}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
