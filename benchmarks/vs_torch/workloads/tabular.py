"""The ``tabular`` workload: parquet rows filtered, downsampled, shuffled and batched.

The files hold ~20 float features, a label and a user id. The last-mile work drops the
rows of spam users and keeps all positives and 10% of the negatives (a new draw each
epoch); every contender then shuffles through a local buffer into batches of 1024.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..config import Sizes, WorkerConfig, epoch_seed
from ..lastmile import FEATURES, keep_mask, select_rows

POSITIVE_RATE = 0.05
SPAM_USER_RATE = 0.02
TABULAR_BATCH = 1024
SHUFFLE_BUFFER = 8192
FOLDER = "tabular"  # the parquet files, under the data folder
SPAM_FILE = "spam_users.npy"  # per user id, whether the user is a spammer


class ShuffleBuffer:
    """A local shuffle buffer over column dicts: holds ``size`` rows, emits random batches."""

    def __init__(self, size: int, batch_size: int, rng: np.random.Generator) -> None:
        """Start empty.

        Args:
            size: Rows the buffer keeps back while it is fed.
            batch_size: Rows per emitted batch.
            rng: Draws the permutations.
        """
        self.size = size
        self.batch_size = batch_size
        self.rng = rng
        self._chunks: list[dict[str, np.ndarray]] = []
        self._rows = 0

    def push(self, chunk: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        """Add ``chunk``; yields full batches once over ``size`` rows are held.

        Args:
            chunk: Columns of equal length, with an ``id`` column.

        Yields:
            Shuffled batches of ``batch_size`` rows.
        """
        self._chunks.append(chunk)
        self._rows += len(chunk["id"])
        if self._rows >= self.size + self.batch_size:
            yield from self._emit(keep=self.size)

    def drain(self) -> Iterator[dict[str, np.ndarray]]:
        """Yield every held row, shuffled (the last batch may be short).

        Yields:
            Shuffled batches.
        """
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
    """The batch's columns as tensors sharing their memory.

    Args:
        batch: Numpy columns.

    Returns:
        The same columns as tensors.
    """
    return {k: torch.from_numpy(v) for k, v in batch.items()}


def stream_shard(
    n_files: int, epoch: int, *, rank: int, world_size: int, worker: int, workers: int
) -> np.ndarray:
    """The files one ``ParquetStream`` worker reads in ``epoch``, in its reading order.

    The epoch's shuffled file order is split over the ranks first, as a
    ``DistributedSampler`` splits its shuffled indices (rank ``r`` takes positions
    ``r, r + world_size, ...``), then over the rank's ``DataLoader`` workers the same way.

    Args:
        n_files: How many files there are.
        epoch: The epoch (it seeds the file order).
        rank: The process's rank.
        world_size: How many ranks there are.
        worker: The worker's id within the rank's ``DataLoader``.
        workers: The rank's ``num_workers`` (1 without workers).

    Returns:
        Indices into the file list.
    """
    order = np.random.default_rng(epoch_seed(epoch, 1)).permutation(n_files)
    return order[rank::world_size][worker::workers]


class ParquetStream(IterableDataset):
    """The idiomatic torch tabular loader: files sharded over ranks and workers, numpy filters.

    Each worker reads its share (``stream_shard``) of the epoch's shuffled file order
    with pyarrow, filters whole record batches with numpy and shuffles through a local
    buffer. The epoch lives in shared memory so persistent workers see ``set_epoch``.
    """

    def __init__(
        self, files: Sequence[str], spam: np.ndarray, *, rank: int = 0, world_size: int = 1
    ) -> None:
        """Hold the files; the epoch starts at 0.

        Args:
            files: The parquet files.
            spam: Per user id, whether the user is a spammer.
            rank: This process's rank (its share of the files, as a ``DistributedSampler``).
            world_size: How many ranks share the files.
        """
        self.files = list(files)
        self.spam = spam
        self.rank = rank
        self.world_size = world_size
        self._epoch = multiprocessing.Value("q", 0)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` (in every worker) run ``epoch``.

        Args:
            epoch: The epoch.
        """
        self._epoch.value = epoch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """This worker's batches of the current epoch.

        Yields:
            Batches of ``TABULAR_BATCH`` rows (the last of each worker may be short).
        """
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch = int(self._epoch.value)
        shard = stream_shard(
            len(self.files),
            epoch,
            rank=self.rank,
            world_size=self.world_size,
            worker=worker,
            workers=workers,
        )
        # One buffer seed per (rank, worker); rank 0's are those of a single process.
        stream = 10 + self.rank * workers + worker
        buffer = ShuffleBuffer(
            SHUFFLE_BUFFER, TABULAR_BATCH, np.random.default_rng(epoch_seed(epoch, stream))
        )
        for index in shard:
            for record_batch in pq.ParquetFile(self.files[index]).iter_batches(batch_size=65_536):
                rows = select_rows(pa.Table.from_batches([record_batch]), epoch, self.spam)
                for batch in buffer.push(rows):
                    yield to_torch(batch)
        for batch in buffer.drain():
            yield to_torch(batch)


@dataclass(frozen=True)
class TabularData:
    """The generated tabular workload, as a worker finds it."""

    files: list[str]
    spam: np.ndarray
    batch_size: int

    @classmethod
    def load(cls, workload: str, cfg: WorkerConfig, batch_size: int) -> TabularData:
        """The files and the spam users under ``cfg.data_dir``.

        Args:
            workload: ``tabular``.
            cfg: The worker's config.
            batch_size: Rows per batch.

        Returns:
            The workload.
        """
        root = Path(cfg.data_dir)
        files = sorted(str(p) for p in (root / FOLDER).glob("*.parquet"))
        return cls(files, np.load(root / SPAM_FILE), batch_size)

    def expected_ids(self, epoch: int, files: Sequence[int] | None = None) -> np.ndarray:
        """Every row id the filter and the epoch's draw keep, sorted.

        Args:
            epoch: The epoch.
            files: Only these files (indices into ``files``); default all of them.

        Returns:
            The ids.
        """
        kept = [np.empty(0, dtype=np.int64)]
        for index in range(len(self.files)) if files is None else files:
            table = pq.read_table(self.files[index], columns=["id", "user_id", "label"])
            ids = table.column("id").to_numpy()
            users, labels = table.column("user_id").to_numpy(), table.column("label").to_numpy()
            kept.append(ids[keep_mask(ids, users, labels, epoch, self.spam)])
        return np.sort(np.concatenate(kept))


def generate(out: Path, spam_path: Path, sizes: Sizes, rng: np.random.Generator) -> None:
    """Write the spam users to ``spam_path`` and the parquet files into ``out``.

    Args:
        out: An empty folder for the parquet files.
        spam_path: Where to save the spam users (``.npy``).
        sizes: How many rows, files, row groups and users.
        rng: The generation's random stream (shared with the other workloads, in order).
    """
    spam = np.zeros(sizes.users, dtype=bool)
    spam[rng.choice(sizes.users, int(sizes.users * SPAM_USER_RATE), replace=False)] = True
    np.save(spam_path, spam)
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
