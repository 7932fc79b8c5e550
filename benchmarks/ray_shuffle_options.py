"""Ray Data's own options for a per-epoch global shuffle of a tabular parquet pipeline.

The job: ``--rows`` rows (default 1.2 M) of 16 float32 columns plus an int64 ``id``
column in 24 parquet files (written here with pyarrow, seed 0, in a temp folder), read
with ``ray.data.read_parquet(folder).map_batches(last_mile, batch_format="numpy")``
(adds 1 to one column, drops rows whose ``id % 10 == 3``), then per epoch shuffled and
consumed in full by this one process with
``iter_batches(batch_size=1024, batch_format="numpy")``.

An option is ``LAYOUT/SHUFFLE``. The layout is how the files become blocks:

* ``v2``: the defaults. Ray 2.60's DataSourceV2 parquet reader bin-packs files into
  128 MiB read units and ignores ``override_num_blocks`` / ``read_op_min_num_blocks``,
  so this job is read as ONE block (one read task);
* ``v2x24`` / ``v2x8``: DataSourceV2 with ``RAY_DATA_PARQUET_BIN_PACKING_BYTES``
  lowered so the read makes 24 / 8 blocks;
* ``v1x24``: the legacy reader (``DataContext.use_datasource_v2 = False``) with
  ``override_num_blocks=24``.

The shuffle:

* ``files``: none, files order (the baseline of its layout);
* ``blocks_local``: ``randomize_block_order(seed=epoch)`` and
  ``local_shuffle_buffer_size=8192`` (a partial shuffle: the cheap alternative);
* ``random_shuffle``: ``random_shuffle(seed=epoch)`` under the default
  ``DataContext.shuffle_strategy`` (``SHUFFLE_V2``, which ``random_shuffle`` plans
  as the pull-based sort shuffle); ``_push``: ``SORT_SHUFFLE_PUSH_BASED``; ``_hash``:
  ``HASH_SHUFFLE`` (accepted, but also planned pull-based); ``_preserve``: with
  ``execution_options.preserve_order = True``;
* ``key_hash_actors`` / ``key_shuffle_v2``: a global shuffle built on Ray's hash
  shuffle: a random key ``splitmix64(id ^ splitmix64(epoch))``,
  ``repartition(24, keys=[key])``, then each block sorted by the key (rows land in
  iid uniform partitions, ordered by an iid key inside each: a uniform permutation),
  under ``HASH_SHUFFLE`` (aggregator actors) or ``SHUFFLE_V2`` (map/reduce tasks).

A plain run measures ``DEFAULT_OPTIONS``; ``--options`` picks any. Per option and
round: one first epoch (epoch 0, "cold": the option's first execution, Ray already
running), then ``--warm-epochs`` warm ones, on a base dataset built once per round.
Options run interleaved (A B C A B C) for ``--rounds`` rounds in one Ray instance
(``num_cpus=2``). Reported per option: the median warm-epoch rows/s over all rounds,
its ratio to ``files`` of the same layout and to ``v2/files`` (both measured in the
same run), the time from ``iter()`` to the first batch (cold: epoch 0; warm: median of
the warm epochs), the peak PSS of the process tree (this process and all of Ray's)
during the option's epochs, how mixed the batches are (mean distinct source files per
batch: 24 for a global shuffle of 24 files, about 1 for files order), and whether the
same seed gave the same order in every round. Every epoch is checked for lost or
duplicated rows (row count and id sum). Run time, on a shared 2-core machine at load
average 7-18: ``--rows 480000`` 9-11 minutes, ``--rows 240000`` 11 (per-epoch fixed
costs dominate, so fewer rows barely help); 1.2 M rows roughly 20. ``--quick`` ~2.

    python benchmarks/ray_shuffle_options.py [--quick] [--rows N] [--rounds R]
        [--warm-epochs E] [--options v2/files,v2x24/random_shuffle,...] [--out DIR]

Writes ``OUT/results.json`` (default ``bench_out/ray_shuffle_options``; every epoch's
measurements) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from vs_torch.measurement import PeakMemory

NUM_FILES = 24
NUM_COLUMNS = 16
BATCH_SIZE = 1024
LOCAL_BUFFER = 8192
KEY_PARTITIONS = 24
KEY = "_shuffle_key"

Batch = dict[str, np.ndarray]


# ---------------------------------------------------------------------------
# Data and the per-row work
# ---------------------------------------------------------------------------


def write_files(folder: Path, rows: int) -> None:
    """Write ``rows`` rows (16 float32 columns and ``id``) in 24 parquet files, seed 0."""
    rng = np.random.default_rng(0)
    for f in range(NUM_FILES):
        ids = np.arange(f * rows // NUM_FILES, (f + 1) * rows // NUM_FILES, dtype=np.int64)
        cols: dict[str, Any] = {
            f"c{i}": rng.standard_normal(len(ids), dtype=np.float32) for i in range(NUM_COLUMNS)
        }
        cols["id"] = ids
        pq.write_table(pa.table(cols), folder / f"part-{f:02d}.parquet")


def last_mile(batch: Batch) -> Batch:
    """The pipeline's cheap numpy step: add 1 to ``c0``, keep rows whose id % 10 != 3."""
    batch["c0"] = batch["c0"] + 1
    keep = batch["id"] % 10 != 3
    return {k: v[keep] for k, v in batch.items()}


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def add_key(batch: Batch, seed: int) -> Batch:
    """Add a random key that is a pure function of (id, seed)."""
    salt = _splitmix64(np.array([seed], dtype=np.uint64))[0]
    batch[KEY] = _splitmix64(batch["id"].astype(np.uint64) ^ salt).view(np.int64)
    return batch


def sort_by_key(batch: Batch) -> Batch:
    """Order one reduced block by its random key, then drop the key."""
    order = np.argsort(batch.pop(KEY), kind="stable")
    return {k: v[order] for k, v in batch.items()}


# ---------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How the parquet files become blocks (the read side of the pipeline).

    Ray 2.60's default parquet reader (DataSourceV2) bin-packs files into read
    units of ``RAY_DATA_PARQUET_BIN_PACKING_BYTES`` (128 MiB) and ignores
    ``override_num_blocks`` / ``read_op_min_num_blocks``, so this job's ~80 MB read
    is one block unless the bin size is lowered. ``bin_fraction`` sets the bin to
    that fraction of the job's in-memory bytes (the env var is read when
    ``read_parquet`` is called). ``v2=False`` is the legacy reader
    (``DataContext.use_datasource_v2 = False``), which honours ``override_num_blocks``.
    """

    name: str
    v2: bool = True
    bin_fraction: float | None = None
    read_blocks: int | None = None


LAYOUTS = {
    layout.name: layout
    for layout in [
        Layout("v2"),  # the defaults: one block for this job
        Layout("v2x24", bin_fraction=1.2 / NUM_FILES),  # one file per block
        Layout("v2x8", bin_fraction=4.6 / NUM_FILES),  # 8 blocks of 3 files
        Layout("v1x24", v2=False, read_blocks=NUM_FILES),
    ]
}


@dataclass(frozen=True)
class Option:
    """One way of shuffling per epoch, with the read layout and DataContext it runs under."""

    layout: str
    kind: str  # "files" | "blocks_local" | "random_shuffle" | "key"
    variant: str = ""  # a suffix for the name
    strategy: str | None = None  # a ShuffleStrategy value; None keeps the default
    preserve_order: bool = False

    @property
    def name(self) -> str:
        return f"{self.layout}/{self.kind}" + (f"_{self.variant}" if self.variant else "")


OPTIONS = {
    o.name: o
    for o in [
        Option("v2", "files"),
        Option("v2", "random_shuffle"),
        Option("v2x24", "files"),
        Option("v2x24", "blocks_local"),
        Option("v2x24", "random_shuffle"),
        Option("v2x24", "random_shuffle", "push", strategy="sort_shuffle_push_based"),
        Option("v2x24", "random_shuffle", "hash", strategy="hash_shuffle"),
        Option("v2x24", "random_shuffle", "preserve", preserve_order=True),
        Option("v2x8", "random_shuffle"),
        Option("v2x24", "key", "hash_actors", strategy="hash_shuffle"),
        Option("v2x24", "key", "shuffle_v2", strategy="shuffle_v2"),
        Option("v1x24", "files"),
        Option("v1x24", "random_shuffle"),
    ]
}

#: What a plain run measures (the others: ``--options``); sized to stay under ~8 minutes.
DEFAULT_OPTIONS = [
    "v2/files",
    "v2/random_shuffle",
    "v2x24/files",
    "v2x24/blocks_local",
    "v2x24/random_shuffle",
    "v2x24/random_shuffle_push",
    "v2x24/random_shuffle_preserve",
    "v2x8/random_shuffle",
    "v1x24/files",
    "v1x24/random_shuffle",
]

BIN_ENV = "RAY_DATA_PARQUET_BIN_PACKING_BYTES"


@contextlib.contextmanager
def context_for(option: Option, job_bytes: int) -> Iterator[None]:
    """Apply the option's DataContext settings and env; restore the previous ones afterwards."""
    from ray.data import DataContext

    layout = LAYOUTS[option.layout]
    ctx = DataContext.get_current()
    saved = (ctx.shuffle_strategy, ctx.execution_options.preserve_order, ctx.use_datasource_v2)
    saved_env = os.environ.get(BIN_ENV)
    try:
        if option.strategy is not None:
            ctx.shuffle_strategy = option.strategy
        ctx.execution_options.preserve_order = option.preserve_order
        ctx.use_datasource_v2 = layout.v2
        if layout.bin_fraction is not None:
            os.environ[BIN_ENV] = str(int(job_bytes * layout.bin_fraction))
        yield
    finally:
        strategy, ctx.execution_options.preserve_order, ctx.use_datasource_v2 = saved
        ctx.shuffle_strategy = strategy
        if saved_env is None:
            os.environ.pop(BIN_ENV, None)
        else:
            os.environ[BIN_ENV] = saved_env


def base_dataset(folder: Path, option: Option) -> Any:
    """``read_parquet(folder).map_batches(last_mile)``, built under the option's context."""
    import ray

    read_blocks = LAYOUTS[option.layout].read_blocks
    return ray.data.read_parquet(str(folder), override_num_blocks=read_blocks).map_batches(
        last_mile, batch_format="numpy"
    )


def epoch_dataset(base: Any, option: Option, epoch: int) -> tuple[Any, dict[str, Any]]:
    """The dataset one epoch iterates, and the extra ``iter_batches`` arguments."""
    if option.kind == "files":
        return base, {}
    if option.kind == "blocks_local":
        return base.randomize_block_order(seed=epoch), {
            "local_shuffle_buffer_size": LOCAL_BUFFER,
            "local_shuffle_seed": epoch,
        }
    if option.kind == "random_shuffle":
        return base.random_shuffle(seed=epoch), {}
    if option.kind == "key":
        ds = (
            base.map_batches(add_key, batch_format="numpy", fn_kwargs={"seed": epoch})
            .repartition(KEY_PARTITIONS, keys=[KEY])
            .map_batches(sort_by_key, batch_format="numpy", batch_size=None)
        )
        return ds, {}
    raise ValueError(
        f"option kind must be one of files, blocks_local, random_shuffle, key; got {option.kind!r}"
    )


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------


# The benchmark's own process-tree PSS sampler (``vs_torch/measurement.py``).


@dataclass
class Expected:
    rows: int
    id_sum: int
    per_file: int
    job_bytes: int  # in-memory bytes of what is read (16 float32 + 1 int64 per row)


@dataclass
class EpochResult:
    epoch: int
    rows: int
    seconds: float
    first_batch_s: float
    rows_per_s: float
    files_per_batch: float
    order_digest: str
    ok: bool


@dataclass
class RunResult:
    option: str
    round: int
    build_s: float = 0.0
    peak_pss_mb: float | None = None
    epochs: list[EpochResult] = field(default_factory=list)
    error: str | None = None


def run_epoch(ds: Any, iter_kwargs: dict[str, Any], epoch: int, expected: Expected) -> EpochResult:
    """Consume one epoch in full; time it and check it lost or duplicated no row."""
    ids: list[np.ndarray] = []
    files = 0
    start = time.perf_counter()
    batches = iter(ds.iter_batches(batch_size=BATCH_SIZE, batch_format="numpy", **iter_kwargs))
    first_batch_s = None
    for batch in batches:
        if first_batch_s is None:
            first_batch_s = time.perf_counter() - start
        batch_ids = batch["id"]
        ids.append(batch_ids.copy())
        files += np.unique(batch_ids // expected.per_file).size
    seconds = time.perf_counter() - start
    all_ids = np.concatenate(ids) if ids else np.empty(0, dtype=np.int64)
    rows = int(all_ids.size)
    return EpochResult(
        epoch=epoch,
        rows=rows,
        seconds=seconds,
        first_batch_s=first_batch_s if first_batch_s is not None else seconds,
        rows_per_s=rows / seconds,
        files_per_batch=files / max(1, len(ids)),
        order_digest=hashlib.sha1(all_ids.tobytes()).hexdigest()[:12],
        ok=rows == expected.rows and int(all_ids.sum()) == expected.id_sum,
    )


def run_option(
    folder: Path, option: Option, rnd: int, warm_epochs: int, expected: Expected
) -> RunResult:
    """One round of one option: a cold epoch and ``warm_epochs`` warm ones."""
    result = RunResult(option.name, rnd)
    memory = PeakMemory()
    try:
        with context_for(option, expected.job_bytes):
            start = time.perf_counter()
            base = base_dataset(folder, option)
            result.build_s = time.perf_counter() - start
            for epoch in range(1 + warm_epochs):
                ds, iter_kwargs = epoch_dataset(base, option, epoch)
                result.epochs.append(run_epoch(ds, iter_kwargs, epoch, expected))
    except Exception as exc:  # report and go on with the other options
        result.error = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        result.peak_pss_mb = memory.stop() / 2**20
    return result


# ---------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: list[RunResult], names: list[str]) -> dict[str, dict[str, Any]]:
    """Per option: medians over rounds, the ratio to ``files``, checks."""
    summary: dict[str, dict[str, Any]] = {}
    for name in names:
        mine = [r for r in runs if r.option == name]
        warm = [e for r in mine for e in r.epochs if e.epoch > 0]
        cold = [e for r in mine for e in r.epochs if e.epoch == 0]
        digests: dict[int, set[str]] = {}
        for r in mine:
            for e in r.epochs:
                digests.setdefault(e.epoch, set()).add(e.order_digest)
        rounds_done = sum(1 for r in mine if r.error is None)
        summary[name] = {
            "warm_rows_per_s": _median([e.rows_per_s for e in warm]),
            "warm_rows_per_s_all": [round(e.rows_per_s) for e in warm],
            "first_batch_warm_s": _median([e.first_batch_s for e in warm]),
            "first_batch_cold_s": _median([e.first_batch_s for e in cold]),
            "cold_epoch_s": _median([e.seconds for e in cold]),
            "peak_pss_mb": max((r.peak_pss_mb or 0.0 for r in mine), default=None),
            "files_per_batch": _median([e.files_per_batch for e in warm + cold]),
            "same_order_every_round": (
                all(len(d) == 1 for d in digests.values()) if rounds_done > 1 else None
            ),
            "distinct_orders_per_epoch": len({e.order_digest for e in warm}) == len(warm),
            "exactly_once": all(e.ok for r in mine for e in r.epochs),
            "errors": sorted({r.error for r in mine if r.error}),
        }
    v2_base = summary.get("v2/files", {}).get("warm_rows_per_s")
    for name, row in summary.items():
        layout = OPTIONS[name].layout
        base = summary.get(f"{layout}/files", {}).get("warm_rows_per_s")
        rate = row["warm_rows_per_s"]
        row["ratio_vs_files"] = rate / base if rate and base else None
        row["ratio_vs_v2_files"] = rate / v2_base if rate and v2_base else None
    return summary


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table(summary: dict[str, dict[str, Any]], blocks: dict[str, int]) -> str:
    """The markdown table the run prints."""
    lines = [
        "| option | blocks | warm rows/s | vs files (same layout) | vs v2/files "
        "| first batch warm s | first batch cold s | peak PSS MB | files/batch "
        "| same order each round | exactly once |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, row in summary.items():
        nblocks = blocks.get(OPTIONS[name].layout)
        if row["warm_rows_per_s"] is None:
            errors = "; ".join(row["errors"])[:300]
            lines.append(f"| {name} | {nblocks} | failed: {errors} |||||||||")
            continue
        lines.append(
            f"| {name} | {nblocks} | {row['warm_rows_per_s']:,.0f} "
            f"| {_fmt(row['ratio_vs_files'], '.2f')} | {_fmt(row['ratio_vs_v2_files'], '.2f')} "
            f"| {_fmt(row['first_batch_warm_s'], '.2f')} | {_fmt(row['first_batch_cold_s'], '.2f')} "
            f"| {_fmt(row['peak_pss_mb'], '.0f')} | {_fmt(row['files_per_batch'], '.1f')} "
            f"| {row['same_order_every_round']} | {row['exactly_once']} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def start_ray() -> dict[str, Any]:
    """Start one quiet local Ray instance (2 CPUs) and return what the run used."""
    import ray
    from ray.data import DataContext

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    return {
        "ray": ray.__version__,
        "default_shuffle_strategy": str(ctx.shuffle_strategy.value),
        "use_push_based_shuffle": ctx.use_push_based_shuffle,
        "target_max_block_size": ctx.target_max_block_size,
        "read_op_min_num_blocks": ctx.read_op_min_num_blocks,
        "preserve_order": ctx.execution_options.preserve_order,
        "cluster": {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")},
    }


def count_read_blocks(folder: Path, layout: str, job_bytes: int) -> int:
    """How many blocks ``read_parquet(...).map_batches(...)`` makes under a layout."""
    probe = Option(layout, "files")
    with context_for(probe, job_bytes):
        return int(base_dataset(folder, probe).materialize().num_blocks())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_200_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warm-epochs", type=int, default=3)
    parser.add_argument(
        "--options",
        default=",".join(DEFAULT_OPTIONS),
        help=f"comma-separated names, of: {', '.join(OPTIONS)}",
    )
    parser.add_argument("--quick", action="store_true", help="120 k rows, 1 round, 1 warm epoch")
    parser.add_argument("--out", type=Path, default=Path("bench_out/ray_shuffle_options"))
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.rounds, args.warm_epochs = 120_000, 1, 1
    names = [n.strip() for n in args.options.split(",") if n.strip()]
    unknown = [n for n in names if n not in OPTIONS]
    if unknown:
        parser.error(f"--options: unknown {unknown!r}; known: {', '.join(OPTIONS)}")

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ray_shuffle_options_") as tmp:
        folder = Path(tmp)
        write_files(folder, args.rows)
        kept = np.arange(args.rows, dtype=np.int64)
        kept = kept[kept % 10 != 3]
        expected = Expected(
            int(kept.size),
            int(kept.sum()),
            args.rows // NUM_FILES,
            args.rows * (NUM_COLUMNS * 4 + 8),
        )
        setup = start_ray()
        layouts = sorted({OPTIONS[n].layout for n in names})
        setup["blocks_per_layout"] = {
            layout: count_read_blocks(folder, layout, expected.job_bytes) for layout in layouts
        }
        print(json.dumps(setup), flush=True)

        runs: list[RunResult] = []
        for rnd in range(args.rounds):
            for name in names:
                run = run_option(folder, OPTIONS[name], rnd, args.warm_epochs, expected)
                runs.append(run)
                rates = ", ".join(f"{e.rows_per_s:,.0f}" for e in run.epochs)
                print(
                    f"round {rnd} {name:28s} rows/s per epoch [{rates}] "
                    f"first batch {[round(e.first_batch_s, 2) for e in run.epochs]} "
                    f"peak PSS {run.peak_pss_mb:.0f} MB"
                    + (f" ERROR {run.error}" if run.error else ""),
                    flush=True,
                )

    summary = summarize(runs, names)
    report: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "args": {k: str(v) for k, v in vars(args).items()},
        "setup": setup,
        "expected_rows_per_epoch": expected.rows,
        "wall_s": time.perf_counter() - started,
        "summary": summary,
        "runs": [
            {
                **{k: v for k, v in vars(r).items() if k != "epochs"},
                "epochs": [vars(e) for e in r.epochs],
            }
            for r in runs
        ],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    print(table(summary, setup["blocks_per_layout"]))
    print(f"wall {report['wall_s']:.0f} s; wrote {args.out / 'results.json'}")
    lost = [n for n, row in summary.items() if not row["exactly_once"]]
    if lost:
        print(f"lost or duplicated rows (or failed) in: {', '.join(lost)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
