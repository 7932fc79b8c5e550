"""Quickstart: train a small model with RayDataLoader on data generated here.

The training loop is a plain torch loop; the only raydl-specific line is the
import. Run it with ``python examples/quickstart.py`` (about 50 s on 2 busy CPUs),
then ``python examples/quickstart.py --torch`` to run the same script with
torch's own DataLoader: same data, same order, same losses.

Epoch 0 is the slow one: it includes starting the embedded Ray instance and
the worker actors, the actors' imports (torch, numpy) and sending them the
pickled dataset. Later epochs reuse the actors (``persistent_workers=True``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset


class SyntheticDigits(Dataset[tuple[torch.Tensor, int]]):
    """28x28 "images" whose class is encoded in their mean brightness, with noise."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.labels = rng.integers(0, 10, size=n)
        self.noise = rng.standard_normal((n, 1, 28, 28)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        label = int(self.labels[index])
        image = self.noise[index] * 0.5 + (label - 4.5) / 4.5
        return torch.from_numpy(image), label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--torch", action="store_true", help="use torch's DataLoader instead")
    args = parser.parse_args()

    if args.torch:
        from torch.utils.data import DataLoader
    else:
        from raydl import RayDataLoader as DataLoader  # the one-line change

    torch.manual_seed(0)
    loader = DataLoader(
        SyntheticDigits(args.samples),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,
    )
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    name = "torch.utils.data.DataLoader" if args.torch else "raydl.RayDataLoader"
    print(f"{name}: {len(loader)} batches per epoch")

    rates: list[float] = []
    for epoch in range(args.epochs):
        start = time.perf_counter()
        first_batch = 0.0
        seen, correct, total_loss = 0, 0, 0.0
        for images, labels in loader:
            if not seen:
                first_batch = time.perf_counter() - start
            optimizer.zero_grad()
            logits = model(images)
            loss = loss_fn(logits, labels)
            loss.backward()
            optimizer.step()
            seen += len(labels)
            correct += int((logits.argmax(1) == labels).sum())
            total_loss += loss.item() * len(labels)
        elapsed = time.perf_counter() - start
        rates.append(seen / elapsed)
        print(
            f"epoch {epoch}: {seen} samples in {elapsed:.2f} s "
            f"({seen / elapsed:,.0f} samples/s, first batch after {first_batch:.2f} s), "
            f"loss {total_loss / seen:.3f}, accuracy {correct / seen:.3f}"
        )
        if epoch == 0:
            kind = "in process" if args.num_workers == 0 else "torch" if args.torch else "raydl"
            print(f"  {_FIRST_EPOCH[kind]}")
    if len(rates) > 1:
        print(f"warm epochs (1 and later): {statistics.median(rates[1:]):,.0f} samples/s (median)")
    print(_COMPARE["torch" if args.torch else "raydl"])


_FIRST_EPOCH = {
    "raydl": (
        "(epoch 0 includes starting Ray, starting the worker actors, their imports and "
        "sending them the pickled dataset; later epochs reuse the actors)"
    ),
    "torch": "(epoch 0 includes starting torch's worker processes; later epochs reuse them)",
    "in process": "(num_workers=0: loaded in this process, nothing to start)",
}
_COMPARE = {
    "raydl": (
        "For torch's own DataLoader on the same data and order: "
        "python examples/quickstart.py --torch. Items this small, already in memory, "
        "cost little to load either way; raydl pays off when loading and preprocessing "
        "outgrow the trainer's CPUs (README.md, 'When it helps, and when it does not')."
    ),
    "torch": "For raydl on the same data and order: python examples/quickstart.py",
}


if __name__ == "__main__":
    main()
