"""``LoaderOptions``: raydl's own options of :class:`raydl.RayDataLoader`, validated once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from raydl._internal.epochs.plan import SHUFFLE_MODES
from raydl._internal.runtime import env
from raydl._internal.runtime.world import World

__all__ = ["LoaderOptions"]


@dataclass(frozen=True)
class LoaderOptions:
    """raydl's own options (those torch's ``DataLoader`` does not have), validated once.

    Attributes:
        seed: Base seed of every random choice raydl makes (Ray Data shuffles).
            ``None``: taken from ``generator`` or drawn from torch's global RNG
            when the loader is built, so ``torch.manual_seed`` makes runs repeat.
        shuffle_mode: For ``ray.data.Dataset`` sources with ``shuffle=True``:
            ``"global"`` (a true all-to-all shuffle each epoch), ``"blocks"``
            (random block order plus a local shuffle buffer; cheaper) or
            ``"files"`` (random order of the files read plus the local buffer, as
            torch's file-based loaders shuffle; streams from the first file, for
            plans whose sources are reads).
        local_shuffle_buffer_size: Rows in the local buffer of ``"blocks"``/``"files"`` mode
            (default: ``4 * batch_size``, at least 1024).
        deterministic: Run Ray Data with ``preserve_order`` so the row order is a
            pure function of (seed, epoch). ``False`` lets finished blocks overtake.
        ray_address: Ray cluster to join; else ``RAY_ADDRESS``; else an embedded
            local instance is started.
        worker_options: Ray actor options of the dataset workers for torch
            ``Dataset`` sources, e.g. ``{"num_cpus": 1, "resources": {...}}``.
        overlap_epochs: For ``ray.data.Dataset`` sources on one rank: start the
            next epoch's pipeline while the current one drains (its plan is a
            pure function of (seed, epoch)), so the epoch boundary does not wait
            for Ray Data's start-up or a shuffle's map phase. Costs the memory of
            two epochs in flight around the boundary; ``False`` turns it off.
        direct_execution: For ``ray.data.Dataset`` sources on one rank whose plan
            is one of raydl's file reads (``read_binary_files``, ``read_parquet``)
            followed only by ``map_batches`` functions on CPUs: run it on raydl's
            own Ray actors, which live as long as the loader, instead of a new Ray
            Data execution per epoch (on 2 CPUs, the start-up and per-task
            scheduling of those executions left a quarter of the machine idle
            during small-image epochs). Other plans run on Ray Data either way;
            ``False`` always uses Ray Data.
        start_in_process: While the loader's first actors start (Ray's own start,
            their processes and imports take seconds on a small machine), load the
            first batches in the training process, so the first batch does not wait
            for them. For plans on raydl's actors (``direct_execution``): the first
            runs of files (a run is a pure function of its files). For map-style
            torch datasets: each batch as the worker torch would have used (its own
            copy of the dataset, its RNG states, ``get_worker_info()``), whose actor
            then goes on from those RNG states (with ``num_workers="auto"``: as
            worker 0, the rule's first); not with a ``worker_init_fn``, ``timeout``
            or ``device``. The batches are the
            same either way. That code runs in the training process, as with
            ``num_workers=0``: a function that kills its process (``os._exit``, a
            segfault in a decoder) takes the trainer with it there, where an actor
            would be replaced. ``False``: every batch on the actors.
        progress_bar: Show a tqdm progress bar for each epoch (batches).
        log_stats: Log a one-line summary of each epoch when it ends (the
            ``raydl`` logger, INFO): batches, samples, samples/s, wait and stall.
        device: Copy batches to this CUDA device on a side stream,
            ``prefetch_factor`` batches ahead of the training step. ``None`` keeps
            batches on the host, as torch does. Without CUDA: a warning, host batches.
        world: This process's rank and world size; ``None`` detects them from
            ``torch.distributed`` or torchrun's variables.
        background_start: Start Ray and the loader's actors on a daemon thread when
            the loader is built (and, for ``ray.data.Dataset`` sources on one rank,
            epoch 0's pipeline), so the seconds a script spends before its first
            ``iter()`` (building the model, DDP set-up) are not wasted; ``iter()``
            waits for what is not ready and raises the start's errors. Nothing
            starts for ``num_workers=0``. Under torchrun the ranks meet through
            torchrun's key-value store, never a collective. ``False``: everything
            starts at the first ``iter()``. ``None`` (default): on, unless the
            environment variable ``RAYDL_BACKGROUND_START`` is ``0``.
        cpu_budget: With ``num_workers="auto"``: the CPUs its actors may use (each
            counts as ``worker_options["num_cpus"]``, or 1), so at most
            ``cpu_budget / that`` workers (per rank). ``None``: ``RAYDL_CPU_BUDGET``
            if set, else the Ray cluster's CPUs less one per rank (the trainers'
            own), shared equally by the ranks; at least one worker.
    """

    seed: int | None = None
    shuffle_mode: str = "global"
    local_shuffle_buffer_size: int | None = None
    deterministic: bool = True
    ray_address: str | None = None
    worker_options: Mapping[str, Any] = field(default_factory=dict)
    overlap_epochs: bool = True
    direct_execution: bool = True
    start_in_process: bool = True
    progress_bar: bool = False
    log_stats: bool = False
    device: str | torch.device | int | None = None
    world: World | None = None
    background_start: bool | None = None
    cpu_budget: float | None = None

    def __post_init__(self) -> None:
        if self.background_start is None:
            object.__setattr__(self, "background_start", env.background_start_default())
        budget = self.cpu_budget
        if budget is not None and (
            not isinstance(budget, (int, float)) or isinstance(budget, bool)
        ):
            raise TypeError(
                f"cpu_budget option should be a number of CPUs or None, got {budget!r}; "
                "pass e.g. cpu_budget=4 with num_workers='auto'"
            )
        if budget is not None and not budget > 0:
            raise ValueError(
                f"cpu_budget option should be a positive number of CPUs or None, got {budget!r}; "
                "pass e.g. cpu_budget=4, or None for the default"
            )
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
        ):
            raise TypeError(f"seed option should be an int or None, got {self.seed!r}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed option should be non-negative, got {self.seed!r}")
        if self.shuffle_mode not in SHUFFLE_MODES:
            raise ValueError(
                f"shuffle_mode option should be one of {SHUFFLE_MODES}, got {self.shuffle_mode!r}"
            )
        buffer = self.local_shuffle_buffer_size
        if buffer is not None and (not isinstance(buffer, int) or buffer < 1):
            raise ValueError(
                f"local_shuffle_buffer_size option should be a positive int or None, got {buffer!r}"
            )
        if not isinstance(self.worker_options, Mapping):
            raise TypeError(
                "worker_options option should be a mapping of Ray actor options, "
                f"got {type(self.worker_options).__name__}"
            )
        for name in (
            "overlap_epochs",
            "direct_execution",
            "start_in_process",
            "progress_bar",
            "log_stats",
            "background_start",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} option should be a bool, got {value!r}")
        if self.world is not None and not isinstance(self.world, World):
            raise TypeError(
                f"world option should be a raydl.World or None, got {type(self.world).__name__}"
            )
