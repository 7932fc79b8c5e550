"""Last-mile preprocessing in the loader: filter, per-epoch negative downsampling, global shuffle.

Writes a wide parquet table (numeric, string and variable-length list columns),
then trains a small click model from it. Each epoch the pipeline drops spam
users, keeps every positive and a fresh random 30% of negatives (seeded by the
epoch, so runs repeat), and shuffles globally through RayDataLoader.

    python examples/last_mile_tabular.py --small
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

import raydl
from raydl import RayDataLoader

DENSE = 16
NEGATIVE_KEEP = 0.3


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


def epoch_pipeline(table: str, epoch: int, seed: int = 0) -> object:
    """The epoch's plan: drop spam users, keep positives and a seeded sample of negatives."""

    def downsample(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        negative_draw = keep_fraction(batch["event_id"], seed, epoch)
        keep = (batch["clicked"] == 1) | (negative_draw < NEGATIVE_KEEP)
        dense = np.stack([batch[f"f{i}"] for i in range(DENSE)], axis=1)
        history_len = np.array([len(h) for h in batch["history"]], dtype=np.float32)
        features = np.concatenate([dense, history_len[:, None]], axis=1)[keep].astype(np.float32)
        return {"features": features, "clicked": batch["clicked"][keep].astype(np.float32)}

    ds = raydl.read_parquet(table)
    ds = ds.filter(lambda row: not row["is_spam"])
    return ds.map_batches(downsample)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="CI size: 20k rows, 2 epochs")
    args = parser.parse_args()
    if args.small:
        args.rows, args.files, args.epochs = 20_000, 4, 2

    with tempfile.TemporaryDirectory(prefix="raydl-tabular-") as tmp:
        write_table(Path(tmp), args.rows, args.files)
        model = nn.Sequential(nn.Linear(DENSE + 1, 32), nn.ReLU(), nn.Linear(32, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for epoch in range(args.epochs):
            loader = RayDataLoader(epoch_pipeline(tmp, epoch), batch_size=1024, shuffle=True)
            loader.set_epoch(epoch)
            start, seen, positives, loss_sum = time.perf_counter(), 0, 0.0, 0.0
            for batch in loader:
                logits = model(batch["features"]).squeeze(1)
                loss = nn.functional.binary_cross_entropy_with_logits(logits, batch["clicked"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                seen += len(batch["clicked"])
                positives += float(batch["clicked"].sum())
                loss_sum += float(loss) * len(batch["clicked"])
            took = time.perf_counter() - start
            print(
                f"epoch {epoch}: {seen} rows after filter+downsampling "
                f"({positives / max(seen, 1):.2f} positive), loss {loss_sum / max(seen, 1):.3f}, "
                f"{seen / took:.0f} samples/s"
            )


if __name__ == "__main__":
    main()
