"""A DDP job whose rank 0 ends first while rank 1 stays on rank 0's Ray cluster.

Launched by torchrun (2 ranks, gloo): ``_exit_order.py RECORD``. Both ranks train
two epochs of a map-style dataset with a ``DistributedSampler`` and record the ids
they saw per epoch (``RECORD.rank<r>``). Then rank 0's script ends at once; rank 1
waits until rank 0's process is gone (or ``RANK0_EXIT_WAIT_S`` passed: a rank 0
that waits at its exit for the others to leave Ray never goes first) and stays
connected to Ray ``LINGER_S`` longer, more than a rank that joined rank 0's cluster
waits for a lost one (``JOINER_RECONNECT_TIMEOUT_S``): a rank 0 that took the
cluster down meanwhile would make Ray end rank 1's process with status 1. Just
before it ends, each rank makes a Ray call and writes whether it answered and the
processes it started (its descendants) to ``RECORD.rank<r>.end``, for the test to
check that none is left behind.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from raydl import RayDataLoader
from raydl._internal.runtime.cluster import JOINER_RECONNECT_TIMEOUT_S
from raydl._internal.runtime.reaper import _stat

SAMPLES = 200
#: Seconds rank 1 waits for rank 0's process to end.
RANK0_EXIT_WAIT_S = 10.0
#: Seconds rank 1 then stays on Ray: longer than a joiner waits for a lost cluster.
LINGER_S = JOINER_RECONNECT_TIMEOUT_S + 3.0


class Ids(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


def descendants(pid: int) -> list[tuple[int, int]]:
    """Every live descendant of ``pid``: ``(pid, start time)`` pairs."""
    table = {int(n): s for n in os.listdir("/proc") if n.isdigit() and (s := _stat(int(n)))}
    found, stack = [], [pid]
    while stack:
        parent = stack.pop()
        for child, (ppid, start) in table.items():
            if ppid == parent:
                found.append((child, start))
                stack.append(child)
    return found


def main(record: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dataset = Ids()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = RayDataLoader(dataset, batch_size=8, sampler=sampler, num_workers=2)
    epochs: list[list[int]] = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        ids: list[int] = []
        for batch in loader:
            ids.extend(int(x) for x in batch.flatten().tolist())
            dist.all_reduce(torch.ones(1))  # a DDP step's collective
        epochs.append(ids)
    import raydl

    raydl.init()  # on Ray for sure, even if every epoch loaded in this process
    loader.close()
    with open(f"{record}.rank{rank}", "w") as f:
        json.dump({"epochs": epochs}, f)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        me = _stat(os.getpid())
        with open(f"{record}.rank0.pid", "w") as f:
            json.dump([os.getpid(), me[1] if me else 0], f)
    else:
        deadline = time.monotonic() + RANK0_EXIT_WAIT_S
        while time.monotonic() < deadline:
            try:
                with open(f"{record}.rank0.pid") as f:
                    pid, start = json.load(f)
            except (OSError, ValueError):
                time.sleep(0.1)
                continue
            stat = _stat(pid)
            if stat is None or stat[1] != start:
                break  # rank 0's process has ended
            time.sleep(0.1)
        time.sleep(LINGER_S)
    import ray

    still_on_ray = ray.get(ray.put(rank)) == rank  # the cluster still answers
    with open(f"{record}.rank{rank}.end", "w") as f:
        json.dump({"still_on_ray": still_on_ray, "procs": descendants(os.getpid())}, f)


if __name__ == "__main__":
    main(sys.argv[1])
