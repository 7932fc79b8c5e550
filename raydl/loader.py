"""``RayDataLoader``: torch's ``DataLoader`` interface, with the work done on Ray.

Swap one import and keep the training script::

    from raydl import RayDataLoader as DataLoader

See ``docs/design.md`` for how each kind of dataset maps onto Ray.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)
from torch.utils.data._utils.collate import default_collate, default_convert
from torch.utils.data.dataloader import _InfiniteConstantSampler

from raydl._internal.epochs.direct import DirectPlan, RunLoader, direct_plan
from raydl._internal.epochs.direct import pool_size as direct_pool_size
from raydl._internal.epochs.direct import runs as direct_runs
from raydl._internal.epochs.elastic import batch_counts
from raydl._internal.epochs.overlap import NextEpoch
from raydl._internal.epochs.plan import SHUFFLE_MODES, EpochPlan, plan_epoch, stage_names
from raydl._internal.epochs.resume import (
    ShareHolder,
    can_rebuild,
    map_style_share,
    ray_shares,
    sampler_spec,
)
from raydl._internal.epochs.shuffle import rank_seed, seed_from_torch
from raydl._internal.epochs.state import LoaderState, decode_rng, encode_rng
from raydl._internal.runtime import cluster
from raydl._internal.runtime.world import Channel, World
from raydl._internal.stream.device import DevicePrefetcher, resolve_device
from raydl._internal.stream.iterators import (
    DirectIterator,
    IterableIterator,
    MapStyleIterator,
    RayDatasetIterator,
)
from raydl._internal.stream.metrics import EpochStats, summarize
from raydl._internal.workers.pool import WorkerPool
from raydl._internal.workers.worker import WorkerSpec
from raydl.pipelines import PerEpoch

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["RayDataLoader"]

_FROZEN_ATTRS = (
    "batch_size",
    "batch_sampler",
    "sampler",
    "drop_last",
    "dataset",
    "persistent_workers",
)


def _is_ray_dataset(obj: object) -> bool:
    if isinstance(obj, PerEpoch):
        return True
    cls = type(obj)
    return any(c.__module__.startswith("ray.data") and c.__name__ == "Dataset" for c in cls.__mro__)


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
        progress_bar: Show a tqdm progress bar for each epoch (batches).
        log_stats: Log a one-line summary of each epoch when it ends (the
            ``raydl`` logger, INFO): batches, samples, samples/s, wait and stall.
        device: Copy batches to this CUDA device on a side stream,
            ``prefetch_factor`` batches ahead of the training step. ``None`` keeps
            batches on the host, as torch does. Without CUDA: a warning, host batches.
        world: This process's rank and world size; ``None`` detects them from
            ``torch.distributed`` or torchrun's variables.
    """

    seed: int | None = None
    shuffle_mode: str = "global"
    local_shuffle_buffer_size: int | None = None
    deterministic: bool = True
    ray_address: str | None = None
    worker_options: Mapping[str, Any] = field(default_factory=dict)
    overlap_epochs: bool = True
    direct_execution: bool = True
    progress_bar: bool = False
    log_stats: bool = False
    device: str | torch.device | int | None = None
    world: World | None = None

    def __post_init__(self) -> None:
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
        for name in ("overlap_epochs", "direct_execution", "progress_bar", "log_stats"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} option should be a bool, got {value!r}")
        if self.world is not None and not isinstance(self.world, World):
            raise TypeError(
                f"world option should be a raydl.World or None, got {type(self.world).__name__}"
            )


class RayDataLoader(Iterable[Any]):
    """A drop-in ``torch.utils.data.DataLoader`` whose loading runs on a Ray cluster.

    The arguments up to ``in_order`` are torch's, in torch's order, with torch's
    meaning and torch's errors. Differences:

    * ``num_workers``: the number of Ray actors that run ``__getitem__``/
      ``__getitems__`` and ``collate_fn`` of a torch ``Dataset``. ``0`` means one
      actor (the work still leaves the training process); ``get_worker_info()``
      then reports one worker. Ignored for ``ray.data.Dataset`` sources, whose
      parallelism is set per stage (``map_batches(num_cpus=..., concurrency=...)``).
    * ``persistent_workers``: keep the actors (and their dataset state) between
      epochs; otherwise they are created at ``iter()`` and killed when the epoch
      ends, like torch's worker processes.
    * ``prefetch_factor``: batches in flight per actor (default 2), or batches
      buffered ahead for ``ray.data.Dataset`` sources.
    * ``multiprocessing_context``: accepted and ignored: there are no subprocesses.
    * ``timeout``: seconds to wait for any one batch before raising
      ``LoaderTimeoutError`` (a ``RuntimeError``, torch's wording).
    * ``ray.data.Dataset`` sources yield ``dict[str, Tensor]`` batches;
      ``collate_fn`` then receives Ray Data's ``dict[str, numpy.ndarray]`` batch.

    Args:
        dataset: A map-style or iterable torch ``Dataset``, or a ``ray.data.Dataset``.
        batch_size: Samples per batch; ``None`` disables automatic batching.
        shuffle: Reshuffle every epoch.
        sampler: Index sampler (map-style only), e.g. ``DistributedSampler``.
        batch_sampler: Sampler of index lists; exclusive with the four above.
        num_workers: Ray actors for torch datasets (see above).
        collate_fn: Merges samples into a batch.
        pin_memory: Pin host batches (when CUDA exists; a warning otherwise).
        drop_last: Drop the last incomplete batch.
        timeout: Seconds to wait for a batch, 0 for no limit.
        worker_init_fn: Called with the worker id in each Ray actor.
        multiprocessing_context: Ignored.
        generator: RNG of the default ``RandomSampler`` and of the worker seeds.
        prefetch_factor: Batches in flight per worker.
        persistent_workers: Keep the Ray actors across epochs.
        pin_memory_device: Accepted for compatibility (deprecated in torch).
        in_order: Return batches in sampler order; ``False`` returns them as they finish.
        seed: See :class:`LoaderOptions`.
        shuffle_mode: See :class:`LoaderOptions`.
        local_shuffle_buffer_size: See :class:`LoaderOptions`.
        deterministic: See :class:`LoaderOptions`.
        ray_address: See :class:`LoaderOptions`.
        worker_options: See :class:`LoaderOptions`.
        overlap_epochs: See :class:`LoaderOptions`.
        direct_execution: See :class:`LoaderOptions`.
        progress_bar: See :class:`LoaderOptions`.
        log_stats: See :class:`LoaderOptions`.
        device: See :class:`LoaderOptions`.
        world: See :class:`LoaderOptions`.

    Under torchrun (several ranks) one Ray cluster and, for ``ray.data.Dataset``
    sources, one pipeline per epoch serve all ranks: rank 0 splits it with
    ``streaming_split(world_size, equal=True)``, so every rank gets the same
    number of rows (up to ``world_size - 1`` rows of an epoch are dropped) and
    batches. A map-style dataset without a sampler is sharded with a
    ``DistributedSampler`` (seed ``seed`` or 0, re-seeded each epoch), exactly
    as if the script had passed one; with a sampler, the sampler decides.

    Example:
        >>> import torch
        >>> from raydl import RayDataLoader as DataLoader
        >>> data = torch.arange(10).float()
        >>> loader = DataLoader(data, batch_size=4)  # doctest: +SKIP
        >>> [b.tolist() for b in loader]  # doctest: +SKIP
        [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int | None = None,
        shuffle_mode: str = "global",
        local_shuffle_buffer_size: int | None = None,
        deterministic: bool = True,
        ray_address: str | None = None,
        worker_options: Mapping[str, Any] | None = None,
        overlap_epochs: bool = True,
        direct_execution: bool = True,
        progress_bar: bool = False,
        log_stats: bool = False,
        device: str | torch.device | int | None = None,
        world: World | None = None,
    ) -> None:
        # Argument checks and defaults follow torch.utils.data.DataLoader.__init__.
        if num_workers < 0:
            raise ValueError(
                "num_workers option should be non-negative; "
                "use num_workers=0 to disable multiprocessing."
            )
        if timeout < 0:
            raise ValueError("timeout option should be non-negative")
        if num_workers == 0 and prefetch_factor is not None:
            raise ValueError(
                "prefetch_factor option could only be specified in multiprocessing."
                "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None."
            )
        if num_workers > 0 and prefetch_factor is None:
            prefetch_factor = 2
        elif prefetch_factor is not None and prefetch_factor < 0:
            raise ValueError("prefetch_factor option should be non-negative")
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers option needs num_workers > 0")

        self._is_ray_dataset = _is_ray_dataset(dataset)
        self._is_iterable = isinstance(dataset, IterableDataset)
        if self._is_iterable or self._is_ray_dataset:
            kind = "IterableDataset" if self._is_iterable else "ray.data.Dataset"
            if self._is_iterable and shuffle not in {False, None}:
                raise ValueError(
                    f"DataLoader with IterableDataset: expected unspecified shuffle option, but got shuffle={shuffle}"
                )
            if sampler is not None:
                raise ValueError(
                    f"DataLoader with {kind}: expected unspecified sampler option, but got sampler={sampler}"
                )
            if batch_sampler is not None:
                raise ValueError(
                    f"DataLoader with {kind}: expected unspecified "
                    f"batch_sampler option, but got batch_sampler={batch_sampler}"
                )
            if self._is_ray_dataset and batch_size is None:
                raise ValueError(
                    "DataLoader with ray.data.Dataset: batch_size=None (no automatic batching) "
                    "is not supported; use batch_size=1 for one row per batch."
                )
            shuffle = bool(shuffle)
        else:
            shuffle = bool(shuffle)

        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError(
                    "batch_sampler option is mutually exclusive "
                    "with batch_size, shuffle, sampler, and "
                    "drop_last"
                )
            batch_size = None
            drop_last = False
        elif batch_size is None and drop_last:
            raise ValueError(
                "batch_size=None option disables auto-batching "
                "and is mutually exclusive with drop_last"
            )

        self.options = LoaderOptions(
            seed=seed,
            shuffle_mode=shuffle_mode,
            local_shuffle_buffer_size=local_shuffle_buffer_size,
            deterministic=deterministic,
            ray_address=ray_address,
            worker_options=dict(worker_options or {}),
            overlap_epochs=overlap_epochs,
            direct_execution=direct_execution,
            progress_bar=progress_bar,
            log_stats=log_stats,
            device=device,
            world=world,
        )
        self._world = world if world is not None else World.detect()
        self._auto_sharded = False
        if self._is_iterable:
            sampler = _InfiniteConstantSampler()
        elif (
            sampler is None
            and batch_sampler is None
            and not self._is_ray_dataset
            and self._world.is_distributed
        ):
            sampler = DistributedSampler(
                dataset,
                num_replicas=self._world.world_size,
                rank=self._world.rank,
                shuffle=shuffle,
                seed=seed or 0,
            )
            self._auto_sharded = True
        elif sampler is None and not self._is_ray_dataset:
            if shuffle:
                sampler = RandomSampler(dataset, generator=generator)
            else:
                sampler = SequentialSampler(dataset)
        if batch_size is not None and batch_sampler is None and sampler is not None:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)

        self.dataset = dataset
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.in_order = in_order
        self.shuffle = shuffle
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.generator = generator
        if collate_fn is None and not self._is_ray_dataset:
            collate_fn = default_collate if self._auto_collation else default_convert
        self.collate_fn = collate_fn
        self.persistent_workers = persistent_workers

        self._base_seed = seed if seed is not None else self._default_seed(generator)
        self._next_epoch = 0
        self._pool: WorkerPool | None = None  # persistent workers
        self._parked: list[WorkerPool] = []  # idle pools of finished epochs (not persistent)
        self._direct_pool: WorkerPool | None = None  # runs simple file plans (direct.py)
        self._epoch_direct = False  # the Ray Data epoch in progress runs on that pool
        self._iterator: Any = None
        # rank 0: the epoch's split iterators, kept alive until every rank ended the epoch
        self._splits: Any = None
        self._epoch_in_progress = 0
        self._epoch_rng: dict[str, str] | None = None
        self._epoch_sampler_epoch: int | None = None
        # the epoch's earlier segments [(world size, batches)] when it was resumed elastically
        self._epoch_prior: list[tuple[int, int]] = []
        self._epoch_order: dict[str, Any] | None = None
        self._worker_seed: int | None = None  # base seed of the current workers
        self._resume: LoaderState | None = None
        self._next = NextEpoch()  # Ray Data: the next epoch, started early
        self._built: tuple[int, Any] | None = None  # PerEpoch: the last epoch's plan
        self._stats: list[EpochStats] = []
        self._pin_warned = False
        self._initialized = True

    def _default_seed(self, generator: torch.Generator | None) -> int:
        # Only Ray Data shuffles use this seed; torch datasets take their order from
        # the sampler exactly as torch does, so their RNG streams are not touched here.
        if not (self._is_ray_dataset and self.shuffle):
            return 0
        if generator is not None:
            return generator.initial_seed() & (2**31 - 1)
        return seed_from_torch(None)

    def __setattr__(self, attr: str, val: Any) -> None:
        if getattr(self, "_initialized", False) and attr in _FROZEN_ATTRS:
            raise ValueError(
                f"{attr} attribute should not be set after {self.__class__.__name__} is initialized"
            )
        super().__setattr__(attr, val)

    # torch's DataLoader exposes these two; some training code reads them.
    @property
    def _auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def _index_sampler(self) -> Any:
        return self.batch_sampler if self._auto_collation else self.sampler

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` will run (counts ``iter()`` calls unless set)."""
        return self._next_epoch

    def set_epoch(self, epoch: int) -> None:
        """Fix the epoch of the next ``iter()``: it selects the Ray Data shuffle order.

        Map-style datasets take their order from the sampler (call
        ``loader.sampler.set_epoch`` for a ``DistributedSampler``, as with torch).
        """
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            raise TypeError(f"epoch should be an int, got {epoch!r}")
        if epoch < 0:
            raise ValueError(f"epoch should be non-negative, got {epoch!r}")
        self._next_epoch = epoch
        if self._next.epoch not in {None, epoch}:
            self._next.discard()

    def _kind(self) -> str:
        return "ray" if self._is_ray_dataset else "iterable" if self._is_iterable else "map"

    def _dataset_len(self) -> int | None:
        if self._is_ray_dataset:
            return None
        try:
            return len(self.dataset)
        except TypeError:
            return None

    def _capture_rng(self) -> dict[str, str]:
        if self.generator is not None:
            return {"source": "generator", "state": encode_rng(self.generator.get_state())}
        return {"source": "global", "state": encode_rng(torch.get_rng_state())}

    def _restore_rng(self, state: LoaderState) -> None:
        if state.rng is None:
            return
        rng = decode_rng(state.rng["state"])
        if state.rng["source"] == "generator" and self.generator is not None:
            self.generator.set_state(rng)
        elif state.rng["source"] == "global":
            torch.set_rng_state(rng)
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if state.sampler_epoch is not None and set_epoch is not None:
            set_epoch(state.sampler_epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands, as a JSON-able dict (torchdata's StatefulDataLoader API).

        Saved mid-epoch, it records the epoch and the batches already returned by
        ``next()``; loading it into a loader built the same way makes the next
        ``iter()`` deliver exactly the rest of that epoch, in the same order an
        uninterrupted run would have. Saved between epochs, it records the next
        epoch. Under several ranks each rank saves and loads its own state.

        Example:
            >>> state = loader.state_dict()  # doctest: +SKIP
            >>> json.dump(state, open("loader.json", "w"))  # doctest: +SKIP
        """
        iterator = self._iterator
        in_progress = iterator is not None and not iterator.exhausted
        state = LoaderState(
            kind=self._kind(),
            epoch=self._epoch_in_progress if in_progress else self._next_epoch,
            batches_consumed=iterator.num_yielded if in_progress else 0,
            world_size=self._world.world_size,
            dataset_len=self._dataset_len(),
            seed=self._base_seed,
            rng=self._epoch_rng if in_progress else None,
            sampler_epoch=self._epoch_sampler_epoch if in_progress else None,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            progress=[
                [w, k]
                for w, k in [
                    *self._epoch_prior,
                    (self._world.world_size, iterator.num_yielded),
                ]
            ]
            if in_progress
            else None,
            order=self._epoch_order if in_progress else None,
            worker_seed=self._worker_seed if self.persistent_workers else None,
            direct_execution=self._epoch_direct if self._is_ray_dataset else None,
        )
        return state.to_dict()

    def stats(self) -> dict[str, Any]:
        """How the training loop fared against the loader, per epoch and in total.

        ``wait_s`` is the time spent inside ``next()`` waiting for data;
        ``stall_fraction`` is ``wait_s / elapsed_s``: near 0 means the loader
        keeps up, near 1 means training is starved. Also ``batches``, ``samples``,
        ``samples_per_s``, ``time_to_first_batch_s`` and, for Ray Data sources,
        ``ray_data``: Ray Data's per-stage summary of the epoch's execution
        (per epoch). These are this rank's figures; see :meth:`gather_stats`.
        ``skipped_files``: the files a reader with ``on_bad_file="skip"`` left out
        in this Ray job (``{"path", "reason"}`` each; counted once per file).

        Example:
            >>> loader.stats()["total"]["stall_fraction"]  # doctest: +SKIP
            0.013
        """
        from raydl._internal.io import skips

        return {**summarize(self._stats), "skipped_files": skips.snapshot()}

    def gather_stats(self) -> list[dict[str, Any]] | None:
        """Every rank's :meth:`stats` on rank 0, in rank order (``None`` on other ranks).

        A collective call under torchrun: every rank must make it. With one rank
        it returns ``[self.stats()]``.

        Example:
            >>> per_rank = loader.gather_stats()  # doctest: +SKIP
            >>> if per_rank is not None:  # rank 0  # doctest: +SKIP
            ...     print(max(r["total"]["stall_fraction"] for r in per_rank))
        """
        mine = self.stats()
        if not self._world.is_distributed:
            return [mine]
        return Channel.get(self._world).gather(mine)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next ``iter()`` resumes that epoch.

        Raises:
            StateMismatchError: The state was saved from another kind of dataset, a
                dataset of another length or batch size, another seed, or another
                state version; or at another world size by a source that cannot be
                re-dealt (``IterableDataset``, a custom sampler). The message names
                both values.

        Elastic resume: a state saved mid-epoch by ``W`` ranks (each rank's state,
        saved at the same step, as DDP checkpoints do) can be loaded by ``W'``
        ranks. The samples that no rank had consumed are then dealt to the ``W'``
        ranks in equal batch counts (exactly once when the counts allow it;
        otherwise a few repeat, as torch's ``DistributedSampler`` pads), and the
        following epochs use the ``W'``-rank sharding. Map-style datasets rebuild
        the order from torch's samplers and fetch nothing twice; Ray Data runs
        the epoch's pipeline once more on rank 0 to find the rows left.
        """
        state = LoaderState.from_dict(state_dict)
        state.check_matches(
            kind=self._kind(),
            dataset_len=self._dataset_len(),
            seed=self._base_seed,
            world_size=self._world.world_size,
            batch_size=self.batch_size,
            elastic=self._is_ray_dataset or (not self._is_iterable and can_rebuild(state)),
        )
        self._close_iterator()
        self._next.discard()
        self._next_epoch = state.epoch
        self._resume = state if state.batches_consumed > 0 else None

    def __len__(self) -> int:
        return self._len_for_epoch(self._next_epoch)

    def _len_for_epoch(self, epoch: int) -> int:
        if self._is_ray_dataset:
            rows = self._epoch_dataset(epoch)._meta_count()
            if rows is None:
                raise TypeError(
                    "len() of a RayDataLoader over a ray.data.Dataset whose row count is only "
                    "known after executing it (e.g. after filter or a row-changing map_batches); "
                    "materialize() the dataset first, or do not call len()."
                )
            # streaming_split(equal=True) gives each rank the same share and drops the rest.
            return self._batches_for(rows // self._world.world_size)
        if self._is_iterable:
            return self._batches_for(len(self.dataset))
        return len(self._index_sampler)

    def _batches_for(self, rows: int) -> int:
        if self.batch_size is None:
            return rows
        if self.drop_last:
            return rows // self.batch_size
        return math.ceil(rows / self.batch_size)

    def _length_or_none(self, epoch: int) -> int | None:
        try:
            return self._len_for_epoch(epoch)
        except TypeError:
            return None

    def __iter__(self) -> Iterator[Any]:
        if self.persistent_workers or self._world.is_distributed:
            # The previous epoch shares this loader's actors or its ranks' collective
            # schedule: it ends here. Otherwise it lives on independently, as in torch.
            self._close_iterator()
        cluster.ensure_ray(self.options.ray_address, world=self._world)
        epoch = self._next_epoch
        self._next_epoch += 1
        resume, self._resume = self._resume, None
        pin = self._use_pinned_memory()
        prefetch = self.prefetch_factor if self.prefetch_factor is not None else 2
        iterator: Any
        if self._is_ray_dataset:
            iterator = self._iter_ray_dataset(epoch, pin, prefetch, resume)
        else:
            iterator = self._iter_torch_dataset(epoch, pin, prefetch, resume)
        device = resolve_device(self.options.device)
        if device is not None:
            iterator = DevicePrefetcher(
                iterator, device, depth=prefetch, name=f"raydl-epoch-{epoch}-to-{device}"
            )
        # An iterator keeps its loader alive (`for b in DataLoader(...)` drops the loader).
        iterator.loader = self
        stats = EpochStats(epoch=self._epoch_in_progress)
        self._stats.append(stats)
        inner = iterator._source if isinstance(iterator, DevicePrefetcher) else iterator
        inner.stats = stats
        inner.log_summary = self.options.log_stats
        if self.options.progress_bar:
            try:
                from tqdm.auto import tqdm
            except ImportError as err:
                raise ImportError(
                    "progress_bar=True needs tqdm, which is not installed; "
                    "pip install 'raydl[progress]' (or tqdm), or pass progress_bar=False"
                ) from err

            inner.progress = tqdm(
                total=inner._length, desc=f"epoch {self._epoch_in_progress}", unit="batch"
            )
        self._iterator = iterator
        return iterator

    def _epoch_dataset(self, epoch: int) -> Any:
        """The user's Ray Data plan for ``epoch`` (a :class:`PerEpoch` is built once for it).

        The planner and ``len()`` both ask for it; the last build is kept so the
        user's function runs once per epoch (it is pure in ``epoch``).
        """
        if not isinstance(self.dataset, PerEpoch):
            return self.dataset
        built = self._built
        if built is None or built[0] != epoch:
            built = (epoch, self.dataset.dataset(epoch))
            self._built = built  # one assignment: safe with the early-epoch thread
        return built[1]

    def _plan(self, epoch: int) -> EpochPlan:
        batch_size = self.batch_size
        assert batch_size is not None  # rejected in __init__
        options = self.options
        return plan_epoch(
            self._epoch_dataset(epoch),
            shuffle=self.shuffle,
            shuffle_mode=options.shuffle_mode,
            local_shuffle_buffer_size=options.local_shuffle_buffer_size
            or max(1024, 4 * batch_size),
            seed=self._base_seed,
            epoch=epoch,
            deterministic=options.deterministic,
        )

    def _iter_ray_dataset(
        self, epoch: int, pin: bool, prefetch: int, resume: LoaderState | None
    ) -> RayDatasetIterator | DirectIterator:
        world = self._world
        self._epoch_in_progress = epoch
        self._epoch_prior, self._epoch_order = [], None
        self._epoch_direct = False
        skip = resume.batches_consumed if resume is not None else 0
        elastic = resume is not None and resume.needs_elastic(world.world_size)
        if not world.is_distributed and not elastic:
            early = self._next.take(epoch) if skip == 0 else None
            if early is None:
                self._next.discard()
                # A resumed epoch runs the way it was saved (its order depends on it).
                direct = resume.direct_execution is True if resume is not None else None
                early = self._single_rank_iterator(epoch, pin, prefetch, skip, direct=direct)
            self._epoch_direct = isinstance(early, DirectIterator)
            return early
        # Rank 0 plans (and splits) the epoch; every rank takes its part. Under
        # several ranks the broadcast is also where rank 0 learns that every rank
        # finished the previous epoch, so it can let go of the previous splits.
        message = self._rank0_parts(epoch, resume if elastic else None) if world.rank == 0 else None
        if world.is_distributed:
            channel = Channel.get(world)
            message = channel.broadcast(message)
        assert message is not None
        epoch, parts, buffer, buffer_seed, are_splits = message
        self._next_epoch = epoch + 1
        self._epoch_in_progress = epoch
        self._retire_splits()
        self._splits = parts if world.rank == 0 else None
        hooks: dict[str, Any] = {}
        length = None
        source: Any
        if are_splits:
            source = parts[world.rank]
            buffer_seed = rank_seed(buffer_seed, world.rank)
        else:
            assert resume is not None
            source, length = self._elastic_share(parts, world)
            self._epoch_prior = resume.segments
            skip = 0
        if world.is_distributed:
            barrier_timeout = self.timeout if self.timeout > 0 else 1800.0

            def on_exhausted() -> None:
                channel.barrier(barrier_timeout, f"the end of epoch {epoch}")

            hooks["on_exhausted"] = on_exhausted
        return self._ray_iterator(
            source, buffer, buffer_seed, epoch, pin, prefetch, skip, length=length, **hooks
        )

    def _rank0_parts(self, epoch: int, elastic: LoaderState | None) -> tuple[Any, ...]:
        """Rank 0's plan of the epoch for every rank: ``(epoch, parts, buffer, seed, are_splits)``.

        ``parts``: ``streaming_split`` iterators, one per rank; or, resuming
        ``elastic``, the shares of the rest of the epoch (behind a holder actor
        when other ranks must fetch theirs).
        """
        world = self._world
        plan = self._plan(epoch)
        if elastic is None:
            splits = plan.dataset.streaming_split(world.world_size, equal=True)
            return epoch, splits, plan.local_shuffle_buffer_size, plan.local_shuffle_seed, True
        shares: Any = ray_shares(
            plan.dataset,
            elastic,
            world.world_size,
            batch_size=self.batch_size or 1,
            drop_last=self.drop_last,
            buffer=plan.local_shuffle_buffer_size,
            buffer_seed=plan.local_shuffle_seed,
            direct=elastic.direct_execution is True,
        )
        if world.is_distributed:
            import ray

            shares = ray.remote(num_cpus=0)(ShareHolder).remote(shares)
        return epoch, shares, None, None, False

    def _elastic_share(self, shares: Any, world: World) -> tuple[Any, int]:
        """This rank's dataset of the rest of an elastic epoch, and its batch count."""
        import ray
        import ray.data

        if world.is_distributed:
            table = ray.get(shares.share.remote(world.rank))
        else:
            table = shares[world.rank]
        count = batch_counts(table.num_rows, self.batch_size, self.drop_last)
        return ray.data.from_arrow(table), count

    def _single_rank_iterator(
        self, epoch: int, pin: bool, prefetch: int, skip: int, direct: bool | None = None
    ) -> RayDatasetIterator | DirectIterator:
        """Epoch ``epoch`` on one rank; it starts the next epoch early when allowed.

        ``direct``: run a simple file plan on raydl's actors (see ``direct.py``) or on
        Ray Data; ``None``: as the ``direct_execution`` option says.
        """
        plan = self._plan(epoch)
        start_next = None
        if self.options.overlap_epochs:
            # A weak reference: the producer thread must not keep an unused loader
            # (and so its early epoch) alive; the loader's __del__ stops both.
            loader = weakref.ref(self)

            def start_next() -> bool:
                owner = loader()
                return owner is None or owner._start_early(epoch + 1, pin, prefetch)

        if direct is None:
            direct = self.options.direct_execution
        simple = direct_plan(plan.dataset) if direct else None
        if simple is not None:
            return self._direct_iterator(plan, simple, epoch, pin, prefetch, skip, start_next)
        return self._ray_iterator(
            plan.dataset,
            plan.local_shuffle_buffer_size,
            plan.local_shuffle_seed,
            epoch,
            pin,
            prefetch,
            skip,
            start_next=start_next,
            start_next_early=plan.all_to_all,
        )

    def _direct_iterator(
        self,
        plan: EpochPlan,
        direct: DirectPlan,
        epoch: int,
        pin: bool,
        prefetch: int,
        skip: int,
        start_next: Callable[[], bool] | None,
    ) -> DirectIterator:
        """Epoch ``epoch`` of a simple file plan, on this loader's own actors (``direct.py``)."""
        import ray

        assert self.batch_size is not None  # refused for Ray Data sources in __init__
        pool = self._direct_pool
        if pool is None:
            # Sized once: an epoch started early shares it with the current one, so it is
            # never replaced while the loader lives (close() drops it).
            cpus = ray.cluster_resources().get("CPU", 1.0)
            size = direct_pool_size(direct, cpus, plan.dataset.context)
            # No CPUs held: like torch's worker processes they compete for the machine,
            # and other Ray work (a len() that must count rows) is never locked out.
            spec = WorkerSpec(
                num_workers=size,
                collate_fn=None,
                auto_collation=False,
                worker_init_fn=None,
                base_seed=self._base_seed,
            )
            options = {"num_cpus": 0, "scheduling_strategy": "SPREAD"}
            pool = self._direct_pool = WorkerPool(
                RunLoader(), spec, restartable=True, options=options
            )
        files = direct.source._files
        return DirectIterator(
            pool,
            ray.put(direct.work(plan.dataset.context)),
            direct_runs(files),
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            local_shuffle_buffer_size=plan.local_shuffle_buffer_size,
            local_shuffle_seed=plan.local_shuffle_seed,
            collate_fn=self.collate_fn,
            prefetch=prefetch,
            timeout=self.timeout,
            pin_memory=pin,
            length=self._length_or_none(epoch),
            epoch=epoch,
            summary=f"{' -> '.join(direct.names)} on {len(pool)} raydl actors ({len(files)} files)",
            skip=skip,
            start_next=start_next,
        )

    def _start_early(self, epoch: int, pin: bool, prefetch: int) -> bool:
        """Start ``epoch`` ahead of its ``iter()``; ``False`` if it is too soon to tell.

        Only the epoch the next ``iter()`` will run, and not when a resume is armed
        (that ``iter()`` skips batches of its own epoch, so it builds its own
        iterator). Asked by epoch ``epoch - 1`` while that one was itself started
        early and not yet taken, the answer is "not yet".
        """
        if self._next_epoch == epoch - 1:
            return False
        if self._next_epoch == epoch and self._resume is None:
            self._next.start(
                epoch, lambda: self._single_rank_iterator(epoch, pin, prefetch, skip=0)
            )
        return True

    def _ray_iterator(
        self,
        source: Any,
        buffer: int | None,
        buffer_seed: int | None,
        epoch: int,
        pin: bool,
        prefetch: int,
        skip: int,
        length: int | None = None,
        **hooks: Any,
    ) -> RayDatasetIterator:
        assert self.batch_size is not None  # refused for Ray Data sources in __init__
        return RayDatasetIterator(
            source,
            local_shuffle_buffer_size=buffer,
            local_shuffle_seed=buffer_seed,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            collate_fn=self.collate_fn,
            prefetch=prefetch,
            timeout=self.timeout,
            pin_memory=pin,
            length=length if length is not None else self._length_or_none(epoch),
            epoch=epoch,
            skip=skip,
            stages=stage_names(self._epoch_dataset(epoch)),
            **hooks,
        )

    def _iter_torch_dataset(
        self, epoch: int, pin: bool, prefetch: int, resume: LoaderState | None
    ) -> Any:
        if self._auto_sharded:
            self.sampler.set_epoch(epoch)  # type: ignore[union-attr]
        world = self._world
        self._epoch_in_progress = epoch
        self._epoch_prior = []
        index_iter: Iterator[Any] | None
        if resume is not None and resume.needs_elastic(world.world_size):
            # The rest of an epoch saved at another world size: rebuild its order
            # and deal what no rank consumed; the state keeps describing that epoch.
            share = map_style_share(
                resume, world.world_size, world.rank, self.batch_size, self.drop_last
            )
            self._epoch_rng, self._epoch_sampler_epoch = resume.rng, resume.sampler_epoch
            self._epoch_order, self._epoch_prior = resume.order, resume.segments
            index_iter, length, resume = iter(share), len(share), None
        else:
            if resume is not None:
                self._restore_rng(resume)
            self._epoch_rng = self._capture_rng()
            self._epoch_sampler_epoch = getattr(self.sampler, "epoch", None)
            self._epoch_order = {
                **sampler_spec(self.sampler, self.batch_sampler),
                "worker_seed_drawn": not (self.persistent_workers and self._pool is not None),
            }
            # torch draws the sampler iterator, then the workers' base seed, in this
            # order; persistent workers are seeded once, so torch draws it only once.
            index_iter = iter(self._index_sampler) if not self._is_iterable else None
            length = len(self._index_sampler) if not self._is_iterable else 0
        if self.persistent_workers and self._pool is not None:
            pool = self._pool
        else:
            if self.persistent_workers and resume is not None and resume.worker_seed is not None:
                base_seed = resume.worker_seed  # drawn in the first epoch, not now
            else:
                base_seed = int(
                    torch.empty((), dtype=torch.int64).random_(generator=self.generator).item()
                )
            self._worker_seed = base_seed
            pool = self._fresh_pool(base_seed)
            if self.persistent_workers:
                self._pool = pool
        # Without persistent workers each iterator owns its pool while it runs, as each
        # torch iterator owns its processes: two live iterators (zip(loader, loader)) are
        # independent. At the end of the epoch the pool is parked, and the next epoch
        # resets its actors instead of starting new processes.
        on_close = None if self.persistent_workers else (lambda: self._park(pool))
        skip = resume.batches_consumed if resume is not None else 0
        if index_iter is None:
            return IterableIterator(
                pool,
                prefetch=prefetch,
                timeout=self.timeout,
                pin_memory=pin,
                length=self._length_or_none(epoch),
                on_close=on_close,
                skip=skip,
            )
        # Resuming a map-style epoch skips the consumed batches' indices: nothing is re-fetched.
        for _ in range(skip):
            next(index_iter, None)
        return MapStyleIterator(
            pool,
            index_iter,
            skip=skip,
            prefetch=prefetch,
            in_order=self.in_order,
            timeout=self.timeout,
            pin_memory=pin,
            length=length,
            on_close=on_close,
        )

    def _fresh_pool(self, base_seed: int) -> WorkerPool:
        """A pool whose workers are new for this epoch: a parked one reset, or a new one."""
        spec = self._worker_spec(base_seed)
        if self._parked:
            pool = self._parked.pop()
            pool.reset(spec)
            return pool
        return WorkerPool(
            self.dataset,
            spec,
            restartable=not self._is_iterable,
            options=self.options.worker_options,
        )

    def _park(self, pool: WorkerPool) -> None:
        # Parked actors only cost memory when they hold no resources (Ray's actor
        # default). Workers given resources (worker_options) release them as torch's
        # processes would: other work on the cluster may need those CPUs/GPUs.
        if pool.actors and not self.options.worker_options:
            self._parked.append(pool)
        else:
            pool.kill()

    def _worker_spec(self, base_seed: int) -> WorkerSpec:
        return WorkerSpec(
            num_workers=max(1, self.num_workers),
            collate_fn=self.collate_fn,
            auto_collation=self._auto_collation,
            worker_init_fn=self.worker_init_fn,
            base_seed=base_seed,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
        )

    def _drop_pool(self) -> None:
        pool, self._pool = self._pool, None
        parked, self._parked = self._parked, []
        direct, self._direct_pool = self._direct_pool, None
        for each in [pool, direct, *parked]:
            if each is not None:
                each.kill()

    def _use_pinned_memory(self) -> bool:
        if not self.pin_memory:
            return False
        if torch.cuda.is_available():
            return True
        if not self._pin_warned:
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
                stacklevel=3,
            )
            self._pin_warned = True
        return False

    def _close_iterator(self) -> None:
        iterator, self._iterator = self._iterator, None
        if iterator is not None:
            iterator.close()

    def _retire_splits(self) -> None:
        """Stop the previous epoch's split coordinator (rank 0 only; it owns it).

        Every rank has moved past that epoch (they all reached this epoch's
        broadcast, or the loader is closing), so nobody reads from it any more;
        killing it stops an abandoned epoch's pipeline from holding cluster
        resources while it waits for readers that will never come.
        """
        splits, self._splits = self._splits, None
        if splits and cluster.is_connected():
            # streaming_split's coordinator, or an elastic epoch's share holder
            if isinstance(splits, list):
                coordinator = getattr(splits[0], "_coord_actor", None)
            else:
                coordinator = splits
            if coordinator is not None:
                import ray

                with contextlib.suppress(Exception):
                    ray.kill(coordinator)

    def close(self) -> None:
        """Stop the current epoch and the Ray actors of this loader (it can be iterated again)."""
        self._close_iterator()
        self._next.discard()
        self._drop_pool()
        self._retire_splits()

    def __enter__(self) -> RayDataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
