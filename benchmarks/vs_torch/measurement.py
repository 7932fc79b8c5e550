"""What a worker measures, and how the rounds fold into the published metrics.

In a worker: throughput per epoch, time to first batch (cold: process start to the first
batch, Ray start included; warm: ``iter()`` to the first batch), the peak PSS of the
process tree, the stall fraction under a simulated training step, and whether every
expected sample id arrived exactly once in every epoch.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from .config import Batch, WorkerConfig
from .contenders import contender
from .workloads import WORKLOADS


def process_kind(proc: Any, me: Any) -> str:
    """What a process of the tree is, for the peak-memory breakdown.

    Ray names its workers ``ray::<Actor or task>`` (``ray::IDLE`` before any work) and
    its Python services by script (``monitor.py``, ``log_monitor.py``, ``dashboard.py``,
    ``agent.py``); torch's workers are forks of the measuring process.
    """
    if proc.pid == me.pid:
        return "driver"
    try:
        cmdline = proc.cmdline()
    except Exception:  # the process ended meanwhile
        return "gone"
    if cmdline == me.cmdline():
        return "torch worker"
    head = cmdline[0] if cmdline else proc.name()
    if head.startswith("ray::"):
        return head.split()[0]
    for arg in cmdline[:3]:
        name = arg.rsplit("/", 1)[-1]
        if name in {"gcs_server", "raylet"} or name.endswith(".py"):
            return name
    return proc.name()


def tree_pss(by_kind: dict[str, int] | None = None) -> int:
    """PSS of this process and all its descendants (torch workers, raylet, GCS, Ray workers).

    Args:
        by_kind: When given, filled with the PSS per :func:`process_kind`.

    Returns:
        The sum, in bytes.
    """
    import psutil

    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pss = proc.memory_full_info().pss
            total += pss
            if by_kind is not None:
                kind = process_kind(proc, me)
                by_kind[kind] = by_kind.get(kind, 0) + pss
    return total


class PeakMemory:
    """Samples ``tree_pss`` on a named background thread; ``stop()`` returns the peak.

    ``by_kind`` is the peak sample's breakdown per process kind (bytes).

    Reading ``smaps_rollup`` of a dozen Ray processes costs real CPU, so the sampler
    waits at least ``MAX_DUTY`` inverse times as long as a sample took: it stays under
    ~2% of one core whatever the number of processes (more processes, sparser samples).
    """

    MAX_DUTY = 0.02

    def __init__(self, interval_s: float) -> None:
        """Start sampling.

        Args:
            interval_s: The shortest wait between two samples.
        """
        self.interval_s = interval_s
        self.peak = 0
        self.by_kind: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-pss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            start = time.perf_counter()
            self._sample()
            cost = time.perf_counter() - start
            if self._stop.wait(max(self.interval_s, cost / self.MAX_DUTY)):
                return

    def stop(self) -> int:
        """Stop sampling, take one last sample.

        Returns:
            The peak, in bytes.
        """
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peak

    def _sample(self) -> None:
        by_kind: dict[str, int] = {}
        total = tree_pss(by_kind)
        if total > self.peak:
            self.peak, self.by_kind = total, by_kind


@dataclass
class EpochStats:
    """One epoch's measurements."""

    epoch: int
    samples: int
    seconds: float
    ttfb_s: float
    slept_s: float = 0.0
    #: A raydl loader's summary of the epoch (``stats()["epochs"][-1]["ray_data"]``): where
    #: its work ran, e.g. how many runs loaded in the trainer while the actors started.
    summary: str | None = None
    exactly_once: bool = True

    @property
    def samples_per_s(self) -> float:
        """Delivered samples per second of the epoch."""
        return self.samples / self.seconds

    @property
    def stall_fraction(self) -> float:
        """The share of the epoch spent outside the simulated training step."""
        return (self.seconds - self.slept_s) / self.seconds


def batch_ids(batch: Batch) -> torch.Tensor:
    """The sample ids of a batch (a dict's ``id`` or a tuple's second element).

    Args:
        batch: What the loader yielded.

    Returns:
        The ids.
    """
    return batch["id"] if isinstance(batch, dict) else batch[1]


def run_epoch(
    batches: Iterable[Batch], epoch: int, step_s_per_sample: float = 0.0
) -> tuple[EpochStats, np.ndarray]:
    """Iterate one epoch (optionally sleeping per batch like a training step).

    Args:
        batches: The epoch's batches.
        epoch: The epoch's number.
        step_s_per_sample: The simulated training step's seconds per sample (0: none).

    Returns:
        The epoch's measurements and every sample id delivered, in order.
    """
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


def run_worker(name: str, workload: str, cfg: WorkerConfig) -> dict[str, Any]:
    """One contender on one workload: warm-up epoch, timed epochs, stall epochs.

    Args:
        name: The contender (a ``REGISTRY`` key).
        workload: The workload (a ``WORKLOADS`` key).
        cfg: The worker's config.

    Returns:
        The raw measurements, as the worker prints them.
    """
    process_start = time.perf_counter()
    memory = PeakMemory(cfg.mem_interval_s)
    data = WORKLOADS[workload].load(cfg)
    who = contender(name)
    loader = who.loader(data)
    if who.pause_s:
        time.sleep(who.pause_s)  # the script's own work between building and iter() (issue 18)
    stats: list[EpochStats] = []
    stalls: dict[str, float] = {}
    # Time to first batch of a warm epoch under a training step: the loader has the
    # previous epoch's length to prepare the next one, as in training (issue 15).
    paced_ttfb: dict[str, float] = {}
    ttfb_cold = -1.0
    # Each demand runs two epochs and the second is measured: a training loop at that
    # demand is slow in every epoch, while the first one follows a full-speed epoch.
    steps: list[tuple[str, float]] = [("", 0.0)] * (1 + cfg.epochs) + [
        step for step in cfg.stall_steps for _ in range(2)
    ]
    try:
        for epoch, (stall_name, step) in enumerate(steps):
            epoch_stats, got = run_epoch(loader.epoch(epoch), epoch, step)
            epoch_stats.summary = _summary(loader)
            if epoch == 0:
                ttfb_cold = time.perf_counter() - process_start - epoch_stats.seconds
                ttfb_cold += epoch_stats.ttfb_s
            want = data.expected_ids(epoch)
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
            if stall_name:  # the second epoch of each demand wins: it follows a paced one
                stalls[stall_name] = epoch_stats.stall_fraction
                paced_ttfb[stall_name] = epoch_stats.ttfb_s
        autotune = _autotune(loader)
    finally:
        loader.close()
    peak = memory.stop()
    timed = stats[1 : 1 + cfg.epochs]
    return {
        "contender": name,
        "workload": workload,
        "epoch_samples_per_s": [s.samples_per_s for s in timed],
        "epoch_ttfb_s": [s.ttfb_s for s in timed],
        "ttfb_cold_s": ttfb_cold,
        # iter() to the first batch of the first epoch: after the pause, if there was one.
        "ttfb_first_iter_s": stats[0].ttfb_s if stats else -1.0,
        "pause_s": who.pause_s,
        "peak_mem_mb": peak / 2**20,
        "peak_mem_by_kind_mb": {k: round(v / 2**20, 1) for k, v in sorted(memory.by_kind.items())},
        "stall_fraction": stalls,
        "paced_ttfb_s": paced_ttfb,
        "exactly_once": all(s.exactly_once for s in stats),
        "epochs": [asdict(s) for s in stats],
        "autotune": autotune,
    }


def _summary(loader: Any) -> str | None:
    """The last epoch's summary of a raydl loader (``stats()``), else ``None``.

    Args:
        loader: The contender's ``Loader``.

    Returns:
        The summary, as text.
    """
    stats = getattr(getattr(loader, "loader", None), "stats", None)
    if not callable(stats):
        return None
    epochs = stats().get("epochs") or [{}]
    summary = epochs[-1].get("ray_data")
    return None if summary is None else str(summary)


def _autotune(loader: Any) -> dict[str, Any] | None:
    """``stats()["autotune"]`` of a raydl loader with ``num_workers="auto"``, else ``None``.

    Args:
        loader: The contender's ``Loader``.

    Returns:
        The rule's state and changes.
    """
    stats = getattr(getattr(loader, "loader", None), "stats", None)
    report: dict[str, Any] | None = stats().get("autotune") if callable(stats) else None
    return report


def _paced_ttfb(runs: list[dict[str, Any]]) -> tuple[str, float] | None:
    """The warm time to first batch under the fastest simulated training step the runs had.

    Args:
        runs: The rounds' raw measurements, without failed ones.

    Returns:
        ``(demand, median seconds)`` (demand as ``"1.0x"``), or ``None`` without paced epochs.
    """
    paced = [r["paced_ttfb_s"] for r in runs if r.get("paced_ttfb_s")]
    if not paced:
        return None
    demand = max(paced[0], key=lambda name: float(name.rstrip("x")))
    return demand, statistics.median(p[demand] for p in paced if demand in p)


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Fold the rounds of one workload x contender into the published metrics.

    Args:
        runs: The rounds' raw measurements (or ``{"error": ...}`` for a failed round).

    Returns:
        The medians (peak memory: the maximum) and whether every round was exactly once.
    """
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {
            "samples_per_s": None,
            "ttfb_cold_s": None,
            "ttfb_warm_s": None,
            "ttfb_first_iter_s": None,
            "pause_s": None,
            "peak_mem_mb": None,
            "stall_fraction": None,
            "ttfb_paced_s": None,
            "exactly_once": False,
            "error": "; ".join(r["error"] for r in runs),
        }
    stalls = [r["stall_fraction"] for r in ok if r["stall_fraction"]]
    out: dict[str, Any] = {
        "samples_per_s": statistics.median(x for r in ok for x in r["epoch_samples_per_s"]),
        "ttfb_cold_s": statistics.median(r["ttfb_cold_s"] for r in ok),
        "ttfb_warm_s": statistics.median(x for r in ok for x in r["epoch_ttfb_s"]),
        "ttfb_first_iter_s": statistics.median(r.get("ttfb_first_iter_s", -1.0) for r in ok),
        "pause_s": ok[0].get("pause_s", 0.0),
        "peak_mem_mb": max(r["peak_mem_mb"] for r in ok),
        "stall_fraction": statistics.median(s["0.5x"] for s in stalls) if stalls else None,
        "ttfb_paced_s": _paced_ttfb(ok),
        "exactly_once": len(ok) == len(runs) and all(r["exactly_once"] for r in ok),
        "peak_mem_by_kind_mb": max(ok, key=lambda r: r["peak_mem_mb"]).get("peak_mem_by_kind_mb"),
    }
    if any("1.0x" in s for s in stalls):
        out["stall_fraction_1x"] = statistics.median(s["1.0x"] for s in stalls if "1.0x" in s)
    tuned = [r["autotune"] for r in ok if r.get("autotune")]
    if tuned:  # raydl_auto: where the rule ended in each round
        out["autotune"] = [{k: t[k] for k in ("workers", "factor", "budget")} for t in tuned]
    if len(ok) < len(runs):
        out["error"] = "; ".join(r["error"] for r in runs if "error" in r)
    return out
