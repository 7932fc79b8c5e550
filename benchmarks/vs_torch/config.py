"""What every part of the benchmark shares: the seed, the CPU budget, sizes, a worker's config."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

SEED = 1234
NUM_CPUS = 2
RESULT_PREFIX = "@@bench-result "

#: The folder that holds the entry script and this package: on the workers' PYTHONPATH,
#: so that Ray's workers import this package's functions by reference.
BENCH_DIR = Path(__file__).resolve().parents[1]
SCRIPT = BENCH_DIR / "bench_vs_torch.py"

Batch = Any  # dict[str, Tensor] or a (tensor, ids) tuple, whatever the loader yields


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
        """These sizes times ``factor`` (files and row groups kept), for development runs.

        Args:
            factor: What to multiply every count by (a non-zero count stays at least 1).

        Returns:
            The scaled sizes.
        """

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
    images_rgb224=256,  # not in the default quick set; small enough for --workloads
    mapstyle_items=20_000,
    mapstyle_decode_items=512,
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

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> WorkerConfig:
        """The config that ``dataclasses.asdict`` turned into ``raw`` (JSON-decoded).

        Args:
            raw: The decoded JSON object.

        Returns:
            The config, with its nested ``Sizes`` and tuples restored.
        """
        raw = dict(raw)
        raw["stall_steps"] = [tuple(s) for s in raw.get("stall_steps", [])]
        raw["sizes"] = Sizes(**raw["sizes"])
        return cls(**raw)


def epoch_seed(epoch: int, stream: int = 0) -> int:
    """A 31-bit seed that is a pure function of (SEED, epoch, stream).

    Args:
        epoch: The epoch.
        stream: Which of the epoch's independent random streams.

    Returns:
        The seed.
    """
    return int(np.random.SeedSequence([SEED, epoch, stream]).generate_state(1)[0] >> 1)


def worker_env() -> dict[str, str]:
    """The environment of a worker subprocess (or of ``torchrun`` and its ranks).

    Ray token authentication on, no inherited ``RAY_ADDRESS`` (every run starts its own
    Ray), and ``BENCH_DIR`` first on ``PYTHONPATH``.

    Returns:
        The environment.
    """
    env = dict(os.environ, RAY_AUTH_MODE="token")
    env.pop("RAY_ADDRESS", None)
    here = str(BENCH_DIR)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env
