"""DDP training with RayDataLoader, written exactly as for torch's DataLoader.

Run with two ranks on CPU (gloo)::

    torchrun --nproc_per_node=2 examples/train_ddp.py

On GPUs the same script uses nccl and each rank's ``LOCAL_RANK`` device. The
loader lines are torch's: a ``DistributedSampler``, ``sampler.set_epoch``,
``len(loader)``, and a ``next(iter(loader))`` peek before the loop. Rank 0
starts one embedded Ray instance; the other ranks join it.

``--source ray`` feeds the same model from a ``ray.data.Dataset`` instead
(one pipeline per epoch, split across the ranks by raydl).
``--record FILE`` writes the sample ids each rank saw per epoch (JSON lines),
which the multi-rank tests use to check coverage.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, DistributedSampler

from raydl import RayDataLoader as DataLoader  # was: from torch.utils.data import DataLoader


class Points(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """A linearly separable 2-class problem; each sample carries its id."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((n, 8)).astype(np.float32)
        self.y = (self.x.sum(axis=1) > 0).astype(np.int64)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return torch.from_numpy(self.x[i]), torch.tensor(self.y[i]), i


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--source", choices=["map", "ray"], default="map")
    parser.add_argument("--record", default=None)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else None
    if device is not None:
        torch.cuda.set_device(device)  # this rank's GPU, before nccl's first collective
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    if args.source == "map":
        dataset = Points(args.samples)
        sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        loader = DataLoader(
            dataset,
            batch_size=args.batch_size,
            sampler=sampler,
            num_workers=2,
            persistent_workers=True,
            pin_memory=use_cuda,
        )
    else:
        import ray.data

        import raydl

        raydl.init()  # every rank joins rank 0's Ray before any ray.data call
        base = Points(args.samples)
        rows = [{"x": base.x[i], "y": base.y[i], "id": i} for i in range(len(base))]
        dataset = ray.data.from_items(rows)
        loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, seed=0)

    model = nn.Linear(8, 2)
    if device is not None:
        model = model.to(device)
    ddp = DistributedDataParallel(model, device_ids=[device] if device is not None else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()

    first = next(iter(loader))  # a peek, as many scripts do; the epoch loop is unaffected
    first_size = len(first["x"]) if isinstance(first, dict) else len(first[0])
    if rank == 0:
        print(f"world={world} batches/epoch={len(loader)} first batch: {first_size} samples")

    record = open(args.record + f".rank{rank}", "w") if args.record else None  # noqa: SIM115
    for epoch in range(args.epochs):
        if args.source == "map":
            loader.sampler.set_epoch(epoch)
        start = time.perf_counter()
        ids: list[int] = []
        batches = 0
        for batch in loader:
            if args.source == "map":
                x, y, idx = batch
            else:
                x, y, idx = batch["x"], batch["y"], batch["id"]
            if device is not None:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()  # all-reduce: every rank must have the same number of batches
            optimizer.step()
            ids.extend(int(i) for i in idx)
            batches += 1
        elapsed = time.perf_counter() - start
        # nccl exchanges device tensors only; gloo host ones.
        counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(counts, torch.tensor([batches], device=device))
        if rank == 0:
            print(
                f"epoch {epoch}: {batches} batches/rank (all ranks: {[int(c) for c in counts]}), "
                f"{elapsed:.2f} s, loss {loss.item():.3f}"
            )
        if record is not None:
            record.write(json.dumps({"epoch": epoch, "rank": rank, "ids": ids}) + "\n")
            record.flush()
    if record is not None:
        record.close()
    loader.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
