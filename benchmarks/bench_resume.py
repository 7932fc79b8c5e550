"""What a mid-epoch resume costs, per source kind.

For each kind, one process and one warm Ray instance:

* ``full``: a new loader's whole epoch (its start-up included);
* ``half``: in an uninterrupted epoch, the time from the middle batch to the end;
* ``resume``: a new loader, ``load_state_dict`` of the state saved at the middle
  batch, then iterating to the end of the epoch (what a restarted job pays).

``resume / half`` near 1 means the resume costs nothing beyond the data left;
above 1 is the price of the start-up (``full - 2 * half`` roughly) and of
re-creating the skipped part. Map-style datasets
skip indices without fetching them; iterable datasets and Ray Data pipelines
re-produce the skipped batches (Ray Data's order is a function of (seed, epoch),
so the skipped part runs through the pipeline again).

    python benchmarks/bench_resume.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset, IterableDataset

import raydl


class Decode(Dataset[np.ndarray]):
    """A map-style dataset whose ``__getitem__`` costs ~50 us of numpy work."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        rng = np.random.default_rng(index)
        return rng.random(256, dtype=np.float32).cumsum()


class Stream(IterableDataset[np.ndarray]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        workers, me = (info.num_workers, info.id) if info else (1, 0)
        for index in range(me, self.n, workers):
            yield np.random.default_rng(index).random(256, dtype=np.float32).cumsum()


def last_mile(batch: dict[str, np.ndarray], epoch: int) -> dict[str, np.ndarray]:
    keep = (batch["user"] % 50 != 0) & (
        (batch["label"] == 1) | ((batch["id"] * 2654435761 + epoch) % 10 == 0)
    )
    return {k: v[keep] for k, v in batch.items()}


def parquet_pipeline(root: Path, rows: int) -> raydl.PerEpoch:
    rng = np.random.default_rng(0)
    for f in range(8):
        ids = np.arange(f * rows // 8, (f + 1) * rows // 8)
        cols = {f"x{i}": rng.random(len(ids), dtype=np.float32) for i in range(16)}
        cols |= {"id": ids, "user": ids % 997, "label": (rng.random(len(ids)) < 0.2).astype(int)}
        pq.write_table(pa.table(cols), root / f"part-{f}.parquet")
    table = raydl.read_parquet(str(root))
    return raydl.PerEpoch(
        lambda epoch: table.map_batches(
            last_mile, fn_kwargs={"epoch": epoch}, batch_format="numpy", batch_size=None
        )
    )


def measure(name: str, make: Callable[[], raydl.RayDataLoader]) -> dict[str, Any]:
    warm = make()
    total = sum(1 for _ in warm)  # warm-up epoch 0: Ray, workers, file cache
    warm.close()
    fresh = make()
    fresh.set_epoch(1)
    start = time.perf_counter()
    sum(1 for _ in fresh)
    full = time.perf_counter() - start
    fresh.close()
    middle = total // 2
    loader = make()
    loader.set_epoch(1)
    it = iter(loader)
    for _ in range(middle):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    start = time.perf_counter()
    rest = sum(1 for _ in it)
    half = time.perf_counter() - start
    loader.close()
    resumed = make()
    start = time.perf_counter()
    resumed.load_state_dict(state)
    again = sum(1 for _ in resumed)
    resume = time.perf_counter() - start
    resumed.close()
    if again != rest:
        raise SystemExit(f"{name}: resumed {again} batches, expected {rest}")
    row = {"kind": name, "batches": total, "full_s": full, "half_s": half, "resume_s": resume}
    row["ratio"] = resume / half
    print(
        f"| {name} | {total} | {middle} | {full:.2f} | {half:.2f} | {resume:.2f} "
        f"| {row['ratio']:.2f} |"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (~1 minute)")
    parser.add_argument("--out", type=Path, help="write results.json here")
    args = parser.parse_args()
    print("command:", " ".join([sys.executable, *sys.argv]))
    n = 40_000 if args.quick else 200_000
    rows = 1_000_000 if args.quick else 5_000_000
    raydl.init()
    print(
        "| source | batches/epoch | resumed at batch | fresh full epoch (s) "
        "| second half (s) | resume to end (s) | resume / half |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        pipeline = parquet_pipeline(Path(tmp), rows)
        results = [
            measure(
                "map-style",
                lambda: raydl.RayDataLoader(
                    Decode(n),
                    batch_size=64,
                    shuffle=True,
                    num_workers=2,
                    seed=0,
                    generator=torch.Generator().manual_seed(0),
                ),
            ),
            measure(
                "iterable",
                lambda: raydl.RayDataLoader(Stream(n), batch_size=64, num_workers=2),
            ),
            measure(
                "ray-data parquet (filter + downsample + global shuffle)",
                lambda: raydl.RayDataLoader(pipeline, batch_size=1024, shuffle=True, seed=0),
            ),
        ]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
