"""``RayDataLoader``: torch's ``DataLoader`` interface, with the work done on Ray.

Swap one import and keep the training script::

    from raydl import RayDataLoader as DataLoader

The class is a facade: torch's arguments are checked in ``_internal/torch_args.py``,
and each epoch comes from an epoch source chosen once, at construction
(``_internal/epochs/torch_source.py`` for torch datasets, ``ray_source.py`` for Ray
Data plans), through the one epoch iterator (``_internal/stream/epoch_iterator.py``).
See ``docs/design/run-paths.md`` for how each kind of dataset maps onto Ray.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.utils.data import Sampler

from raydl._internal.epochs.ray_source import RaySettings, RaySource
from raydl._internal.epochs.record import EpochRecord
from raydl._internal.epochs.resume import can_rebuild
from raydl._internal.epochs.shuffle import seed_from_torch
from raydl._internal.epochs.state import LoaderState
from raydl._internal.epochs.torch_source import TorchSettings, TorchSource
from raydl._internal.io import skips
from raydl._internal.runtime.startup import begin_for, connect
from raydl._internal.runtime.world import Channel, World
from raydl._internal.stream.device import PinMemory, copy_stage, resolve_device
from raydl._internal.stream.epoch_iterator import EpochIterator
from raydl._internal.stream.metrics import EpochStats, summarize
from raydl._internal.torch_args import MAP, RAY, check, check_snapshot_every, with_defaults
from raydl.errors import NumWorkersMismatchError
from raydl.options import LoaderOptions

__all__ = ["LoaderOptions", "RayDataLoader"]

_FROZEN_ATTRS = (
    "batch_size",
    "batch_sampler",
    "sampler",
    "drop_last",
    "dataset",
    "persistent_workers",
)


class RayDataLoader(Iterable[Any]):
    """A drop-in ``torch.utils.data.DataLoader`` whose loading runs on a Ray cluster.

    The arguments up to ``in_order`` are torch's, in torch's order, with torch's
    meaning and torch's errors. Differences:

    * ``num_workers``: the number of Ray actors that run ``__getitem__``/``__getitems__``
      and ``collate_fn`` of a torch ``Dataset``. ``0`` loads in the training process, as
      torch does (no pickling, no Ray; ``timeout`` then needs ``num_workers > 0``). Ignored
      for ``ray.data.Dataset`` sources, whose parallelism is set per stage
      (``map_batches(num_cpus=..., concurrency=...)``). ``"auto"`` (map-style only): grown
      while the trainer waits, within ``cpu_budget``.
    * ``persistent_workers``: keep the actors (and their dataset state) between epochs;
      otherwise they start at ``iter()`` and stop when the epoch ends, as torch's processes.
    * ``prefetch_factor``: batches in flight per actor, or buffered (Ray Data); ``"auto"``: tuned.
    * ``multiprocessing_context``: checked as torch checks it, then unused (no subprocesses).
    * ``timeout``: seconds to wait for a batch, then ``LoaderTimeoutError`` (torch's words).
    * ``ray.data.Dataset`` sources yield ``dict[str, Tensor]`` (``collate_fn``: numpy dicts).

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
        multiprocessing_context: Checked as torch checks it; unused.
        generator: RNG of the default ``RandomSampler`` and of the worker seeds.
        prefetch_factor: Batches in flight per worker.
        persistent_workers: Keep the Ray actors across epochs.
        pin_memory_device: Accepted for compatibility (deprecated in torch).
        in_order: Return batches in sampler order; ``False`` returns them as they finish.
        snapshot_every_n_steps: torchdata's: how often, in batches, the workers' own
            state is captured for :meth:`state_dict` when the dataset (or its iterator)
            is ``Stateful`` (has ``state_dict``/``load_state_dict``); a resume restores
            the last capture and loads the batches since then again. ``None`` or ``0``:
            only at each epoch's start.
        seed: See :class:`LoaderOptions`.
        shuffle_mode: See :class:`LoaderOptions`.
        local_shuffle_buffer_size: See :class:`LoaderOptions`.
        deterministic: See :class:`LoaderOptions`.
        ray_address: See :class:`LoaderOptions`.
        worker_options: See :class:`LoaderOptions`.
        overlap_epochs: See :class:`LoaderOptions`.
        direct_execution: See :class:`LoaderOptions`.
        start_in_process: See :class:`LoaderOptions`.
        progress_bar: See :class:`LoaderOptions`.
        log_stats: See :class:`LoaderOptions`.
        device: See :class:`LoaderOptions`.
        world: See :class:`LoaderOptions`.
        background_start: See :class:`LoaderOptions`.
        cpu_budget: See :class:`LoaderOptions`.

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
        num_workers: int | str = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | str | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        snapshot_every_n_steps: int | None = 1,
        seed: int | None = None,
        shuffle_mode: str = "global",
        local_shuffle_buffer_size: int | None = None,
        deterministic: bool = True,
        ray_address: str | None = None,
        worker_options: Mapping[str, Any] | None = None,
        overlap_epochs: bool = True,
        direct_execution: bool = True,
        start_in_process: bool = True,
        progress_bar: bool = False,
        log_stats: bool = False,
        device: str | torch.device | int | None = None,
        world: World | None = None,
        background_start: bool | None = None,
        cpu_budget: float | None = None,
    ) -> None:
        checked = check(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            drop_last=drop_last,
            timeout=timeout,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            multiprocessing_context=multiprocessing_context,
        )
        check_snapshot_every(snapshot_every_n_steps)
        self.options = LoaderOptions(
            seed=seed,
            shuffle_mode=shuffle_mode,
            local_shuffle_buffer_size=local_shuffle_buffer_size,
            deterministic=deterministic,
            ray_address=ray_address,
            worker_options=dict(worker_options or {}),
            overlap_epochs=overlap_epochs,
            direct_execution=direct_execution,
            start_in_process=start_in_process,
            progress_bar=progress_bar,
            log_stats=log_stats,
            device=device,
            world=world,
            background_start=background_start,
            cpu_budget=cpu_budget,
        )
        self._world = world if world is not None else World.detect()
        args = with_defaults(checked, dataset, generator=generator, seed=seed, world=self._world)
        self.dataset = dataset
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor if args.auto_prefetch else args.prefetch_factor
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = args.multiprocessing_context
        self.in_order = in_order
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.shuffle = args.shuffle
        self.batch_size = args.batch_size
        self.drop_last = args.drop_last
        self.sampler = args.sampler
        self.batch_sampler = args.batch_sampler
        self.generator = generator
        self.collate_fn = args.collate_fn
        self.persistent_workers = persistent_workers

        self._kind = args.kind
        # Only Ray Data shuffles use this seed; torch datasets take their order from
        # the sampler exactly as torch does, so their RNG streams are not touched here.
        if seed is not None:
            self._base_seed = seed
        elif args.kind == RAY and args.shuffle:
            self._base_seed = (
                generator.initial_seed() & (2**31 - 1)
                if generator is not None
                else seed_from_torch(None)
            )
        else:
            self._base_seed = 0
        prefetch = self._prefetch = args.prefetch_factor if args.prefetch_factor is not None else 2
        self._source: TorchSource | RaySource
        if args.kind == RAY:
            assert args.batch_size is not None  # refused for Ray Data sources by resolve()
            self._source = RaySource(
                dataset,
                RaySettings(
                    batch_size=args.batch_size,
                    drop_last=args.drop_last,
                    shuffle=args.shuffle,
                    collate_fn=args.collate_fn,
                    prefetch=prefetch,
                    timeout=timeout,
                    seed=self._base_seed,
                    options=self.options,
                ),
                self._world,
            )
        else:
            self._source = TorchSource(
                dataset,
                TorchSettings(
                    args=args,
                    num_workers=1 if args.auto_workers else num_workers,  # type: ignore[arg-type]
                    prefetch=prefetch,
                    in_order=in_order,
                    persistent_workers=persistent_workers,
                    worker_init_fn=worker_init_fn,
                    generator=generator,
                    worker_options=dict(self.options.worker_options),
                    ray_address=ray_address,
                    timeout=timeout,
                    cpu_budget=self.options.cpu_budget,
                    start_in_process=self.options.start_in_process,
                    snapshot_every_n_steps=snapshot_every_n_steps,
                ),
                self._world,
            )
        self._next_epoch = 0
        self._resume: LoaderState | None = None  # an epoch under way to go on with
        self._loaded: LoaderState | None = None  # the state loaded, until the next iter()
        self._refused: NumWorkersMismatchError | None = None  # raised by the next iter()
        self._iterator: EpochIterator | None = None
        self._record: EpochRecord | None = None  # the last epoch started
        self._stats: list[EpochStats] = []
        self._pinning = PinMemory(pin_memory)
        self._startup = begin_for(
            self._source, self.options.ray_address, self._world, self.options.background_start
        )
        self._initialized = True

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
        self._expect(epoch)
        self._source.discard_early(keep=epoch)

    def _expect(self, epoch: int) -> None:
        """The next ``iter()`` runs ``epoch``; the source's early start follows it."""
        self._next_epoch = epoch
        self._source.expect(epoch, resume=self._resume is not None)

    def _dataset_len(self) -> int | None:
        source = self._source
        return source.dataset_len() if isinstance(source, TorchSource) else None

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
        iterator, record = self._iterator, self._record
        running = iterator is not None and not iterator.exhausted and record is not None
        if not running and self._loaded is not None:
            return self._loaded.to_dict()  # loaded and not iterated yet: that same position
        now = record if running else None
        consumed, ahead = 0, None
        if now is not None and iterator is not None:
            consumed, ahead = now.delivered(
                iterator.skipped, iterator.num_yielded - iterator.skipped
            )
        state = LoaderState(
            kind=self._kind,
            epoch=now.epoch if now is not None else self._next_epoch,
            epoch_started=now is not None,
            batches_consumed=consumed,
            world_size=self._world.world_size,
            dataset_len=self._dataset_len(),
            seed=self._base_seed,
            # Between epochs: the RNG the next epoch will draw its order from.
            rng=now.rng if now is not None else self._source.rng_now(),
            sampler_epoch=now.sampler_epoch if now is not None else None,
            sampler_state=now.sampler_state if now is not None else self._source.samplers_now(),
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            progress=[[w, k] for w, k in [*now.prior, (self._world.world_size, consumed)]]
            if now is not None
            else None,
            order=now.order if now is not None else None,
            worker_seed=self._worker_seed(),
            direct_execution=(record is not None and record.direct) if self._kind == RAY else None,
            fingerprint=(iterator.stats.fingerprint or None)
            if running and iterator is not None
            else None,
            num_workers=self._source.state_workers,
            delivered_ahead=ahead or None,
            worker_snapshot=now.worker_snapshot(consumed, ahead or [])
            if now is not None
            else self._source.states_between_epochs(),
        )
        return state.to_dict()

    def _worker_seed(self) -> int | None:
        if not self.persistent_workers or self._record is None:
            return None
        return self._record.worker_seed

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
        ``autotune``: what ``"auto"`` decided (docs/design/run-paths.md, "num_workers='auto'").

        Example:
            >>> loader.stats()["total"]["stall_fraction"]  # doctest: +SKIP
            0.013
        """
        return {**summarize(self._stats), "skipped_files": skips.snapshot(), **_tuned(self._source)}

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
            NumWorkersMismatchError: From the next ``iter()``, as torchdata raises its
                ``AssertionError`` there: the state holds an ``IterableDataset``'s epoch
                under way, or a ``Stateful`` dataset's worker states, saved with another
                ``num_workers`` (the message names both counts).
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
        self._refused = None
        try:
            self._check(state)
        except NumWorkersMismatchError as err:
            self._refused = err  # raised by the next iter(), as torchdata raises it there
            return
        self._close_iterator()
        self._source.discard_early()
        if state.started:
            self._resume = state  # the next iter() goes on with that epoch
        else:
            self._resume = None
            self._source.load_between_epochs(state)  # its RNG and persistent workers' seed
        self._loaded = state
        self._expect(state.epoch)

    def _check(self, state: LoaderState) -> None:
        """Refuse a state this loader cannot resume exactly (errors name both values)."""
        state.check_matches(
            kind=self._kind,
            dataset_len=self._dataset_len(),
            seed=self._base_seed,
            world_size=self._world.world_size,
            batch_size=self.batch_size,
            elastic=self._kind == RAY or (self._kind == MAP and can_rebuild(state)),
            num_workers=self._source.state_workers,
        )

    def __len__(self) -> int:
        return self._source.length(self._next_epoch)

    def __iter__(self) -> EpochIterator:
        refused, self._refused = self._refused, None
        if refused is not None:
            raise refused
        if self.persistent_workers or self._world.is_distributed:
            # The previous epoch shares this loader's actors or its ranks' collective
            # schedule: it ends here. Otherwise it lives on independently, as in torch.
            self._close_iterator()
        startup, self._startup = self._startup, None
        if not self._source.takes_start(startup):  # else the source waits when it needs Ray
            connect(startup, self.options.ray_address, self._world, self._source.worker_modules)
        epoch = self._next_epoch
        resume, self._resume, self._loaded = self._resume, None, None
        self._expect(epoch + 1)
        pin = self._pinning.use()
        device = resolve_device(self.options.device)
        if isinstance(self._source, RaySource):
            started = self._source.start_epoch(epoch, resume)
        else:
            # A device copy stage holds batches of its own: the sampler runs that much
            # further ahead, so the workers keep as much in flight (a pin stage's count in
            # the window, as torch's pin thread's do, and keeps the trainer's stand-ins).
            started = self._source.start_epoch(
                epoch, resume, lookahead=self._prefetch + 1 if device else 0
            )
        record = self._record = started.record
        if record.epoch != epoch:  # several ranks: rank 0's epoch is everyone's
            self._expect(record.epoch + 1)
        producer = copy_stage(
            started.producer, device=device, pin=pin, depth=self._prefetch, epoch=record.epoch
        )
        iterator = EpochIterator(
            producer,
            epoch=record.epoch,
            skip=started.skip,
            length=started.length,
            timeout=self.timeout,
            on_exhausted=started.on_exhausted,
            workers=self.num_workers if isinstance(self.num_workers, int) else 0,
        )
        iterator.log_summary = self.options.log_stats
        if resume is not None and not resume.needs_elastic(self._world.world_size):
            iterator.stats.fingerprint = resume.fingerprint or ""  # goes on from the save
        if self.options.progress_bar:
            iterator.progress = _progress_bar(started.length, record.epoch)
        self._stats.append(iterator.stats)
        iterator.loader = self
        self._iterator = iterator
        return iterator

    def _close_iterator(self) -> None:
        iterator, self._iterator = self._iterator, None
        if iterator is not None:
            iterator.close()

    def close(self) -> None:
        """Stop the current epoch and the Ray actors of this loader (it can be iterated again)."""
        startup, self._startup = getattr(self, "_startup", None), None
        if startup is not None:
            startup.cancel()
        self._close_iterator()
        self._source.close()

    def __enter__(self) -> RayDataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _tuned(source: TorchSource | RaySource) -> dict[str, Any]:
    """``{"autotune": ...}`` for ``stats()`` with ``num_workers="auto"``, else nothing."""
    report = source.autotune() if isinstance(source, TorchSource) else None
    return {} if report is None else {"autotune": report}


def _progress_bar(length: int | None, epoch: int) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError as err:
        raise ImportError(
            "progress_bar=True needs tqdm, which is not installed; "
            "pip install 'raydl[progress]' (or tqdm), or pass progress_bar=False"
        ) from err
    return tqdm(total=length, desc=f"epoch {epoch}", unit="batch")
