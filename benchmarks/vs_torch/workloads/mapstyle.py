"""The map-style workloads: a torch ``Dataset`` loaded with only the import swapped.

``mapstyle``'s ``__getitem__`` does ~50 us of numpy work (``calibrate_mapstyle`` sets
the rounds); ``mapstyle_decode``'s (full mode) decodes a 224x224 RGB JPEG held in
memory, ~1 ms.
"""

from __future__ import annotations

import io
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..config import WorkerConfig
from ..lastmile import decode_jpeg
from .images import digit_image

BLOBS_FOLDER = "decode_blobs"  # mapstyle_decode's JPEGs, under the data folder
N_BLOBS = 64


class NumpyWork(Dataset):
    """Map-style dataset whose ``__getitem__`` does ``reps`` rounds of small numpy work."""

    def __init__(self, n: int, reps: int) -> None:
        """``n`` samples of ``reps`` rounds each.

        Args:
            n: The dataset's length.
            reps: Rounds of work per ``__getitem__``.
        """
        self.n = n
        self.reps = reps

    def __len__(self) -> int:
        """The number of samples."""
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """Sample ``index``: 64 floats and the index."""
        x = np.random.default_rng(index).random(512, dtype=np.float32)
        for _ in range(self.reps):
            x = np.sqrt(x * x + np.float32(0.5))
        return torch.from_numpy(x[:64].copy()), index


class JpegDecodeWork(Dataset):
    """Map-style dataset whose ``__getitem__`` decodes a 224x224 RGB JPEG held in memory."""

    def __init__(self, n: int, blobs: Sequence[bytes]) -> None:
        """``n`` samples cycling over ``blobs``.

        Args:
            n: The dataset's length.
            blobs: JPEG files' bytes.
        """
        self.n = n
        self.blobs = list(blobs)

    def __len__(self) -> int:
        """The number of samples."""
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """Sample ``index``: the decoded image and the index."""
        return torch.from_numpy(decode_jpeg(self.blobs[index % len(self.blobs)])), index


def getitems_batch(batch: Any, dataset: Dataset) -> dict[str, np.ndarray]:
    """Ray Data ``map_batches`` function: index batch -> the dataset's samples, stacked.

    Args:
        batch: A numpy batch with the sample indices in ``id``.
        dataset: The map-style dataset.

    Returns:
        The samples' tensors stacked as ``x``, and their ``id``.
    """
    samples = [dataset[int(i)] for i in batch["id"]]
    return {"x": np.stack([s[0].numpy() for s in samples]), "id": batch["id"]}


@dataclass(frozen=True)
class MapStyleData:
    """One map-style workload, as a worker builds it."""

    dataset: Dataset
    batch_size: int

    @classmethod
    def load(cls, workload: str, cfg: WorkerConfig, batch_size: int) -> MapStyleData:
        """The workload's dataset (``mapstyle_decode`` reads its JPEGs into memory).

        Args:
            workload: ``mapstyle`` or ``mapstyle_decode``.
            cfg: The worker's config.
            batch_size: Samples per batch.

        Returns:
            The workload.
        """
        if workload == "mapstyle":
            return cls(NumpyWork(cfg.sizes.mapstyle_items, cfg.mapstyle_reps), batch_size)
        paths = sorted((Path(cfg.data_dir) / BLOBS_FOLDER).glob("*.jpg"))
        blobs = [p.read_bytes() for p in paths]
        return cls(JpegDecodeWork(cfg.sizes.mapstyle_decode_items, blobs), batch_size)

    @property
    def n(self) -> int:
        """The dataset's length."""
        return len(self.dataset)  # type: ignore[arg-type]

    def expected_ids(self, epoch: int) -> np.ndarray:
        """Every index of the dataset, once.

        Args:
            epoch: The epoch (unused: every epoch delivers every sample).

        Returns:
            ``0 .. n - 1``.
        """
        return np.arange(self.n, dtype=np.int64)


def calibrate_mapstyle(target_s: float = 50e-6) -> int:
    """Rounds of ``NumpyWork`` work that make one ``__getitem__`` cost about ``target_s``.

    Args:
        target_s: The wanted cost of one ``__getitem__``, in seconds.

    Returns:
        The rounds (at least 0).
    """
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


def generate_blobs(out: Path, rng: np.random.Generator) -> None:
    """Write ``mapstyle_decode``'s ``N_BLOBS`` 224x224 RGB JPEGs into ``out``.

    Args:
        out: An empty folder.
        rng: The generation's random stream (shared with the other workloads, in order).
    """
    for i in range(N_BLOBS):
        buf = io.BytesIO()
        digit_image(rng, i % 10, 224, True).save(buf, format="JPEG", quality=90)
        (out / f"{i:02d}.jpg").write_bytes(buf.getvalue())
