"""A DDP script that builds its loader, then at once makes collectives of its own.

Launched by torchrun (2 ranks, gloo), or run first by ``_consume.py
--early-collectives`` (one launch for both). The loader's background start (rank 0
starting Ray, rank 1 waiting for its address) runs while the script broadcasts
DDP's parameters, all-reduces and gathers on the default process group: the
start must neither deadlock nor pair with these calls. Each rank then trains
two epochs and writes what it saw to ``RECORD.rank<r>``.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.utils.data import Dataset


class Ids(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


def main(record: str) -> None:
    dist.init_process_group("gloo")
    scenario(record)
    dist.destroy_process_group()


def scenario(record: str) -> None:
    """The loader's background start against the script's collectives; Ray's first start."""
    rank = dist.get_rank()
    from raydl import RayDataLoader

    loader = RayDataLoader(
        Ids(), batch_size=8, shuffle=True, num_workers=1, persistent_workers=True
    )
    started_in_background = loader._startup is not None
    start_running = started_in_background and not loader._startup.done  # type: ignore[union-attr]
    # The script's own collectives, at once, on the default group.
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    for step in range(50):
        value = torch.tensor([float(rank + step)])
        dist.all_reduce(value)
        assert value.item() == 2 * step + 1, value
    box = [f"rank {rank}"]
    dist.broadcast_object_list(box, src=0)
    gathered: list[object] = [None, None]
    dist.all_gather_object(gathered, rank)
    assert box == ["rank 0"] and gathered == [0, 1]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    epochs = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        ids = []
        for batch in loader:
            optimizer.zero_grad()
            model(batch).sum().backward()  # DDP all-reduces the gradients each step
            optimizer.step()
            ids.extend(int(x) for x in batch.flatten().tolist())
        epochs.append(ids)
    import ray

    import raydl

    # Its epochs may all have loaded in this process while Ray still started (the
    # loader's start_in_process): raydl.init() waits for that start before Ray is asked.
    raydl.init()
    with open(f"{record}.rank{rank}", "w") as f:
        json.dump(
            {
                "started_in_background": started_in_background,
                "start_running": start_running,
                "gcs_address": ray.get_runtime_context().gcs_address,
                "epochs": epochs,
            },
            f,
        )
    loader.close()


if __name__ == "__main__":
    main(sys.argv[1])
