"""Last-mile preprocessing in the loader: filter, per-epoch negative downsampling, global shuffle.

Writes a wide parquet table (numeric, string and variable-length list columns),
then trains a small click model from it. Each epoch the pipeline drops spam
users, keeps every positive and a fresh random 30% of negatives (seeded by the
epoch, so runs repeat), and shuffles globally through RayDataLoader.

``--torch`` runs the same preprocessing the way one writes it for torch's
DataLoader: an IterableDataset that streams pyarrow record batches, filters
them with numpy, and shuffles the file order and the rows of each batch, in 2
persistent worker processes.

    python examples/last_mile_tabular.py --small
    python examples/last_mile_tabular.py --small --torch
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import raydl
from raydl import RayDataLoader

DENSE = 16
NEGATIVE_KEEP = 0.3
BATCH = 1024
SHUFFLE_BUFFER = 16 * BATCH  # torch variant: rows shuffled together before batching


def write_table(root: Path, rows: int, files: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    per_file = rows // files
    for f in range(files):
        n = per_file
        dense = rng.normal(size=(n, DENSE)).astype(np.float32)
        clicked = (dense[:, 0] + 0.5 * dense[:, 1] + rng.normal(scale=0.5, size=n) > 1.2).astype(
            np.int64
        )
        lengths = rng.integers(0, 6, size=n)
        columns = {f"f{i}": dense[:, i] for i in range(DENSE)}
        columns |= {
            "event_id": np.arange(f * per_file, f * per_file + n, dtype=np.int64),
            "user": [f"user{u}" for u in rng.integers(0, 500, size=n)],
            "is_spam": rng.random(n) < 0.05,
            "history": pa.array([list(rng.integers(0, 1000, size=k)) for k in lengths]),
            "clicked": clicked,
        }
        pq.write_table(pa.table(columns), root / f"part-{f:03d}.parquet")


def keep_fraction(event_id: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """A uniform number in [0, 1) per row: a pure function of (event_id, seed, epoch)."""
    mixed = (event_id.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(
        (seed * 1_000_003 + epoch) * 0xBF58476D1CE4E5B9 % 2**64
    )
    mixed ^= mixed >> np.uint64(31)
    mixed *= np.uint64(0x94D049BB133111EB)
    mixed ^= mixed >> np.uint64(29)
    return (mixed >> np.uint64(11)).astype(np.float64) / float(2**53)


def features_of(batch: dict[str, Any], epoch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Positives and a seeded sample of negatives, as (features, clicked) arrays."""
    negative_draw = keep_fraction(np.asarray(batch["event_id"]), seed, epoch)
    clicked = np.asarray(batch["clicked"])
    keep = (clicked == 1) | (negative_draw < NEGATIVE_KEEP)
    dense = np.stack([np.asarray(batch[f"f{i}"]) for i in range(DENSE)], axis=1)
    history_len = np.array([len(h) for h in batch["history"]], dtype=np.float32)
    features = np.concatenate([dense, history_len[:, None]], axis=1)[keep].astype(np.float32)
    return {"features": features, "clicked": clicked[keep].astype(np.float32)}


def epoch_pipeline(table: str, epoch: int, seed: int = 0) -> Any:
    """The epoch's plan: drop spam users, keep positives and a seeded sample of negatives."""
    ds = raydl.read_parquet(table)
    ds = ds.filter(lambda row: not row["is_spam"])
    return ds.map_batches(features_of, fn_kwargs={"epoch": epoch, "seed": seed})


class ClickStream(IterableDataset):
    """torch's way: each worker streams its share of the files, filtering with numpy."""

    def __init__(self, files: list[str], seed: int = 0) -> None:
        self.files = files
        self.seed = seed
        self.epoch = multiprocessing.Value("q", 0)  # shared, so persistent workers see it

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        import pyarrow.compute as pc

        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch = int(self.epoch.value)
        rng = np.random.default_rng([self.seed, epoch, worker])
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.files))
        features, clicked = np.empty((0, DENSE + 1), np.float32), np.empty(0, np.float32)
        for index in order[worker::workers]:
            for record_batch in pq.ParquetFile(self.files[index]).iter_batches(batch_size=8192):
                kept = record_batch.filter(pc.invert(record_batch.column("is_spam")))
                out = features_of(kept.to_pydict(), epoch, self.seed)
                features = np.concatenate([features, out["features"]])
                clicked = np.concatenate([clicked, out["clicked"]])
                if len(clicked) >= SHUFFLE_BUFFER:  # shuffle the buffer, emit full batches
                    perm = rng.permutation(len(clicked))
                    features, clicked = features[perm], clicked[perm]
                    full = len(clicked) - len(clicked) % BATCH
                    yield from self._batches(features[:full], clicked[:full])
                    features, clicked = features[full:], clicked[full:]
        perm = rng.permutation(len(clicked))
        yield from self._batches(features[perm], clicked[perm])

    @staticmethod
    def _batches(features: np.ndarray, clicked: np.ndarray) -> Iterator[dict[str, torch.Tensor]]:
        for start in range(0, len(clicked), BATCH):
            yield {
                "features": torch.from_numpy(features[start : start + BATCH]),
                "clicked": torch.from_numpy(clicked[start : start + BATCH]),
            }


def loaders(table: str, torch_loader: bool) -> tuple[Any, Any]:
    """The loader, and how to tell it the epoch (``None`` when it counts epochs itself)."""
    if not torch_loader:
        pipeline = raydl.PerEpoch(lambda epoch: epoch_pipeline(table, epoch))
        return RayDataLoader(pipeline, batch_size=BATCH, shuffle=True, seed=0), None
    stream = ClickStream(sorted(str(p) for p in Path(table).glob("*.parquet")))
    loader = DataLoader(
        stream,
        batch_size=None,  # the dataset yields ready batches of BATCH rows
        num_workers=2,
        persistent_workers=True,
    )
    return loader, stream.epoch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="CI size: 20k rows, 2 epochs")
    parser.add_argument("--torch", action="store_true", help="use torch's DataLoader instead")
    args = parser.parse_args()
    if args.small:
        args.rows, args.files, args.epochs = 20_000, 4, 2

    with tempfile.TemporaryDirectory(prefix="raydl-tabular-") as tmp:
        write_table(Path(tmp), args.rows, args.files)
        loader, torch_epoch = loaders(tmp, args.torch)
        print(f"{type(loader).__name__}: {args.rows} rows in {args.files} files")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(DENSE + 1, 32), nn.ReLU(), nn.Linear(32, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for epoch in range(args.epochs):
            if torch_epoch is not None:
                torch_epoch.value = epoch
            start, seen, positives, loss_sum = time.perf_counter(), 0, 0.0, 0.0
            for batch in loader:
                logits = model(batch["features"]).squeeze(1)
                loss = nn.functional.binary_cross_entropy_with_logits(logits, batch["clicked"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                seen += len(batch["clicked"])
                positives += float(batch["clicked"].sum())
                loss_sum += loss.item() * len(batch["clicked"])
            took = time.perf_counter() - start
            print(
                f"epoch {epoch}: {seen} rows after filter+downsampling "
                f"({positives / max(seen, 1):.2f} positive) in {took:.2f} s, "
                f"loss {loss_sum / max(seen, 1):.3f}, {seen / took:.0f} samples/s"
            )
        if isinstance(loader, RayDataLoader):
            loader.close()  # also stops the next epoch, which raydl starts before this one ends


if __name__ == "__main__":
    main()
