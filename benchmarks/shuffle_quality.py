"""How close each shuffle mode's order is to a uniform random permutation.

24 parquet files x 50,000 rows (row ``i`` in file ``i // 50000``), read with
``raydl.read_parquet``, batch 1024, three epochs per mode. Two figures per mode:

* **files per window**: the mean number of distinct source files in each window of
  :data:`WINDOW` consecutive rows of the epoch, over what a uniform permutation gives in
  expectation (1.00: as mixed as a true shuffle; the expectation is exact, from the
  hypergeometric law of each file's absence). A window smaller than a batch keeps the
  figure from saturating (a batch of 1024 rows of a uniform order holds all 24 files);
* **KS distance** of the first batch's ids from the uniform distribution over the epoch
  (a uniform batch of 1024 rows gives about 0.027 on average; a batch drawn from a few
  files gives far more).

Run: ``python benchmarks/shuffle_quality.py`` (about a minute).
"""

from __future__ import annotations

import math
import statistics
import tempfile
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import raydl

FILES, ROWS_PER_FILE, BATCH, EPOCHS = 24, 50_000, 1024, 3
WINDOW = 32
MODES: dict[str, dict[str, Any]] = {
    "global (exchange on raydl's actors)": {"shuffle_mode": "global"},
    "global (Ray Data random_shuffle)": {"shuffle_mode": "global", "direct_execution": False},
    "files (file order + local buffer)": {"shuffle_mode": "files"},
    "blocks (block order + local buffer)": {"shuffle_mode": "blocks"},
}


def expected_files_per_batch(total: int, per_file: int, files: int, batch: int) -> float:
    """E[distinct files in ``batch`` rows drawn uniformly without replacement]."""
    log_absent = sum(math.log((total - per_file - i) / (total - i)) for i in range(batch))
    return files * (1.0 - math.exp(log_absent))


def ks_uniform(ids: np.ndarray, total: int) -> float:
    """Kolmogorov-Smirnov distance of ``ids / total`` from the uniform distribution on [0, 1)."""
    x = np.sort(ids) / total
    n = len(x)
    upper = np.arange(1, n + 1) / n - x
    lower = x - np.arange(n) / n
    return float(max(upper.max(), lower.max()))


def main() -> None:
    folder = tempfile.mkdtemp()
    for i in range(FILES):
        ids = np.arange(i * ROWS_PER_FILE, (i + 1) * ROWS_PER_FILE)
        pq.write_table(pa.table({"id": ids}), f"{folder}/{i:03d}.parquet")
    total = FILES * ROWS_PER_FILE
    uniform = expected_files_per_batch(total, ROWS_PER_FILE, FILES, WINDOW)
    raydl.init()
    ds = raydl.read_parquet(folder)
    print(f"a uniform permutation: {uniform:.2f} files per window of {WINDOW} rows")
    print("| mode | files per window / uniform | KS of the first batch (mean) |")
    print("|---|---:|---:|")
    for name, options in MODES.items():
        loader = raydl.RayDataLoader(ds, batch_size=BATCH, shuffle=True, seed=3, **options)
        spreads, distances = [], []
        for _ in range(EPOCHS):
            batches = [batch["id"].numpy() for batch in loader]
            stream = np.concatenate(batches)
            windows = stream[: len(stream) // WINDOW * WINDOW].reshape(-1, WINDOW) // ROWS_PER_FILE
            spreads.append(float(np.mean([len(np.unique(w)) for w in windows])))
            distances.append(ks_uniform(batches[0], total))
        loader.close()
        spread = statistics.mean(spreads) / uniform
        print(f"| {name} | {spread:.2f} | {statistics.mean(distances):.3f} |", flush=True)


if __name__ == "__main__":
    main()
