"""The workloads: their registry, their data generation and how a worker loads one.

One module per kind of workload (``tabular``, ``images``, ``mapstyle``) holds its
last-mile work, its torch datasets, its data generation and a ``*Data`` class: what a
worker loads (``load``) and the ids every epoch must deliver (``expected_ids``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import SEED, Sizes, WorkerConfig
from . import images, mapstyle, tabular
from .images import ImageData
from .mapstyle import MapStyleData, calibrate_mapstyle
from .tabular import TabularData

WorkloadData = TabularData | ImageData | MapStyleData


@dataclass(frozen=True)
class Workload:
    """One workload: its name, the kind of data it loads and its batch size."""

    name: str
    data: type[TabularData] | type[ImageData] | type[MapStyleData]
    batch_size: int

    def load(self, cfg: WorkerConfig) -> WorkloadData:
        """The workload's data under ``cfg.data_dir``, ready for a contender.

        Args:
            cfg: The worker's config.

        Returns:
            The loaded workload.
        """
        return self.data.load(self.name, cfg, self.batch_size)


WORKLOADS = {
    w.name: w
    for w in (
        Workload("tabular", TabularData, tabular.TABULAR_BATCH),
        Workload("images", ImageData, 256),
        Workload("images_rgb224", ImageData, 64),
        Workload("images_latency", ImageData, 256),
        Workload("mapstyle", MapStyleData, 256),
        Workload("mapstyle_decode", MapStyleData, 32),
    )
}
QUICK_WORKLOADS = ["tabular", "images", "mapstyle"]


def default_workloads(quick: bool, latency: bool) -> list[str]:
    """The workloads a run without ``--workloads`` runs.

    Args:
        quick: Quick mode (otherwise full mode: every workload).
        latency: In quick mode, add ``images_latency``.

    Returns:
        The workloads' names, in run order.
    """
    if not quick:
        return list(WORKLOADS)
    return QUICK_WORKLOADS + (["images_latency"] if latency else [])


def fresh_folder(path: Path) -> Path:
    """An empty folder at ``path``: files of an earlier generation must not count as samples.

    Args:
        path: The folder (removed first if it exists).

    Returns:
        ``path``.
    """
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def generate(root: Path, sizes: Sizes, workloads: Sequence[str]) -> dict[str, Any]:
    """Write the workloads' files under ``root`` (reused if the manifest matches).

    Every workload draws from one random stream seeded with ``SEED``, in a fixed order.

    Args:
        root: The data folder.
        sizes: How big each workload is.
        workloads: The workloads to write files for.

    Returns:
        The manifest: seed, sizes and workloads.
    """
    manifest = root / "manifest.json"
    want = {"seed": SEED, "sizes": asdict(sizes), "workloads": sorted(workloads)}
    if manifest.exists() and json.loads(manifest.read_text()) == want:
        print(f"data: reusing {root} (same seed and sizes)")
        return want
    rng = np.random.default_rng(SEED)
    root.mkdir(parents=True, exist_ok=True)
    if "tabular" in workloads:
        tabular.generate(fresh_folder(root / tabular.FOLDER), root / tabular.SPAM_FILE, sizes, rng)
    for name, count, size, rgb in (
        ("images", sizes.images, 28, False),
        ("images_rgb224", sizes.images_rgb224, 224, True),
    ):
        if count and (name in workloads or (name == "images" and "images_latency" in workloads)):
            images.generate(fresh_folder(root / name), count, size, rgb, rng)
    if "mapstyle_decode" in workloads:
        mapstyle.generate_blobs(fresh_folder(root / mapstyle.BLOBS_FOLDER), rng)
    manifest.write_text(json.dumps(want))
    return want


__all__ = [
    "WORKLOADS",
    "ImageData",
    "MapStyleData",
    "TabularData",
    "Workload",
    "WorkloadData",
    "calibrate_mapstyle",
    "default_workloads",
    "generate",
]
