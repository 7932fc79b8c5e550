"""A training process for the kill-and-resume tests (1 process, or one rank under torchrun).

Every step it takes a batch of each of its loaders (the parquet source: one per
mode, see :data:`PARQUET_MODES`), all-reduces (the DDP step, under several
ranks), then writes a checkpoint atomically: the loaders' ``state_dict()`` and
the ids this rank consumed so far in the epoch, as a real job saves model +
loader state together. Each ``--resume CKPT OUT`` (repeatable, run in turn) builds
fresh loaders, loads ``CKPT``'s rank-0 checkpoint (every rank does; under DDP all
ranks saved at the same step), finishes that epoch and runs one more, writing to
``OUT`` and checkpointing into ``CKPT``. With ``--kill-seed S`` it then runs an
uninterrupted reference (fresh loaders of its own, every epoch, written to
``--reference``), then starts over with new loaders and every rank SIGKILLs
itself when its K-th batch of the first epoch arrives, before checkpointing it (a
preemption: that batch was received but not consumed) into ``--ckpt``; K is
``random.Random(S).randint(2, n - 1)`` for the reference's n batches an epoch, so
the test can work it out too. One launch for several runs saves a launch
(torchrun, torch, the connection to Ray) per run, and the later loaders start in
a process that already ran others: an order that depended on the process would
differ from the reference's. Writes one JSON line per epoch to ``<out>.rank<r>``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import raydl

ROWS = 600


class Indices(Dataset[int]):
    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> int:
        return index


def make_parquet(root: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(root, exist_ok=True)
    for i, rows in enumerate([250, 50, 250, 50]):  # unequal files
        start = sum([250, 50, 250, 50][:i])
        ids = np.arange(start, start + rows)
        table = pa.table({"id": ids, "user": ids % 13, "label": (ids % 5 == 0).astype(np.int64)})
        pq.write_table(table, os.path.join(root, f"part-{i}.parquet"), row_group_size=64)


def last_mile(batch: dict[str, np.ndarray], epoch: int) -> dict[str, np.ndarray]:
    """Drop spam users (user 3), keep positives and a per-epoch half of negatives."""
    ids = batch["id"]
    draw = np.random.default_rng(epoch).random(ROWS)[ids] < 0.5
    keep = (batch["user"] != 3) & ((batch["label"] == 1) | draw)
    return {"id": ids[keep]}


#: The parquet source's loaders, stepped together: one checkpoint, one kill, every mode of
#: a plan raydl's actors run (the global shuffle, the streaming modes dealt by rank 0).
PARQUET_MODES = {
    "global": {"shuffle": True},
    "files": {"shuffle": True, "shuffle_mode": "files", "local_shuffle_buffer_size": 40},
    "none": {"shuffle": False},
}


def build(source: str, data: str) -> dict[str, raydl.RayDataLoader]:
    """The loaders of ``source``, by name (the same rows each, so the same batch counts)."""
    if source == "map":
        loader = raydl.RayDataLoader(
            Indices(),
            batch_size=8,
            shuffle=True,
            num_workers=2,
            seed=5,
            generator=torch.Generator().manual_seed(5),
        )
        return {"map": loader}
    table = raydl.read_parquet(data)
    pipeline = raydl.PerEpoch(
        lambda epoch: table.map_batches(last_mile, fn_kwargs={"epoch": epoch}, batch_format="numpy")
    )
    return {
        name: raydl.RayDataLoader(pipeline, batch_size=16, seed=5, **options)
        for name, options in PARQUET_MODES.items()
    }


def steps(loaders: dict[str, raydl.RayDataLoader]) -> Any:
    """One batch of every loader per step; every loader must end at the same step."""
    iterators = {name: iter(loader) for name, loader in loaders.items()}
    while True:
        batches = {name: next(it, None) for name, it in iterators.items()}
        ended = [name for name, batch in batches.items() if batch is None]
        if ended:
            assert len(ended) == len(batches), f"{ended} ended before the others"
            return
        yield batches


def save(path: str, payload: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)  # atomic: a kill never leaves half a checkpoint


def run(
    loaders: dict[str, raydl.RayDataLoader],
    out_path: str,
    epochs: int,
    *,
    ckpt: str | None = None,
    kill_after: int = -1,
) -> int:
    """Train ``loaders`` to ``epochs``; one JSON line per epoch. Returns epoch 0's batch count.

    With ``ckpt`` each step saves this rank's checkpoint there; ``kill_after`` > 0
    SIGKILLs the process when that batch of epoch 0 arrives.
    """
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    start = next(iter(loaders.values())).epoch
    first_batches = -1
    with open(out_path, "w") as out:
        for epoch in range(start, epochs):
            ids: dict[str, list[int]] = {name: [] for name in loaders}
            batches = 0
            for step in steps(loaders):
                batches += 1
                if epoch == 0 and batches == kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                for name, batch in step.items():
                    got = batch["id"] if isinstance(batch, dict) else batch
                    ids[name].extend(int(i) for i in got)
                if distributed:
                    dist.all_reduce(torch.ones(1))
                if ckpt is not None:
                    states = {name: loader.state_dict() for name, loader in loaders.items()}
                    save(
                        os.path.join(ckpt, f"rank{rank}.json"),
                        {"states": states, "epoch": epoch, "ids": ids},
                    )
            if epoch == start:
                first_batches = batches
            out.write(json.dumps({"epoch": epoch, "ids": ids, "batches": batches}) + "\n")
            out.flush()
    for loader in loaders.values():
        loader.close()
    return first_batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", choices=["map", "parquet"], required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--resume", nargs=2, action="append", default=[], metavar=("CKPT", "OUT"),
        help="resume from CKPT/rank0.json into OUT (repeatable; before the kill run)",
    )  # fmt: skip
    parser.add_argument("--kill-seed", type=int)
    parser.add_argument("--reference", help="with --kill-seed: where the reference run writes")
    parser.add_argument("--ckpt", help="with --kill-seed: where the killed run checkpoints")
    parser.add_argument("--out", help="with --kill-seed: where the killed run writes")
    args = parser.parse_args()
    kill_args = (args.kill_seed, args.reference, args.ckpt, args.out)
    if len({arg is None for arg in kill_args}) != 1:
        parser.error("--kill-seed, --reference, --ckpt and --out go together")
    if args.kill_seed is None and not args.resume:
        parser.error("nothing to run: give --resume or --kill-seed")

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    raydl.init()
    for ckpt, out in args.resume:
        loaders = build(args.source, args.data)
        with open(os.path.join(ckpt, "rank0.json")) as f:
            checkpoint = json.load(f)
        for name, loader in loaders.items():
            loader.load_state_dict(checkpoint["states"][name])
        run(loaders, f"{out}.rank{rank}", args.epochs, ckpt=ckpt)
    if args.kill_seed is not None:
        batches = run(build(args.source, args.data), f"{args.reference}.rank{rank}", args.epochs)
        kill_after = random.Random(args.kill_seed).randint(2, batches - 1)
        loaders = build(args.source, args.data)
        run(loaders, f"{args.out}.rank{rank}", args.epochs, ckpt=args.ckpt, kill_after=kill_after)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
