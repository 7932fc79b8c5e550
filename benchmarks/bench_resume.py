"""What a mid-epoch resume costs, per source kind.

For each kind, one process and one warm Ray instance:

* ``full``: a new loader's whole epoch (its start-up included);
* ``half``: in an uninterrupted epoch, the time from the middle batch to the end;
* ``resume``: a new loader, ``load_state_dict`` of the state saved at the middle
  batch, then iterating to the end of the epoch (what a restarted job pays).

``resume / half`` near 1 means the resume costs nothing beyond the data left;
above 1 is the price of the start-up (``full - 2 * half`` roughly) and of
re-creating the skipped part. An HF ``datasets`` iterable dataset (``Stateful``) is
resumed from each worker's saved state; it is timed against torchdata's
``StatefulDataLoader`` on the same data. Map-style datasets
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


def hf_iterable(rows: int, shards: int) -> Any:
    """An HF ``datasets`` iterable dataset (``Stateful``) with a little work per row."""
    import datasets

    rng = np.random.default_rng(0)
    table = pa.table({"id": np.arange(rows), "x": list(rng.random((rows, 32), dtype=np.float32))})
    source = datasets.Dataset(table).to_iterable_dataset(num_shards=shards)
    return source.map(lambda row: {"x": np.cumsum(row["x"]).astype(np.float32)})


def measure_hf(name: str, make: Callable[[], Any], rows: int) -> dict[str, Any]:
    """A resumed HF iterable epoch: a new loader, ``load_state_dict``, to the epoch's end.

    ``make`` builds either contender; each of the ``rows`` samples must arrive exactly
    once across the two halves.
    """
    warm = make()
    total = sum(1 for _ in warm)  # warm-up: workers, imports, file cache
    _close(warm)
    fresh = make()
    start = time.perf_counter()
    sum(1 for _ in fresh)
    full = time.perf_counter() - start
    _close(fresh)
    middle = total // 2
    loader = make()
    it = iter(loader)
    seen = [int(i) for _ in range(middle) for i in next(it)["id"]]
    state = loader.state_dict()
    _close(loader)
    resumed = make()
    start = time.perf_counter()
    resumed.load_state_dict(state)
    rest = [int(i) for batch in resumed for i in batch["id"]]
    resume = time.perf_counter() - start
    _close(resumed)
    ids = seen + rest
    if len(ids) != len(set(ids)) or len(ids) != rows:
        raise SystemExit(f"{name}: {len(ids)} samples ({len(set(ids))} distinct), not {rows}")
    row = {"kind": name, "batches": total, "full_s": full, "resume_s": resume}
    print(f"| {name} | {total} | {middle} | {full:.2f} | {resume:.2f} |")
    return row


def _close(loader: Any) -> None:
    close = getattr(loader, "close", None)
    if close is not None:
        close()


def hf_contenders(rows: int) -> list[dict[str, Any]]:
    """torchdata's ``StatefulDataLoader`` and raydl on the same HF iterable dataset.

    torchdata runs first, before this process starts Ray: torch's forked workers beside
    a Ray driver can crash Ray's raylet (README, "Where raydl differs from torch").
    """
    from torchdata.stateful_dataloader import StatefulDataLoader

    print(
        "| loader | batches/epoch | resumed at batch | fresh full epoch (s) | resume to end (s) |"
    )
    print("|---|---:|---:|---:|---:|")
    rows_out = [
        measure_hf(
            "torchdata StatefulDataLoader",
            lambda: StatefulDataLoader(hf_iterable(rows, 4), batch_size=64, num_workers=2),
            rows,
        )
    ]
    raydl.init()
    rows_out.append(
        measure_hf(
            "raydl RayDataLoader",
            lambda: raydl.RayDataLoader(
                hf_iterable(rows, 4), batch_size=64, num_workers=2, persistent_workers=True
            ),
            rows,
        )
    )
    ratio = rows_out[1]["resume_s"] / rows_out[0]["resume_s"]
    print(f"raydl / torchdata, resumed HF epoch: {ratio:.2f}x (target <= 1.5x)")
    rows_out.append({"kind": "hf resume ratio raydl/torchdata", "ratio": ratio})
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (~1 minute)")
    parser.add_argument("--out", type=Path, help="write results.json here")
    args = parser.parse_args()
    print("command:", " ".join([sys.executable, *sys.argv]))
    n = 40_000 if args.quick else 200_000
    rows = 1_000_000 if args.quick else 5_000_000
    hf = hf_contenders(20_000 if args.quick else 100_000)
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
        (args.out / "results.json").write_text(json.dumps(hf + results, indent=2))


if __name__ == "__main__":
    main()
