"""The image workloads: JPEG files decoded, normalised and batched.

``images`` holds 28x28 grayscale digits, ``images_rgb224`` 224x224 tinted ones (full
mode) and ``images_latency`` reads the first ``LATENCY_IMAGES`` of ``images`` through
an fsspec filesystem that adds a per-request latency (an object store).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem
from PIL import Image, ImageDraw, ImageFilter
from torch.utils.data import Dataset

from ..config import WorkerConfig
from ..lastmile import decode_jpeg, image_id

#: Files the latency workload reads: every request waits ``latency_ms``, so the full
#: mode's 60,000 images would keep one process reading for 300 s per epoch.
LATENCY_IMAGES = 2_000


class SlowLocalFileSystem(LocalFileSystem):
    """A local fsspec filesystem that sleeps ``latency_s`` per opened file (an object store)."""

    cachable = False

    def __init__(self, latency_s: float = 0.005, **kwargs: Any) -> None:
        """A local filesystem with a latency.

        Args:
            latency_s: Seconds each file opened for reading waits.
            **kwargs: ``LocalFileSystem``'s.
        """
        super().__init__(**kwargs)
        self.latency_s = latency_s

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode:
            time.sleep(self.latency_s)
        return super()._open(path, mode=mode, **kwargs)


class JpegFiles(Dataset):
    """Map-style dataset over JPEG files, read directly or through an fsspec filesystem."""

    def __init__(self, paths: Sequence[str], latency_s: float | None = None) -> None:
        """Index ``paths``.

        Args:
            paths: The JPEG files.
            latency_s: If set, read through a ``SlowLocalFileSystem`` with this latency.
        """
        self.paths = list(paths)
        self.fs = SlowLocalFileSystem(latency_s) if latency_s else None

    def __len__(self) -> int:
        """The number of files."""
        return len(self.paths)

    def read(self, index: int) -> bytes:
        """The bytes of file ``index``.

        Args:
            index: Which file.

        Returns:
            Its bytes.
        """
        if self.fs is not None:
            return bytes(self.fs.cat_file(self.paths[index]))
        with open(self.paths[index], "rb") as f:
            return f.read()

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Sample ``index``: ``{"image": CHW float tensor, "id": index}``."""
        return {"image": torch.from_numpy(decode_jpeg(self.read(index))), "id": index}


@dataclass(frozen=True)
class ImageData:
    """One generated image workload, as a worker finds it."""

    paths: list[str]
    latency_s: float | None
    batch_size: int
    dataset: JpegFiles

    @classmethod
    def load(cls, workload: str, cfg: WorkerConfig, batch_size: int) -> ImageData:
        """The workload's files under ``cfg.data_dir``.

        Args:
            workload: ``images``, ``images_rgb224`` or ``images_latency``.
            cfg: The worker's config.
            batch_size: Samples per batch.

        Returns:
            The workload.
        """
        folder = "images_rgb224" if workload == "images_rgb224" else "images"
        paths = sorted(str(p) for p in (Path(cfg.data_dir) / folder).glob("*.jpg"))
        if workload == "images_latency":
            paths = paths[:LATENCY_IMAGES]
        latency_s = cfg.latency_ms / 1000 if workload == "images_latency" else None
        return cls(paths, latency_s, batch_size, JpegFiles(paths, latency_s))

    @property
    def shuffle_buffer(self) -> int:
        """Rows of the Ray-based contenders' local shuffle buffer."""
        return 4 * self.batch_size

    def arrow_filesystem(self) -> Any:
        """The pyarrow filesystem that Ray's readers get: ``None`` (local) without a latency.

        Returns:
            A ``pyarrow.fs.PyFileSystem`` over a ``SlowLocalFileSystem``, or ``None``.
        """
        if self.latency_s is None:
            return None
        import pyarrow.fs

        return pyarrow.fs.PyFileSystem(
            pyarrow.fs.FSSpecHandler(SlowLocalFileSystem(self.latency_s))
        )

    def expected_ids(self, epoch: int) -> np.ndarray:
        """Every image's id, once (the same each epoch).

        Args:
            epoch: The epoch (unused: every epoch delivers every image).

        Returns:
            The ids.
        """
        return np.array([image_id(p) for p in self.paths], dtype=np.int64)


def digit_image(rng: np.random.Generator, digit: int, size: int, rgb: bool) -> Image.Image:
    """A blurred, rotated, noisy digit, grayscale or tinted RGB.

    Args:
        rng: The generation's random stream.
        digit: Which digit to draw.
        size: Width and height in pixels.
        rgb: Tint it into an RGB image.

    Returns:
        The image.
    """
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


def generate(out: Path, count: int, size: int, rgb: bool, rng: np.random.Generator) -> None:
    """Write ``count`` digit JPEGs named ``{id:07d}_{digit}.jpg`` into ``out``.

    Args:
        out: An empty folder.
        count: How many images.
        size: Width and height in pixels.
        rgb: Tinted RGB rather than grayscale.
        rng: The generation's random stream (shared with the other workloads, in order).
    """
    for i in range(count):
        digit = int(rng.integers(10))
        digit_image(rng, digit, size, rgb).save(out / f"{i:07d}_{digit}.jpg", quality=90)
