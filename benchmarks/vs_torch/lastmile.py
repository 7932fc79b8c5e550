"""The workloads' last-mile work, in a module of its own that imports no torch.

A training script keeps its feature code apart from its model code, and the Ray
actors that run this work import only this module: numpy, pyarrow and PIL, no
torch (raydl's direct-path actors then stay lean; docs/design/direct-execution.md, "Lean").
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np
import pyarrow as pa
from PIL import Image

from .config import epoch_seed

# -- tabular -------------------------------------------------------------------------

N_FEATURES = 20
FEATURES = [f"f{j:02d}" for j in range(N_FEATURES)]
NEGATIVE_KEEP = 0.10


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

    Args:
        ids: The rows' ids.
        users: The rows' user ids.
        labels: The rows' labels (1: positive).
        epoch: The epoch whose negative draw applies.
        spam: Per user id, whether the user is a spammer.

    Returns:
        A boolean mask over the rows.
    """
    draw = _mix64(ids.astype(np.uint64) ^ np.uint64(epoch_seed(epoch, stream=7)))
    sampled = (draw >> np.uint64(40)) < np.uint64(int(NEGATIVE_KEEP * (1 << 24)))
    return ~spam[users] & ((labels == 1) | sampled)


def select_rows(table: pa.Table, epoch: int, spam: np.ndarray) -> dict[str, np.ndarray]:
    """The tabular last-mile work on one Arrow table: filter, downsample, stack features.

    Args:
        table: Rows of the generated parquet files.
        epoch: The epoch whose negative draw applies.
        spam: Per user id, whether the user is a spammer.

    Returns:
        The kept rows as ``id``, ``features`` (float32, one column per feature) and ``label``.
    """
    ids = table.column("id").to_numpy()
    labels = table.column("label").to_numpy()
    keep = np.flatnonzero(keep_mask(ids, table.column("user_id").to_numpy(), labels, epoch, spam))
    features = np.empty((keep.size, N_FEATURES), dtype=np.float32)
    for j, name in enumerate(FEATURES):
        features[:, j] = table.column(name).to_numpy()[keep]
    return {"id": ids[keep], "features": features, "label": labels[keep].astype(np.float32)}


def select_block(table: Any, epoch: int, spam: np.ndarray) -> dict[str, np.ndarray]:
    """``select_rows`` as a Ray Data ``map_batches`` function (pyarrow in, numpy out).

    Args:
        table: One Ray Data block (a pyarrow table).
        epoch: The epoch whose negative draw applies.
        spam: Per user id, whether the user is a spammer.

    Returns:
        What ``select_rows`` returns.
    """
    return select_rows(table, epoch, spam)


def select_stage(ds: Any, epoch: int, spam: np.ndarray) -> Any:
    """The tabular last-mile work as a Ray Data stage on ``ds``.

    Args:
        ds: A Ray Data (or raydl) dataset of the parquet rows.
        epoch: The epoch whose negative draw applies.
        spam: Per user id, whether the user is a spammer.

    Returns:
        The dataset with the stage added.
    """
    return ds.map_batches(
        select_block,  # type: ignore[arg-type]  # Ray's stub has no room for fn_kwargs
        batch_format="pyarrow",
        fn_kwargs={"epoch": epoch, "spam": spam},
    )


# -- images --------------------------------------------------------------------------

MEAN, STD = 0.5, 0.25


def decode_jpeg(data: bytes) -> np.ndarray:
    """JPEG bytes -> normalised float32 CHW array.

    Args:
        data: A JPEG file's bytes.

    Returns:
        The image, ``(channels, height, width)``.
    """
    with Image.open(io.BytesIO(data)) as img:
        arr = np.asarray(img, dtype=np.uint8)
    out = (arr.astype(np.float32) * np.float32(1 / 255) - np.float32(MEAN)) / np.float32(STD)
    return out[None] if out.ndim == 2 else np.ascontiguousarray(out.transpose(2, 0, 1))


def image_id(path: str) -> int:
    """The sample id in a generated image's file name (``0000042_7.jpg`` -> 42).

    Args:
        path: The image's path.

    Returns:
        The id.
    """
    return int(os.path.basename(path).split("_", 1)[0])


def decode_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Ray Data ``map_batches`` function: {"bytes", "path"} -> {"image", "id"}.

    Args:
        batch: Files as read by ``read_binary_files(include_paths=True)``.

    Returns:
        The decoded images, stacked, and their ids.
    """
    images = np.stack([decode_jpeg(b) for b in batch["bytes"]])
    ids = np.fromiter((image_id(p) for p in batch["path"]), dtype=np.int64)
    return {"image": images, "id": ids}


def decode_stage(ds: Any, batch_size: int) -> Any:
    """The images' decode as a Ray Data stage on ``ds``.

    Args:
        ds: A Ray Data (or raydl) dataset of ``read_binary_files(include_paths=True)``.
        batch_size: Files per decode call.

    Returns:
        The dataset with the stage added.
    """
    return ds.map_batches(decode_batch, batch_size=batch_size, batch_format="numpy")
