"""A rank script for the multi-rank tests: iterate a RayDataLoader, record what it got.

Launched by torchrun (or by hand with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT).
Writes one JSON line per epoch to ``<record>.rank<r>``. With ``--die-after K``
rank 1 kills itself (SIGKILL) after K batches of each loader whose spec ends in
``/dies`` (the last one; it runs with ``--timeout``), to test that rank 0 fails
cleanly instead of hanging. A loader whose spec ends in ``/poison`` reads through
a stage that raises on one row (``POISON``), one in ``/planfail`` through a
``PerEpoch`` builder that raises: each rank records the error it got and goes on
to the next loader. ``--early-collectives RECORD`` first runs
``_early_collectives.py``'s scenario, whose loader starts Ray in the background.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import raydl


def unequal_files(root: str) -> list[str]:
    """Parquet files of very unequal size: 1000 rows and 37 rows, ids disjoint."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = []
    start = 0
    for i, rows in enumerate([1000, 37, 1000, 37]):
        ids = np.arange(start, start + rows)
        path = os.path.join(root, f"part-{i}.parquet")
        pq.write_table(pa.table({"id": ids, "x": ids.astype(np.float32)}), path)
        paths.append(path)
        start += rows
    return paths


def drop_sevens(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A filter whose output size is only known once it ran: drops ids ending in 7."""
    keep = batch["id"] % 10 != 7
    return {name: column[keep] for name, column in batch.items()}


#: The row ``poison`` raises on: in ``part-2.parquet`` (ids 1037-2036).
POISON = 1500


def poison(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A stage that fails on one row of one file, as a decoder fails on a bad record."""
    if POISON in batch["id"]:
        raise ValueError(f"poison row {POISON}")
    return batch


def _consume(
    loader: raydl.RayDataLoader,
    path: str,
    rank: int,
    epochs: int,
    die_after: int,
    *,
    poisoned: bool = False,
) -> None:
    """Iterate ``loader`` for ``epochs`` epochs, one JSON line per epoch to ``path``.

    ``poisoned``: an epoch is expected to fail; record its error, wait for the other
    ranks (a barrier) and return (no per-step all-reduce, which the rank whose epoch
    fails first would leave unpaired).
    """
    with open(path, "w") as out:
        for epoch in range(epochs):
            ids: list[int] = []
            batches = 0
            start = time.monotonic()
            try:
                for batch in loader:
                    ids.extend(batch["id"].tolist())
                    batches += 1
                    if rank == 1 and batches == die_after:
                        os.kill(os.getpid(), signal.SIGKILL)
                    if die_after < 0 and not poisoned:
                        # the step of a DDP job: an all-reduce every batch (when no rank
                        # dies; otherwise gloo's own error would pre-empt the loader's)
                        dist.all_reduce(torch.ones(1))
            except Exception as err:
                out.write(
                    json.dumps(
                        {
                            "error": f"{type(err).__name__}: {err}",
                            "after_s": time.monotonic() - start,
                        }
                    )
                    + "\n"
                )
                out.flush()
                if poisoned:
                    # The loader stays open until every rank has its error, as in a script
                    # that catches it and goes on to the next epoch: rank 0's board lives on.
                    dist.barrier()
                    return
                sys.stdout.flush()
                os._exit(3)
            stats = loader.stats()["epochs"][-1]
            record = {
                "epoch": epoch,
                "ids": ids,
                "batches": batches,
                "summary": str(stats["ray_data"]),
                "fingerprint": stats["fingerprint"],
            }
            out.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--record", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=33)
    # comma-separated READER/MODE[/EPOCHS[/dies]], one loader each, in turn ("none":
    # shuffle=False; READER "ray": Ray Data's read_parquet, "raydl": a plan raydl's own
    # actors run, "poison": the same with a stage that fails on one row, "planfail": a
    # PerEpoch whose builder fails; "dies":
    # --die-after and --timeout apply to this loader)
    parser.add_argument("--loaders", default="ray/blocks")
    parser.add_argument("--die-after", type=int, default=-1)
    parser.add_argument("--timeout", type=float, default=0)
    parser.add_argument("--early-collectives", metavar="RECORD")
    # no raydl.init(): the first loader's reader (raydl's own) joins rank 0's cluster itself
    parser.add_argument("--no-init", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.early_collectives:
        from _early_collectives import scenario

        scenario(args.early_collectives)
    if not args.no_init:
        raydl.init()
    import ray.data

    paths = sorted(os.path.join(args.data, f) for f in os.listdir(args.data))
    missing = os.path.join(args.data, "missing", "part-9.parquet")
    datasets = {
        "raydl": lambda: raydl.read_parquet(paths).map_batches(drop_sevens, batch_format="numpy"),
        "ray": lambda: ray.data.read_parquet(paths),
        "poison": lambda: raydl.read_parquet(paths).map_batches(poison, batch_format="numpy"),
        # a per-epoch pipeline whose builder fails (on rank 0, which plans every epoch)
        "planfail": lambda: raydl.PerEpoch(lambda epoch: raydl.read_parquet([missing])),
    }
    specs = [item.split("/") for item in args.loaders.split(",")]
    for reader, mode, *rest in specs:  # one loader after another, each for every epoch
        dies = rest[1:] == ["dies"]
        loader = raydl.RayDataLoader(
            datasets[reader](),
            batch_size=args.batch_size,
            shuffle=mode != "none",
            seed=7,
            shuffle_mode="files" if mode == "none" else mode,
            local_shuffle_buffer_size=100,
            timeout=args.timeout if dies else 60 if reader in ("poison", "planfail") else 0,
        )
        record = args.record if len(specs) == 1 else f"{args.record}-{reader}-{mode}"
        record += "-dies" if dies and len(specs) > 1 else ""
        count = int(rest[0]) if rest else args.epochs
        _consume(
            loader, f"{record}.rank{rank}", rank, count, args.die_after if dies else -1,
            poisoned=reader in ("poison", "planfail"),
        )  # fmt: skip
        loader.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make-data"]:
        unequal_files(sys.argv[2])
    else:
        main()
