"""The shape of pytorch/examples' DDP tutorial script (``multigpu_torchrun.py``), on CPU.

A map-style dataset of 2048 ``(rand(20), rand(1))`` pairs, ``Linear(20, 1)``, SGD,
batch 32 per rank, ``DistributedSampler``, ``pin_memory=True``, and, as the
tutorial does, ``next(iter(loader))`` at each epoch's start to print the batch
size. gloo instead of nccl. ``--loader raydl`` swaps only the DataLoader import.
Run by ``benchmarks/ddp_tutorial/run.py`` under ``torchrun --nproc_per_node=2``.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler


class Pairs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, size: int) -> None:
        self.items = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.items[index]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loader", choices=["torch", "raydl"], default="torch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num-workers", type=int, default=0)
    args = parser.parse_args()
    if args.loader == "raydl":
        from raydl import RayDataLoader as DataLoader
    else:
        from torch.utils.data import DataLoader  # type: ignore[assignment]
    init_process_group(backend="gloo")
    rank = int(os.environ["LOCAL_RANK"])
    dataset = Pairs(2048)
    model = DistributedDataParallel(torch.nn.Linear(20, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(
        dataset,
        batch_size=32,
        pin_memory=True,
        shuffle=False,
        sampler=DistributedSampler(dataset),
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,
    )
    for epoch in range(args.epochs):
        size = len(next(iter(loader))[0])
        print(f"[rank {rank}] epoch {epoch} | batch size {size} | steps {len(loader)}", flush=True)
        loader.sampler.set_epoch(epoch)
        for source, targets in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(source), targets)
            loss.backward()
            optimizer.step()
    destroy_process_group()


if __name__ == "__main__":
    main()
