"""raydl's ``RayDataLoader`` side by side with torch's ``DataLoader``, plain Ray Data and one process.

Run::

    python benchmarks/bench_vs_torch.py --quick --out /tmp/bench_quick   # a few minutes
    python benchmarks/bench_vs_torch.py --out /tmp/bench_full            # the full sizes

The script generates its workloads with a fixed seed, then runs every contender in a
fresh subprocess (``--worker CONTENDER WORKLOAD``; the worker prints one JSON line),
in interleaved order: round 1 runs the contenders A B C D, round 2 runs D C B A.
Every contender gets the same CPU budget: torch ``num_workers=2``, Ray ``num_cpus=2``.

Workloads:

* ``tabular``: parquet files (~20 float features, a label, a user id). Last-mile work:
  drop the rows of spam users, keep all positives and 10% of the negatives (a new
  draw each epoch), shuffle, batches of 1024 tensors.
* ``images`` (28x28 grayscale), ``images_rgb224`` (full mode) and ``images_latency``
  (the first 2,000 images through an fsspec filesystem adding per-request latency; full
  mode or ``--latency``): JPEG files decoded, normalised and batched.
* ``mapstyle`` (~50 us numpy ``__getitem__``) and ``mapstyle_decode`` (~1 ms JPEG
  decode, full mode): a map-style torch ``Dataset`` loaded with only the import swapped.

Contenders: ``raydl`` (``RayDataLoader``), ``raydl_global`` (tabular only: global
shuffle), ``torch`` (the idiomatic ``DataLoader``), ``ray`` (plain Ray Data
``iter_torch_batches`` over the same pipeline), ``limit`` (one process, same work,
no IPC).

Per workload x contender: ``samples_per_s`` (delivered samples; median of the timed
epochs of both rounds), ``ttfb_cold_s`` (process start to first batch, Ray start
included), ``ttfb_warm_s`` (``iter()`` to first batch in later epochs), ``peak_mem_mb``
(PSS of the process tree, Ray's processes included), ``stall_fraction`` (share of an
epoch spent outside a simulated training step that consumes at 0.5x the ``limit``
rate: the second of two epochs at that demand, the step's time measured) and
``exactly_once`` (every expected sample id delivered exactly once in every epoch). The run exits 1 when a contender loses or duplicates samples or fails.

Writes ``OUT/results.json``, ``OUT/results.png``, ``OUT/runs.json`` (every
subprocess's raw measurements) and ``OUT/logs/``; prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import logging
import multiprocessing
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from fsspec.implementations.local import LocalFileSystem
from PIL import Image, ImageDraw, ImageFilter
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

SEED = 1234
NUM_CPUS = 2
RESULT_PREFIX = "@@bench-result "
N_FEATURES = 20
FEATURES = [f"f{j:02d}" for j in range(N_FEATURES)]
POSITIVE_RATE = 0.05
NEGATIVE_KEEP = 0.10
SPAM_USER_RATE = 0.02
TABULAR_BATCH = 1024
SHUFFLE_BUFFER = 8192
MEAN, STD = 0.5, 0.25

Batch = Any  # dict[str, Tensor] or a (tensor, ids) tuple, whatever the loader yields


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Sizes:
    """How big each generated workload is."""

    tabular_rows: int
    tabular_files: int
    row_groups_per_file: int
    users: int
    images: int
    images_rgb224: int
    mapstyle_items: int
    mapstyle_decode_items: int
    latency_ms: float = 5.0

    def scaled(self, factor: float) -> Sizes:
        """These sizes times ``factor`` (files and row groups kept), for development runs."""

        def n(x: int) -> int:
            return max(1, int(x * factor)) if x else 0

        return replace(
            self,
            tabular_rows=n(self.tabular_rows),
            users=n(self.users),
            images=n(self.images),
            images_rgb224=n(self.images_rgb224),
            mapstyle_items=n(self.mapstyle_items),
            mapstyle_decode_items=n(self.mapstyle_decode_items),
        )


QUICK = Sizes(
    tabular_rows=1_000_000,
    tabular_files=16,
    row_groups_per_file=4,
    users=20_000,
    images=5_000,
    images_rgb224=0,
    mapstyle_items=20_000,
    mapstyle_decode_items=0,
)
FULL = Sizes(
    tabular_rows=5_000_000,
    tabular_files=64,
    row_groups_per_file=4,
    users=200_000,
    images=60_000,
    images_rgb224=4_000,
    mapstyle_items=100_000,
    mapstyle_decode_items=4_000,
)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a ``--worker`` subprocess needs; passed as JSON on its command line."""

    data_dir: str
    sizes: Sizes
    epochs: int = 3
    # (name, seconds of simulated training per sample); run after the timed epochs.
    stall_steps: list[tuple[str, float]] = field(default_factory=list)
    mapstyle_reps: int = 1
    latency_ms: float = 5.0
    mem_interval_s: float = 0.5


CONTENDERS = {
    "tabular": ["limit", "torch", "ray", "raydl", "raydl_global"],
    "default": ["limit", "torch", "ray", "raydl"],
}


def contenders_for(workload: str) -> list[str]:
    return CONTENDERS.get(workload, CONTENDERS["default"])


# --------------------------------------------------------------------------- pure helpers


def epoch_seed(epoch: int, stream: int = 0) -> int:
    """A 31-bit seed that is a pure function of (SEED, epoch, stream)."""
    return int(np.random.SeedSequence([SEED, epoch, stream]).generate_state(1)[0] >> 1)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, vectorised (uint64 arithmetic wraps)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def keep_mask(
    ids: np.ndarray, users: np.ndarray, labels: np.ndarray, epoch: int, spam: np.ndarray
) -> np.ndarray:
    """Rows to keep: not a spam user, and a positive or one of the epoch's 10% of negatives.

    The negative draw is a counter-based RNG keyed by (row id, epoch seed), so it is the
    same whichever process, file split or batch a row lands in, and new each epoch.
    """
    draw = _mix64(ids.astype(np.uint64) ^ np.uint64(epoch_seed(epoch, stream=7)))
    sampled = (draw >> np.uint64(40)) < np.uint64(int(NEGATIVE_KEEP * (1 << 24)))
    return ~spam[users] & ((labels == 1) | sampled)


def select_rows(table: pa.Table, epoch: int, spam: np.ndarray) -> dict[str, np.ndarray]:
    """The tabular last-mile work on one Arrow table: filter, downsample, stack features."""
    ids = table.column("id").to_numpy()
    labels = table.column("label").to_numpy()
    keep = np.flatnonzero(keep_mask(ids, table.column("user_id").to_numpy(), labels, epoch, spam))
    features = np.empty((keep.size, N_FEATURES), dtype=np.float32)
    for j, name in enumerate(FEATURES):
        features[:, j] = table.column(name).to_numpy()[keep]
    return {"id": ids[keep], "features": features, "label": labels[keep].astype(np.float32)}


def select_block(table: Any, epoch: int, spam: np.ndarray) -> dict[str, np.ndarray]:
    """``select_rows`` as a Ray Data ``map_batches`` function (pyarrow in, numpy out)."""
    return select_rows(table, epoch, spam)


class ShuffleBuffer:
    """A local shuffle buffer over column dicts: holds ``size`` rows, emits random batches."""

    def __init__(self, size: int, batch_size: int, rng: np.random.Generator) -> None:
        self.size = size
        self.batch_size = batch_size
        self.rng = rng
        self._chunks: list[dict[str, np.ndarray]] = []
        self._rows = 0

    def push(self, chunk: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        self._chunks.append(chunk)
        self._rows += len(chunk["id"])
        if self._rows >= self.size + self.batch_size:
            yield from self._emit(keep=self.size)

    def drain(self) -> Iterator[dict[str, np.ndarray]]:
        yield from self._emit(keep=0)

    def _emit(self, keep: int) -> Iterator[dict[str, np.ndarray]]:
        if not self._chunks:
            return
        perm = self.rng.permutation(self._rows)
        pool = {k: np.concatenate([c[k] for c in self._chunks])[perm] for k in self._chunks[0]}
        stop = self._rows - keep
        if keep:
            stop -= stop % self.batch_size
        for start in range(0, stop, self.batch_size):
            end = min(start + self.batch_size, stop)
            yield {k: v[start:end] for k, v in pool.items()}
        self._chunks = [{k: v[stop:] for k, v in pool.items()}] if stop < self._rows else []
        self._rows -= stop


def to_torch(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in batch.items()}


def decode_jpeg(data: bytes) -> np.ndarray:
    """JPEG bytes -> normalised float32 CHW array."""
    with Image.open(io.BytesIO(data)) as img:
        arr = np.asarray(img, dtype=np.uint8)
    out = (arr.astype(np.float32) * np.float32(1 / 255) - np.float32(MEAN)) / np.float32(STD)
    return out[None] if out.ndim == 2 else np.ascontiguousarray(out.transpose(2, 0, 1))


def image_id(path: str) -> int:
    return int(os.path.basename(path).split("_", 1)[0])


def decode_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Ray Data ``map_batches`` function: {"bytes", "path"} -> {"image", "id"}."""
    images = np.stack([decode_jpeg(b) for b in batch["bytes"]])
    ids = np.fromiter((image_id(p) for p in batch["path"]), dtype=np.int64)
    return {"image": images, "id": ids}


class SlowLocalFileSystem(LocalFileSystem):
    """A local fsspec filesystem that sleeps ``latency_s`` per opened file (an object store)."""

    cachable = False

    def __init__(self, latency_s: float = 0.005, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.latency_s = latency_s

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode:
            time.sleep(self.latency_s)
        return super()._open(path, mode=mode, **kwargs)


# --------------------------------------------------------------------------- datasets


class ParquetStream(IterableDataset):
    """The idiomatic torch tabular loader: files sharded over workers, vectorised filtering.

    Each worker reads its share of the epoch's shuffled file order with pyarrow, filters
    whole record batches with numpy and shuffles through a local buffer. The epoch lives
    in shared memory so persistent workers see ``set_epoch``.
    """

    def __init__(self, files: Sequence[str], spam: np.ndarray) -> None:
        self.files = list(files)
        self.spam = spam
        self._epoch = multiprocessing.Value("q", 0)

    def set_epoch(self, epoch: int) -> None:
        self._epoch.value = epoch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch = int(self._epoch.value)
        order = np.random.default_rng(epoch_seed(epoch, 1)).permutation(len(self.files))
        buffer = ShuffleBuffer(
            SHUFFLE_BUFFER, TABULAR_BATCH, np.random.default_rng(epoch_seed(epoch, 10 + worker))
        )
        for index in order[worker::workers]:
            for record_batch in pq.ParquetFile(self.files[index]).iter_batches(batch_size=65_536):
                rows = select_rows(pa.Table.from_batches([record_batch]), epoch, self.spam)
                for batch in buffer.push(rows):
                    yield to_torch(batch)
        for batch in buffer.drain():
            yield to_torch(batch)


class JpegFiles(Dataset):
    """Map-style dataset over JPEG files, read directly or through an fsspec filesystem."""

    def __init__(self, paths: Sequence[str], latency_s: float | None = None) -> None:
        self.paths = list(paths)
        self.fs = SlowLocalFileSystem(latency_s) if latency_s else None

    def __len__(self) -> int:
        return len(self.paths)

    def read(self, index: int) -> bytes:
        if self.fs is not None:
            return bytes(self.fs.cat_file(self.paths[index]))
        with open(self.paths[index], "rb") as f:
            return f.read()

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"image": torch.from_numpy(decode_jpeg(self.read(index))), "id": index}


class NumpyWork(Dataset):
    """Map-style dataset whose ``__getitem__`` does ``reps`` rounds of small numpy work."""

    def __init__(self, n: int, reps: int) -> None:
        self.n = n
        self.reps = reps

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x = np.random.default_rng(index).random(512, dtype=np.float32)
        for _ in range(self.reps):
            x = np.sqrt(x * x + np.float32(0.5))
        return torch.from_numpy(x[:64].copy()), index


class JpegDecodeWork(Dataset):
    """Map-style dataset whose ``__getitem__`` decodes a 224x224 RGB JPEG held in memory."""

    def __init__(self, n: int, blobs: Sequence[bytes]) -> None:
        self.n = n
        self.blobs = list(blobs)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(decode_jpeg(self.blobs[index % len(self.blobs)])), index


def getitems_batch(batch: Any, dataset: Dataset) -> dict[str, np.ndarray]:
    """Ray Data ``map_batches`` function: index batch -> the dataset's samples, stacked."""
    samples = [dataset[int(i)] for i in batch["id"]]
    return {"x": np.stack([s[0].numpy() for s in samples]), "id": batch["id"]}


# --------------------------------------------------------------------------- data generation


def _digit_image(rng: np.random.Generator, digit: int, size: int, rgb: bool) -> Image.Image:
    canvas = Image.new("L", (14, 14), 0)
    ImageDraw.Draw(canvas).text((4, 1), str(digit), fill=255)
    angle = float(rng.uniform(-20, 20))
    img = canvas.rotate(angle, resample=Image.Resampling.BILINEAR).resize((size, size))
    img = img.filter(ImageFilter.GaussianBlur(radius=size / 40))
    arr = np.asarray(img, dtype=np.float32) + rng.normal(0, 12, (size, size))
    gray = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    if not rgb:
        return gray
    tint = rng.uniform(0.5, 1.0, 3)
    return Image.fromarray((np.asarray(gray)[..., None] * tint).astype(np.uint8), "RGB")


def fresh_folder(path: Path) -> Path:
    """An empty folder at ``path``: files of an earlier generation must not count as samples."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def generate(root: Path, sizes: Sizes, workloads: Sequence[str]) -> dict[str, Any]:
    """Write the workloads' files under ``root`` (reused if the manifest matches)."""
    manifest = root / "manifest.json"
    want = {"seed": SEED, "sizes": asdict(sizes), "workloads": sorted(workloads)}
    if manifest.exists() and json.loads(manifest.read_text()) == want:
        print(f"data: reusing {root} (same seed and sizes)")
        return want
    rng = np.random.default_rng(SEED)
    root.mkdir(parents=True, exist_ok=True)
    if "tabular" in workloads:
        out = fresh_folder(root / "tabular")
        spam = np.zeros(sizes.users, dtype=bool)
        spam[rng.choice(sizes.users, int(sizes.users * SPAM_USER_RATE), replace=False)] = True
        np.save(root / "spam_users.npy", spam)
        per_file = sizes.tabular_rows // sizes.tabular_files
        for i in range(sizes.tabular_files):
            ids = np.arange(i * per_file, (i + 1) * per_file, dtype=np.int64)
            columns = {
                "id": ids,
                "user_id": rng.integers(0, sizes.users, per_file, dtype=np.int64),
                "label": (rng.random(per_file) < POSITIVE_RATE).astype(np.int64),
                **{name: rng.standard_normal(per_file, dtype=np.float32) for name in FEATURES},
            }
            pq.write_table(
                pa.table(columns),
                out / f"part-{i:04d}.parquet",
                row_group_size=per_file // sizes.row_groups_per_file,
            )
    for name, count, size, rgb in (
        ("images", sizes.images, 28, False),
        ("images_rgb224", sizes.images_rgb224, 224, True),
    ):
        if count and (name in workloads or (name == "images" and "images_latency" in workloads)):
            out = fresh_folder(root / name)
            for i in range(count):
                digit = int(rng.integers(10))
                _digit_image(rng, digit, size, rgb).save(out / f"{i:07d}_{digit}.jpg", quality=90)
    if "mapstyle_decode" in workloads:
        blobs = fresh_folder(root / "decode_blobs")
        for i in range(64):
            buf = io.BytesIO()
            _digit_image(rng, i % 10, 224, True).save(buf, format="JPEG", quality=90)
            (blobs / f"{i:02d}.jpg").write_bytes(buf.getvalue())
    manifest.write_text(json.dumps(want))
    return want


def calibrate_mapstyle(target_s: float = 50e-6) -> int:
    """Rounds of ``NumpyWork`` work that make one ``__getitem__`` cost about ``target_s``."""
    probe = NumpyWork(2_000, reps=0)
    start = time.perf_counter()
    for i in range(len(probe)):
        probe[i]
    base = (time.perf_counter() - start) / len(probe)
    probe = NumpyWork(2_000, reps=20)
    start = time.perf_counter()
    for i in range(len(probe)):
        probe[i]
    per_rep = ((time.perf_counter() - start) / len(probe) - base) / 20
    return max(0, round((target_s - base) / per_rep))


# --------------------------------------------------------------------------- measurement


def tree_pss_bytes() -> int:
    """PSS of this process and all its descendants (torch workers, raylet, GCS, Ray workers)."""
    import psutil

    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            total += proc.memory_full_info().pss
    return total


class PeakMemory:
    """Samples ``tree_pss_bytes`` on a named background thread; ``stop()`` returns the peak.

    Reading ``smaps_rollup`` of a dozen Ray processes costs real CPU, so the sampler
    waits at least ``MAX_DUTY`` inverse times as long as a sample took: it stays under
    ~2% of one core whatever the number of processes (more processes, sparser samples).
    """

    MAX_DUTY = 0.02

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-pss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            start = time.perf_counter()
            self.peak = max(self.peak, tree_pss_bytes())
            cost = time.perf_counter() - start
            if self._stop.wait(max(self.interval_s, cost / self.MAX_DUTY)):
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_pss_bytes())
        return self.peak


@dataclass
class EpochStats:
    epoch: int
    samples: int
    seconds: float
    ttfb_s: float
    slept_s: float = 0.0
    exactly_once: bool = True

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def stall_fraction(self) -> float:
        return (self.seconds - self.slept_s) / self.seconds


def batch_ids(batch: Batch) -> torch.Tensor:
    return batch["id"] if isinstance(batch, dict) else batch[1]


def run_epoch(
    batches: Iterable[Batch], epoch: int, step_s_per_sample: float = 0.0
) -> tuple[EpochStats, np.ndarray]:
    """Iterate one epoch (optionally sleeping per batch like a training step)."""
    start = time.perf_counter()
    ttfb = -1.0
    ids: list[torch.Tensor] = []
    slept = 0.0
    for batch in batches:
        if ttfb < 0:
            ttfb = time.perf_counter() - start
        b = batch_ids(batch)
        ids.append(b)
        if step_s_per_sample:
            # The step's own time, measured: time.sleep overshoots (and, in a process
            # with busy threads, waits to get the GIL back), and that is the step's
            # time, not the loader's.
            step_start = time.perf_counter()
            time.sleep(len(b) * step_s_per_sample)
            slept += time.perf_counter() - step_start
    seconds = time.perf_counter() - start
    got = torch.cat(ids).numpy() if ids else np.empty(0, dtype=np.int64)
    return EpochStats(epoch, len(got), seconds, ttfb, slept), got


# --------------------------------------------------------------------------- contenders


class Contender:
    """One way to load one workload: ``epoch(e)`` returns the batches of epoch ``e``."""

    def epoch(self, epoch: int) -> Iterable[Batch]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def start_ray() -> None:
    """Start a local Ray limited to NUM_CPUS, quiet, the same way for ``ray`` and ``raydl``."""
    import ray
    from ray.data import DataContext

    # address="local": always a fresh instance of our own, never another user's cluster.
    ray.init(
        address="local",
        num_cpus=NUM_CPUS,
        include_dashboard=False,
        logging_level=logging.WARNING,
    )
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.ERROR)


class FnContender(Contender):
    def __init__(self, fn: Callable[[int], Iterable[Batch]]) -> None:
        self.fn = fn

    def epoch(self, epoch: int) -> Iterable[Batch]:
        return self.fn(epoch)


class TorchLoader(Contender):
    """A torch-style loader (torch or raydl) reused across epochs."""

    def __init__(self, loader: Any, before_epoch: Callable[[int], None] | None = None) -> None:
        self.loader = loader
        self.before_epoch = before_epoch

    def epoch(self, epoch: int) -> Iterable[Batch]:
        if self.before_epoch is not None:
            self.before_epoch(epoch)
        return self.loader

    def close(self) -> None:
        close = getattr(self.loader, "close", None)
        if close is not None:
            close()


def tabular_files(cfg: WorkerConfig) -> list[str]:
    return sorted(str(p) for p in (Path(cfg.data_dir) / "tabular").glob("*.parquet"))


def spam_users(cfg: WorkerConfig) -> np.ndarray:
    return np.load(Path(cfg.data_dir) / "spam_users.npy")


def tabular_contender(name: str, cfg: WorkerConfig) -> Contender:
    files, spam = tabular_files(cfg), spam_users(cfg)
    if name == "limit":

        def limit_epoch(epoch: int) -> Iterator[dict[str, torch.Tensor]]:
            order = np.random.default_rng(epoch_seed(epoch, 1)).permutation(len(files))
            buffer = ShuffleBuffer(
                SHUFFLE_BUFFER, TABULAR_BATCH, np.random.default_rng(epoch_seed(epoch, 10))
            )
            for index in order:
                for batch in buffer.push(select_rows(pq.read_table(files[index]), epoch, spam)):
                    yield to_torch(batch)
            for batch in buffer.drain():
                yield to_torch(batch)

        return FnContender(limit_epoch)
    if name == "torch":
        stream = ParquetStream(files, spam)
        loader = DataLoader(stream, batch_size=None, num_workers=NUM_CPUS, persistent_workers=True)
        return TorchLoader(loader, before_epoch=stream.set_epoch)

    start_ray()
    import ray
    from ray.data import FileShuffleConfig

    def pipeline(epoch: int) -> ray.data.Dataset:
        # Ray's own file shuffle: a new file order per epoch, streaming (no barrier).
        order = FileShuffleConfig(seed=epoch_seed(epoch, 1), reseed_after_execution=False)
        return ray.data.read_parquet(files, shuffle=order).map_batches(
            select_block,  # type: ignore[arg-type]  # Ray's stub has no room for fn_kwargs
            batch_format="pyarrow",
            fn_kwargs={"epoch": epoch, "spam": spam},
        )

    if name == "ray":

        def ray_epoch(epoch: int) -> Iterable[Batch]:
            return pipeline(epoch).iter_torch_batches(
                batch_size=TABULAR_BATCH,
                local_shuffle_buffer_size=SHUFFLE_BUFFER,
                local_shuffle_seed=epoch_seed(epoch, 10),
            )

        return FnContender(ray_epoch)
    import raydl

    # raydl's own reader, and the per-epoch draw as a PerEpoch pipeline: one loader for
    # the whole run, so it can start each epoch while the previous one drains.
    table = raydl.read_parquet(files)
    mode = "global" if name == "raydl_global" else "files"
    loader = raydl.RayDataLoader(
        raydl.PerEpoch(
            lambda epoch: table.map_batches(
                select_block,  # type: ignore[arg-type]  # Ray's stub has no room for fn_kwargs
                batch_format="pyarrow",
                fn_kwargs={"epoch": epoch, "spam": spam},
            )
        ),
        batch_size=TABULAR_BATCH,
        shuffle=True,
        shuffle_mode=mode,
        local_shuffle_buffer_size=SHUFFLE_BUFFER,
        seed=SEED,
    )
    return TorchLoader(loader, before_epoch=loader.set_epoch)


def tabular_expected(cfg: WorkerConfig, epoch: int) -> np.ndarray:
    spam = spam_users(cfg)
    kept = []
    for path in tabular_files(cfg):
        table = pq.read_table(path, columns=["id", "user_id", "label"])
        ids = table.column("id").to_numpy()
        mask = keep_mask(
            ids, table.column("user_id").to_numpy(), table.column("label").to_numpy(), epoch, spam
        )
        kept.append(ids[mask])
    return np.sort(np.concatenate(kept))


IMAGE_BATCH = {"images": 256, "images_latency": 256, "images_rgb224": 64}


#: Files the latency workload reads: every request waits ``latency_ms``, so the full
#: mode's 60,000 images would keep one process reading for 300 s per epoch.
LATENCY_IMAGES = 2_000


def image_paths(cfg: WorkerConfig, workload: str) -> list[str]:
    folder = "images_rgb224" if workload == "images_rgb224" else "images"
    paths = sorted(str(p) for p in (Path(cfg.data_dir) / folder).glob("*.jpg"))
    return paths[:LATENCY_IMAGES] if workload == "images_latency" else paths


def images_contender(name: str, workload: str, cfg: WorkerConfig) -> Contender:
    paths = image_paths(cfg, workload)
    latency_s = cfg.latency_ms / 1000 if workload == "images_latency" else None
    batch_size = IMAGE_BATCH[workload]
    dataset = JpegFiles(paths, latency_s)
    if name == "limit":

        def limit_epoch(epoch: int) -> Iterator[dict[str, torch.Tensor]]:
            order = np.random.default_rng(epoch_seed(epoch, 1)).permutation(len(paths))
            for start in range(0, len(order), batch_size):
                yield default_collate([dataset[int(i)] for i in order[start : start + batch_size]])

        return FnContender(limit_epoch)
    loader_args: dict[str, Any] = {"batch_size": batch_size, "shuffle": True}
    if name == "torch":
        loader = DataLoader(
            dataset,
            num_workers=NUM_CPUS,
            persistent_workers=True,
            generator=torch.Generator().manual_seed(SEED),
            **loader_args,
        )
        return TorchLoader(loader)

    start_ray()
    import pyarrow.fs
    import ray
    from ray.data import FileShuffleConfig

    filesystem = None
    if latency_s is not None:
        filesystem = pyarrow.fs.PyFileSystem(
            pyarrow.fs.FSSpecHandler(SlowLocalFileSystem(latency_s))
        )
    buffer = 4 * batch_size
    if name == "ray":

        def ray_epoch(epoch: int) -> Iterable[Batch]:
            # Ray's own file shuffle (a new file order per epoch) + its local buffer.
            shuffled = ray.data.read_binary_files(
                paths,
                include_paths=True,
                filesystem=filesystem,
                shuffle=FileShuffleConfig(seed=epoch_seed(epoch, 1), reseed_after_execution=False),
            ).map_batches(decode_batch, batch_size=batch_size, batch_format="numpy")
            return shuffled.iter_torch_batches(
                batch_size=batch_size,
                local_shuffle_buffer_size=buffer,
                local_shuffle_seed=epoch_seed(epoch, 10),
            )

        return FnContender(ray_epoch)
    import raydl

    # raydl's own file reader (many files per task), the same decode stage.
    ds = raydl.read_binary_files(paths, include_paths=True, filesystem=filesystem).map_batches(
        decode_batch, batch_size=batch_size, batch_format="numpy"
    )
    raydl_loader = raydl.RayDataLoader(
        ds, shuffle_mode="files", local_shuffle_buffer_size=buffer, seed=SEED, **loader_args
    )
    return TorchLoader(raydl_loader, before_epoch=raydl_loader.set_epoch)


MAPSTYLE_BATCH = {"mapstyle": 256, "mapstyle_decode": 32}


def mapstyle_dataset(workload: str, cfg: WorkerConfig, sizes: Sizes) -> Dataset:
    if workload == "mapstyle":
        return NumpyWork(sizes.mapstyle_items, cfg.mapstyle_reps)
    blobs = [p.read_bytes() for p in sorted((Path(cfg.data_dir) / "decode_blobs").glob("*.jpg"))]
    return JpegDecodeWork(sizes.mapstyle_decode_items, blobs)


def mapstyle_contender(name: str, workload: str, cfg: WorkerConfig, sizes: Sizes) -> Contender:
    dataset = mapstyle_dataset(workload, cfg, sizes)
    n = len(dataset)  # type: ignore[arg-type]
    batch_size = MAPSTYLE_BATCH[workload]
    if name == "limit":

        def limit_epoch(epoch: int) -> Iterator[Batch]:
            order = np.random.default_rng(epoch_seed(epoch, 1)).permutation(n)
            for start in range(0, n, batch_size):
                yield default_collate([dataset[int(i)] for i in order[start : start + batch_size]])

        return FnContender(limit_epoch)
    # The training script's loader call, identical for torch and raydl: only the import differs.
    args: dict[str, Any] = {
        "batch_size": batch_size,
        "shuffle": True,
        "num_workers": NUM_CPUS,
        "persistent_workers": True,
        "generator": torch.Generator().manual_seed(SEED),
    }
    if name == "torch":
        return TorchLoader(DataLoader(dataset, **args))
    start_ray()
    if name == "raydl":
        from raydl import RayDataLoader

        return TorchLoader(RayDataLoader(dataset, **args))
    import ray

    def ray_epoch(epoch: int) -> Iterable[Batch]:
        ds = ray.data.range(n).random_shuffle(seed=epoch_seed(epoch, 1))
        ds = ds.map_batches(
            getitems_batch,  # type: ignore[arg-type]  # Ray's stub has no room for fn_kwargs
            batch_size=batch_size,
            batch_format="numpy",
            fn_kwargs={"dataset": dataset},
        )
        return ds.iter_torch_batches(batch_size=batch_size)

    return FnContender(ray_epoch)


def expected_ids(workload: str, cfg: WorkerConfig, sizes: Sizes, epoch: int) -> np.ndarray:
    if workload == "tabular":
        return tabular_expected(cfg, epoch)
    if workload.startswith("images"):
        return np.array([image_id(p) for p in image_paths(cfg, workload)], dtype=np.int64)
    n = sizes.mapstyle_items if workload == "mapstyle" else sizes.mapstyle_decode_items
    return np.arange(n, dtype=np.int64)


def make_contender(name: str, workload: str, cfg: WorkerConfig, sizes: Sizes) -> Contender:
    if workload == "tabular":
        return tabular_contender(name, cfg)
    if workload.startswith("images"):
        return images_contender(name, workload, cfg)
    return mapstyle_contender(name, workload, cfg, sizes)


def run_worker(name: str, workload: str, cfg: WorkerConfig, sizes: Sizes) -> dict[str, Any]:
    """One contender on one workload: warm-up epoch, timed epochs, stall epochs."""
    process_start = time.perf_counter()
    memory = PeakMemory(cfg.mem_interval_s)
    contender = make_contender(name, workload, cfg, sizes)
    stats: list[EpochStats] = []
    stalls: dict[str, float] = {}
    ttfb_cold = -1.0
    # Each demand runs two epochs and the second is measured: a training loop at that
    # demand is slow in every epoch, while the first one follows a full-speed epoch.
    steps: list[tuple[str, float]] = [("", 0.0)] * (1 + cfg.epochs) + [
        step for step in cfg.stall_steps for _ in range(2)
    ]
    try:
        for epoch, (stall_name, step) in enumerate(steps):
            epoch_stats, got = run_epoch(contender.epoch(epoch), epoch, step)
            if epoch == 0:
                ttfb_cold = time.perf_counter() - process_start - epoch_stats.seconds
                ttfb_cold += epoch_stats.ttfb_s
            want = expected_ids(workload, cfg, sizes, epoch)
            epoch_stats.exactly_once = len(got) == len(want) and bool(
                np.array_equal(np.sort(got), want)
            )
            if not epoch_stats.exactly_once:
                print(
                    f"{name}/{workload} epoch {epoch}: got {len(got)} ids "
                    f"({len(np.unique(got))} distinct), expected {len(want)}",
                    file=sys.stderr,
                )
            stats.append(epoch_stats)
            if stall_name:
                stalls[stall_name] = epoch_stats.stall_fraction
    finally:
        contender.close()
    peak = memory.stop()
    timed = stats[1 : 1 + cfg.epochs]
    return {
        "contender": name,
        "workload": workload,
        "epoch_samples_per_s": [s.samples_per_s for s in timed],
        "epoch_ttfb_s": [s.ttfb_s for s in timed],
        "ttfb_cold_s": ttfb_cold,
        "peak_mem_mb": peak / 2**20,
        "stall_fraction": stalls,
        "exactly_once": all(s.exactly_once for s in stats),
        "epochs": [asdict(s) for s in stats],
    }


# --------------------------------------------------------------------------- orchestration


def versions() -> dict[str, str]:
    import fsspec
    import PIL
    import ray

    import raydl

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "raydl": getattr(raydl, "__version__", "?"),
        "pyarrow": pa.__version__,
        "numpy": np.__version__,
        "pillow": PIL.__version__,
        "fsspec": fsspec.__version__,
    }


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import psutil

    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_at_start": os.getloadavg(),
    }


def raydl_revision() -> str:
    repo = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(repo), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev


def spawn_worker(
    name: str, workload: str, cfg: WorkerConfig, log: Path, timeout_s: float
) -> dict[str, Any]:
    """Run one contender in a fresh interpreter and read its JSON result line."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        name,
        workload,
        "--config",
        json.dumps(asdict(cfg)),
    ]
    env = dict(os.environ, RAY_AUTH_MODE="token")
    env.pop("RAY_ADDRESS", None)
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    with log.open("w") as err:
        try:
            proc = subprocess.run(
                cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s:.0f} s (see {log})"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit code {proc.returncode} (see {log})"}
    result: dict[str, Any] = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["wall_s"] = time.perf_counter() - start
    return result


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Fold the rounds of one workload x contender into the published metrics."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {
            "samples_per_s": None,
            "ttfb_cold_s": None,
            "ttfb_warm_s": None,
            "peak_mem_mb": None,
            "stall_fraction": None,
            "exactly_once": False,
            "error": "; ".join(r["error"] for r in runs),
        }
    stalls = [r["stall_fraction"] for r in ok if r["stall_fraction"]]
    out: dict[str, Any] = {
        "samples_per_s": statistics.median(x for r in ok for x in r["epoch_samples_per_s"]),
        "ttfb_cold_s": statistics.median(r["ttfb_cold_s"] for r in ok),
        "ttfb_warm_s": statistics.median(x for r in ok for x in r["epoch_ttfb_s"]),
        "peak_mem_mb": max(r["peak_mem_mb"] for r in ok),
        "stall_fraction": statistics.median(s["0.5x"] for s in stalls) if stalls else None,
        "exactly_once": len(ok) == len(runs) and all(r["exactly_once"] for r in ok),
    }
    if any("1.0x" in s for s in stalls):
        out["stall_fraction_1x"] = statistics.median(s["1.0x"] for s in stalls if "1.0x" in s)
    if len(ok) < len(runs):
        out["error"] = "; ".join(r["error"] for r in runs if "error" in r)
    return out


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "n/a"


def markdown(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    def fmt(v: Any, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    lines = [
        "| workload | contender | samples/s | ttfb cold s | ttfb warm s | peak MB | stall @0.5x | exactly once |",
        "|---|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for workload, by_name in results.items():
        for name, m in by_name.items():
            lines.append(
                f"| {workload} | {name} | {fmt(m['samples_per_s'], ',.0f')} | "
                f"{fmt(m['ttfb_cold_s'], '.2f')} | {fmt(m['ttfb_warm_s'], '.3f')} | "
                f"{fmt(m['peak_mem_mb'], ',.0f')} | {fmt(m['stall_fraction'], '.1%')} | "
                f"{'yes' if m['exactly_once'] else 'NO'} |"
            )
    lines += ["", "| workload | raydl/torch | raydl/ray | raydl/limit | raydl_global/torch |"]
    lines.append("|---|---:|---:|---:|---:|")
    for workload, by_name in results.items():
        rate = {name: m["samples_per_s"] for name, m in by_name.items()}
        glob = ratio(rate.get("raydl_global"), rate.get("torch")) if "raydl_global" in rate else ""
        lines.append(
            f"| {workload} | {ratio(rate.get('raydl'), rate.get('torch'))} | "
            f"{ratio(rate.get('raydl'), rate.get('ray'))} | "
            f"{ratio(rate.get('raydl'), rate.get('limit'))} | {glob} |"
        )
    return "\n".join(lines)


def chart(results: dict[str, dict[str, dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {
        "raydl": "tab:blue",
        "raydl_global": "tab:cyan",
        "torch": "tab:orange",
        "ray": "tab:green",
        "limit": "tab:gray",
    }
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 4.2), squeeze=False)
    for ax, (workload, by_name) in zip(axes[0], results.items(), strict=True):
        names = list(by_name)
        rates = [by_name[n]["samples_per_s"] or 0.0 for n in names]
        torch_rate = by_name.get("torch", {}).get("samples_per_s")
        bars = ax.bar(names, rates, color=[colours.get(n, "tab:purple") for n in names])
        for bar, rate in zip(bars, rates, strict=True):
            label = f"{rate / torch_rate:.2f}x" if torch_rate and rate else "n/a"
            ax.annotate(
                label,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_title(workload)
        ax.set_ylabel("samples/s")
        ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle(f"{title} (labels: ratio vs torch)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main_parent(args: argparse.Namespace) -> int:
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    mode = "quick" if args.quick else "full"
    sizes = QUICK if args.quick else FULL
    if args.scale != 1.0:
        sizes = sizes.scaled(args.scale)
        mode += f" (scale {args.scale})"
    try:
        import matplotlib  # noqa: F401  # the chart is drawn last: fail before the runs
    except ImportError:
        print(
            "bench_vs_torch.py draws results.png with matplotlib, which is not installed: "
            "python -m pip install -e '.[bench]'",
            file=sys.stderr,
        )
        return 2
    info = versions()
    print(f"command: {command}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    workloads = args.workloads or (
        ["tabular", "images", "mapstyle"] + (["images_latency"] if args.latency else [])
        if args.quick
        else ["tabular", "images", "images_rgb224", "images_latency", "mapstyle", "mapstyle_decode"]
    )
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    data_dir = Path(args.data_dir) if args.data_dir else out / "data"
    start = time.perf_counter()
    generate(data_dir, sizes, workloads)
    print(f"data: generated in {time.perf_counter() - start:.1f} s under {data_dir}")
    reps = calibrate_mapstyle() if "mapstyle" in workloads else 0
    base = WorkerConfig(
        data_dir=str(data_dir),
        sizes=sizes,
        epochs=args.epochs,
        mapstyle_reps=reps,
        latency_ms=sizes.latency_ms,
        mem_interval_s=0.5,
    )
    timeout_s = 300.0 if args.quick else 1800.0
    runs: list[dict[str, Any]] = []
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for workload in workloads:
        names = [n for n in contenders_for(workload) if not args.contenders or n in args.contenders]
        by_name: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        limit_rate: float | None = None
        for round_no, order in ((1, names), (2, names[::-1])):
            for name in order:
                stall_steps: list[tuple[str, float]] = []
                if round_no == 2 and limit_rate:
                    demands = (0.5,) if args.quick else (0.5, 1.0)
                    stall_steps = [(f"{d:.1f}x", 1.0 / (d * limit_rate)) for d in demands]
                cfg = WorkerConfig(**{**asdict(base), "stall_steps": stall_steps})
                log = out / "logs" / f"{workload}-{name}-round{round_no}.log"
                result = spawn_worker(name, workload, cfg, log, timeout_s)
                result.update(round=round_no, contender=name, workload=workload)
                runs.append(result)
                by_name[name].append(result)
                if "error" in result:
                    print(f"  {workload:15s} {name:13s} round {round_no}: FAILED {result['error']}")
                    continue
                rate = statistics.median(result["epoch_samples_per_s"])
                print(
                    f"  {workload:15s} {name:13s} round {round_no}: {rate:12,.0f} samples/s, "
                    f"cold ttfb {result['ttfb_cold_s']:.2f} s, exactly once "
                    f"{result['exactly_once']}, {result['wall_s']:.0f} s"
                )
                if name == "limit" and round_no == 1:
                    limit_rate = rate
        results[workload] = {n: summarise(r) for n, r in by_name.items()}
    machine_info = machine()
    meta = {
        "machine": machine_info,
        "versions": info,
        "raydl_revision": raydl_revision(),
        "mode": mode,
        "command_line": command,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "sizes": asdict(sizes),
        "seed": SEED,
        "cpu_budget": NUM_CPUS,
        "epochs": {"warmup": 1, "timed": args.epochs, "rounds": 2},
        "mapstyle_getitem_reps": reps,
        "samples": "delivered samples (tabular: after the filter and the 10% downsample)",
        "elapsed_s": round(time.perf_counter() - start, 1),
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (out / "runs.json").write_text(json.dumps(runs, indent=2))
    chart(results, out / "results.png", f"raydl vs torch ({mode}, {meta['date']})")
    print()
    print(f"{meta['date']}, {machine_info['cpu']}, {NUM_CPUS} CPUs per contender, {mode}")
    print(markdown(results))
    print(f"\nwrote {out / 'results.json'}, {out / 'results.png'} in {meta['elapsed_s']} s")
    failed = [
        f"{w}/{n}" for w, by in results.items() for n, m in by.items() if not m["exactly_once"]
    ]
    if failed:
        print(f"FAILED (lost/duplicated samples or crashed): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main_worker(args: argparse.Namespace) -> int:
    name, workload = args.worker
    raw = json.loads(args.config)
    raw["stall_steps"] = [tuple(s) for s in raw.get("stall_steps", [])]
    raw["sizes"] = Sizes(**raw["sizes"])
    cfg = WorkerConfig(**raw)
    result = run_worker(name, workload, cfg, cfg.sizes)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes, about 5 minutes")
    parser.add_argument("--out", default="bench_out", help="output folder")
    parser.add_argument("--data-dir", help="where to generate the data (default OUT/data)")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per process")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply sizes (development)")
    parser.add_argument("--latency", action="store_true", help="quick mode: add images_latency")
    parser.add_argument("--workloads", nargs="+", help="run only these workloads")
    parser.add_argument("--contenders", nargs="+", help="run only these contenders")
    parser.add_argument(
        "--worker", nargs=2, metavar=("CONTENDER", "WORKLOAD"), help=argparse.SUPPRESS
    )
    parser.add_argument("--config", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return main_worker(args)
    return main_parent(args)


if __name__ == "__main__":
    if Path(__file__).resolve().parent == Path(sys.path[0]).resolve():
        # Run as a script: re-enter through the importable module so that Ray pickles this
        # file's functions by reference (Ray workers import it via PYTHONPATH).
        import bench_vs_torch

        sys.exit(bench_vs_torch.main())
    sys.exit(main())
