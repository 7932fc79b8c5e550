"""Data-stall counters: how long the training loop waited inside ``next()``.

One :class:`EpochStats` per epoch iterator; the iterator updates it on every
``next()`` (two ``perf_counter`` calls and a few additions), the loader keeps
them and sums them in :meth:`raydl.RayDataLoader.stats`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger("raydl")


def batch_len(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor/array (1 if there is none)."""
    if isinstance(batch, torch.Tensor) and batch.is_nested:
        return batch.size(0)  # a nested tensor has no .shape
    if isinstance(batch, torch.Tensor) or hasattr(batch, "shape"):
        shape = batch.shape
        return int(shape[0]) if len(shape) else 1
    if isinstance(batch, Mapping):
        for value in batch.values():
            return batch_len(value)
    if isinstance(batch, Sequence) and not isinstance(batch, str) and batch:
        return batch_len(batch[0])
    return 1


@dataclass
class EpochStats:
    """Counters of one epoch; ``wait_s`` is the time spent inside ``next()``."""

    epoch: int
    started: float = field(default_factory=time.perf_counter)
    batches: int = 0
    samples: int = 0
    wait_s: float = 0.0
    first_batch_s: float | None = None
    ended: float | None = None
    ray_data: str | None = None  # Ray Data's per-stage summary of the epoch's execution

    def record(self, batch: Any, waited: float) -> None:
        """Count one delivered batch that took ``waited`` seconds to arrive."""
        self.batches += 1
        self.samples += batch_len(batch)
        self.wait_s += waited
        if self.first_batch_s is None:
            self.first_batch_s = time.perf_counter() - self.started

    def finish(self) -> None:
        """Mark the end of the epoch (exhausted or closed)."""
        if self.ended is None:
            self.ended = time.perf_counter()

    def as_dict(self) -> dict[str, Any]:
        """The figures a user reads: counts, seconds, stall fraction and throughput."""
        elapsed = (self.ended or time.perf_counter()) - self.started
        return {
            "epoch": self.epoch,
            "batches": self.batches,
            "samples": self.samples,
            "elapsed_s": elapsed,
            "wait_s": self.wait_s,
            "stall_fraction": self.wait_s / elapsed if elapsed > 0 else 0.0,
            "time_to_first_batch_s": self.first_batch_s,
            "samples_per_s": self.samples / elapsed if elapsed > 0 else 0.0,
            "ray_data": self.ray_data,
        }

    def summary_line(self) -> str:
        """One line for a log: the epoch's counts, throughput and stall."""
        d = self.as_dict()
        first = d["time_to_first_batch_s"]
        return (
            f"epoch {d['epoch']}: {d['batches']} batches, {d['samples']} samples in "
            f"{d['elapsed_s']:.2f} s ({d['samples_per_s']:.0f} samples/s); waited "
            f"{d['wait_s']:.2f} s for data ({100 * d['stall_fraction']:.1f}% stall), "
            f"first batch after {first if first is not None else float('nan'):.3f} s"
        )


def summarize(epochs: Sequence[EpochStats]) -> dict[str, Any]:
    """Per-epoch figures plus their totals."""
    per_epoch = [e.as_dict() for e in epochs]
    elapsed = sum(e["elapsed_s"] for e in per_epoch)
    wait = sum(e["wait_s"] for e in per_epoch)
    samples = sum(e["samples"] for e in per_epoch)
    return {
        "epochs": per_epoch,
        "total": {
            "epochs": len(per_epoch),
            "batches": sum(e["batches"] for e in per_epoch),
            "samples": samples,
            "elapsed_s": elapsed,
            "wait_s": wait,
            "stall_fraction": wait / elapsed if elapsed > 0 else 0.0,
            "samples_per_s": samples / elapsed if elapsed > 0 else 0.0,
        },
    }
