"""raydl's global shuffle (the exchange on its actors) against Ray Data's, in one run.

1.2 M rows x 16 float32 + an int64 id in 24 parquet files, ``raydl.read_parquet(...)
.map_batches(f)`` (a filter and one column changed), batch 1024, consumed as fast as the
trainer can. Three loaders, two interleaved rounds, three warm epochs each:
``exchange`` (``shuffle_mode="global"``, the default), ``ray_random_shuffle`` (the same
with ``direct_execution=False``: Ray Data's ``random_shuffle`` per epoch) and ``files``
(file order + local buffer). Prints warm rows/s, the ratio against ``files`` and the
warm time to first batch (medians). Run: ``python benchmarks/global_shuffle_vs_ray.py``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import raydl
from raydl import RayDataLoader

FILES, ROWS_PER_FILE, ROUNDS, WARM_EPOCHS = 24, 50_000, 2, 3
LOADERS: dict[str, dict[str, Any]] = {
    "exchange": {"shuffle_mode": "global"},
    "ray_random_shuffle": {"shuffle_mode": "global", "direct_execution": False},
    "files": {"shuffle_mode": "files"},
}


def last_mile(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Drop a tenth of the rows, change one column."""
    keep = batch["id"] % 10 != 3
    out = {name: column[keep] for name, column in batch.items()}
    out["f0"] = out["f0"] + 1
    return out


def write_files(folder: str) -> None:
    rng = np.random.default_rng(0)
    for i in range(FILES):
        ids = np.arange(i * ROWS_PER_FILE, (i + 1) * ROWS_PER_FILE)
        columns = {f"f{j}": rng.random(ROWS_PER_FILE, dtype=np.float32) for j in range(16)}
        pq.write_table(pa.table({"id": ids, **columns}), f"{folder}/{i:03d}.parquet")


def main() -> None:
    folder = tempfile.mkdtemp()
    write_files(folder)
    raydl.init()
    ds = raydl.read_parquet(folder).map_batches(last_mile, batch_format="numpy")
    rates: dict[str, list[float]] = {name: [] for name in LOADERS}
    firsts: dict[str, list[float]] = {name: [] for name in LOADERS}
    for round_ in range(ROUNDS):
        for name, options in LOADERS.items():
            loader = RayDataLoader(ds, batch_size=1024, shuffle=True, seed=1, **options)
            for epoch in range(1 + WARM_EPOCHS):
                start, rows, first = time.perf_counter(), 0, None
                for batch in loader:
                    if first is None:
                        first = time.perf_counter() - start
                    rows += len(batch["id"])
                if epoch:  # warm epochs only
                    rates[name].append(rows / (time.perf_counter() - start))
                    firsts[name].append(first or 0.0)
            loader.close()
            print(round_, name, [f"{r:,.0f}" for r in rates[name][-WARM_EPOCHS:]], flush=True)
    base = statistics.median(rates["files"])
    print("| loader | warm rows/s | vs files | warm first batch s |")
    for name in LOADERS:
        rate = statistics.median(rates[name])
        first = statistics.median(firsts[name])
        print(f"| {name} | {rate:,.0f} | {rate / base:.2f} | {first:.3f} |")


if __name__ == "__main__":
    main()
