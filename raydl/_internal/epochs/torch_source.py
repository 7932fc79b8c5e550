"""Epochs of a torch ``Dataset``: map-style or iterable, on a pool of Ray actors.

With ``num_workers=0`` an epoch loads in the training process, as torch's does
(``stream/in_process.py``: no actors, no pickling, no Ray). Otherwise a
:class:`TorchSource` owns the dataset's workers for the loader's life:

* persistent workers: one pool, kept until ``close()``;
* otherwise each epoch owns a pool while it runs, as each torch iterator owns
  its processes (two live iterators, ``zip(loader, loader)``, are independent).
  At the end of the epoch the pool is parked, and a later epoch resets its
  actors instead of starting new processes.

Order is torch's: the sampler is iterated on the trainer's thread, and the RNG
draws (a DataPipe's shuffle seed, the sampler iterator, then the workers' base
seed, drawn even without workers) happen in torch's order, so the same
``torch.manual_seed`` gives the same batches as torch's loader.

DataPipes as torch's ``DataLoader`` runs them: ``shuffle`` switches their
shufflers on or off (``torch_args.check``), each epoch draws one seed for them
(``apply_random_seed``, in every worker alike), and ``sharding_filter`` is
applied per rank and worker (``apply_sharding``; without workers, per rank).
Under several ranks the shuffle seed is each rank's own draw (torch broadcasts
rank 0's): seed the ranks alike.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterDataPipe, MapDataPipe
from torch.utils.data.graph_settings import apply_random_seed, apply_sharding

from raydl._internal.epochs.elastic import batch_counts
from raydl._internal.epochs.first_pool import FirstPool
from raydl._internal.epochs.record import EpochRecord, EpochStart
from raydl._internal.epochs.resume import map_style_share, sampler_spec
from raydl._internal.epochs.state import LoaderState, decode_rng, encode_rng
from raydl._internal.runtime.cluster import is_connected
from raydl._internal.runtime.env import cpu_budget_default
from raydl._internal.runtime.env import ray_address as ray_address_env
from raydl._internal.runtime.startup import BackgroundStart, Warm, connect
from raydl._internal.runtime.world import World
from raydl._internal.stream.autotune import AutoTuner, worker_budget
from raydl._internal.stream.batching import positioned
from raydl._internal.stream.epoch_iterator import Producer
from raydl._internal.stream.in_process import InProcessProducer, LengthWatch
from raydl._internal.stream.pool_producers import IterableProducer, MapStyleProducer
from raydl._internal.stream.worker_states import Snapshot, StateTracker
from raydl._internal.torch_args import (
    ITERABLE,
    TorchArgs,
    local_cpu_count,
    warn_excessive_workers,
)
from raydl._internal.workers import stateful
from raydl._internal.workers.emulated import EmulatedWorkers
from raydl._internal.workers.payload import pickle_payload
from raydl._internal.workers.pool import WorkerPool
from raydl._internal.workers.stateful import is_stateful
from raydl._internal.workers.worker import WorkerSpec


@dataclass(frozen=True)
class TorchSettings:
    """The loader's arguments a torch ``Dataset``'s epochs need."""

    args: TorchArgs
    num_workers: int
    prefetch: int
    in_order: bool
    persistent_workers: bool
    worker_init_fn: Callable[[int], None] | None
    generator: torch.Generator | None
    worker_options: dict[str, Any]
    ray_address: str | None = None
    timeout: float = 0
    cpu_budget: float | None = None  # num_workers="auto": see LoaderOptions.cpu_budget
    snapshot_every_n_steps: int | None = 1  # Stateful workers' states: torchdata's meaning
    start_in_process: bool = True  # see LoaderOptions.start_in_process


class TorchSource:
    """The epochs of a map-style or iterable torch ``Dataset``."""

    def __init__(self, dataset: Any, settings: TorchSettings, world: World) -> None:
        self._dataset = dataset
        self._settings = settings
        self._args = settings.args
        self._world = world
        self._iterable = settings.args.kind == ITERABLE
        self._pool: WorkerPool | None = None  # persistent workers
        self._parked: list[WorkerPool] = []  # idle pools of finished epochs
        self._worker_seed: int | None = None  # base seed of the persistent workers
        self._len_called: int | None = None  # len(dataset) as len(loader) last saw it
        self._cpus_checked = False
        self._tuners: weakref.WeakKeyDictionary[WorkerPool, AutoTuner] = weakref.WeakKeyDictionary()
        self._last_tuner: AutoTuner | None = None  # of the last epoch started
        self._budget: int | None = None  # num_workers="auto": the most workers
        self._pending_states: list[Any] | None = None  # loaded between epochs, for the next
        # The loader's background start, until an epoch needs Ray (_connect).
        self._startup: BackgroundStart | None = None
        # The first pool, its payload and the trainer's stand-ins for its workers.
        self._first = FirstPool(self._pickle)
        if settings.args.auto_workers:
            self._cpus_checked = True  # the budget is within the CPUs: nothing to warn
        elif settings.num_workers > 0 and (is_connected() or settings.ray_address is None):
            self._check_cpus()  # else: at the first epoch, once the cluster is known

    @property
    def _auto(self) -> bool:
        return self._args.auto_workers or self._args.auto_prefetch

    def autotune(self) -> dict[str, Any] | None:
        """``stats()["autotune"]``: the rule's state and changes of the last epoch's pool."""
        tuner = self._last_tuner
        return None if tuner is None else tuner.report()

    def _worker_budget(self) -> int:
        """``num_workers="auto"``'s most workers (Ray is connected): see ``LoaderOptions.cpu_budget``."""
        if self._budget is None:
            per = float(self._settings.worker_options.get("num_cpus") or 1)
            cpus = self._settings.cpu_budget or cpu_budget_default()
            if cpus is not None:
                self._budget = worker_budget(cpus, per)
            else:  # the cluster's, less one CPU per rank, shared by the ranks' loaders
                import ray

                total = float(ray.cluster_resources().get("CPU", 1))
                self._budget = worker_budget(total, per, ranks=self._world.world_size)
        return self._budget

    #: Nothing to preload in the workers of an embedded instance it starts: its actors
    #: import torch and the dataset as they unpickle it, within a moment of Ray's start
    #: (a preloaded torch measured no sooner), and Ray Data would cost them memory.
    worker_modules: tuple[str, ...] = ()
    #: What its actors import, for the embedded instance's fork server to share: torch
    #: (the dataset's unpickling, collation) and numpy (docs/design/embedded-runtime.md, "Forked workers").
    shared_modules: tuple[str, ...] = ("numpy", "torch")

    @property
    def in_process(self) -> bool:
        """Epochs load in the training process (``num_workers=0``, as torch): no Ray."""
        return self._settings.num_workers == 0

    def takes_start(self, startup: BackgroundStart | None) -> bool:
        """Keep the loader's background start: an epoch waits for it only when it needs Ray.

        A map-style epoch may load its first batches here while it goes on
        (``start_in_process``, see :mod:`~raydl._internal.workers.emulated`).
        """
        if startup is not None:
            self._startup = startup
        return True

    def _connect(self) -> None:
        """Wait for the loader's start, raising its error, and make sure Ray is connected."""
        startup, self._startup = self._startup, None
        connect(startup, self._settings.ray_address, self._world, self.worker_modules)

    def warm(self) -> Warm[WorkerPool] | None:
        """What the loader's background start warms: the first epoch's actors.

        Started with a placeholder seed and parked: the first epoch takes them as
        any parked pool, resetting them to its spec (its base seed is drawn at that
        ``iter()``, from the RNG state torch would use then). They import torch and
        unpickle the dataset meanwhile; ``worker_init_fn`` runs at that reset.
        """
        if self.in_process:
            return None
        return Warm(
            build=lambda: self._new_pool(self._spec(base_seed=0), ahead=True),
            adopt=self._parked.append,
            discard=WorkerPool.kill,
        )

    def _check_cpus(self) -> None:
        """torch's warning when ``num_workers`` exceeds the CPUs the actors may use."""
        self._cpus_checked = True
        if is_connected():
            import ray

            cpus: float | None = ray.cluster_resources().get("CPU")
            where = "the Ray cluster"
        elif ray_address_env() is None and self._settings.ray_address is None:
            cpus, where = local_cpu_count(), "this machine, which the embedded Ray instance uses"
        else:
            self._cpus_checked = False  # a cluster not joined yet: look when it is
            return
        per_actor = float(self._settings.worker_options.get("num_cpus") or 0)
        if cpus is not None and per_actor > 0:
            cpus = cpus / per_actor
        warn_excessive_workers(self._settings.num_workers, cpus, where)

    # -- length ---------------------------------------------------------------------

    def length(self, epoch: int) -> int:
        """``len(loader)``: batches of an epoch; ``TypeError`` when the dataset has no length.

        For an ``IterableDataset`` the length seen is kept: an epoch started later
        warns (as torch does) when it yields more batches than that.
        """
        if self._iterable:
            self._len_called = len(self._dataset)
        return self._batches()

    def _batches(self) -> int:
        if self._iterable:
            return batch_counts(len(self._dataset), self._args.batch_size, self._args.drop_last)
        return len(self._index_sampler)

    @property
    def _index_sampler(self) -> Any:
        args = self._args
        return args.batch_sampler if args.batch_sampler is not None else args.sampler

    def dataset_len(self) -> int | None:
        """``len(dataset)``, or ``None`` when it has none (recorded in states)."""
        try:
            return len(self._dataset)
        except TypeError:
            return None

    # -- an epoch -------------------------------------------------------------------

    def start_epoch(self, epoch: int, resume: LoaderState | None, lookahead: int) -> EpochStart:
        """Start ``epoch`` (the rest of it when ``resume``); ``lookahead``: extra requests ahead."""
        args, world = self._args, self._world
        if args.auto_sharded:
            args.sampler.set_epoch(epoch)
        record = EpochRecord(epoch=epoch)
        index_iter: Iterator[Any] | None = None
        length: int | None = None
        shared_seed: int | None = None
        if resume is not None and resume.needs_elastic(world.world_size):
            # The rest of an epoch saved at another world size: rebuild its order
            # and deal what no rank consumed; the record keeps describing that epoch.
            share = map_style_share(
                resume, world.world_size, world.rank, args.batch_size, args.drop_last
            )
            record.rng, record.sampler_epoch = resume.rng, resume.sampler_epoch
            record.order, record.prior = resume.order, resume.segments
            index_iter, length, resume = iter(share), len(share), None
        else:
            if resume is not None:
                self._restore_rng(resume)
                self._restore_samplers(resume.sampler_state)
            record.rng = self._capture_rng()
            record.sampler_state = self.samplers_now()
            shared_seed = self._datapipe_seed()
            record.sampler_epoch = getattr(args.sampler, "epoch", None)
            record.order = {
                **sampler_spec(args.sampler, args.batch_sampler),
                "worker_seed_drawn": self._draws_worker_seed(resume),
            }
            # torch draws the sampler iterator, then the workers' base seed, in this
            # order; persistent workers are seeded once, so torch draws it only once.
            if not self._iterable:
                index_iter = _noting_sampler_epoch(iter(self._index_sampler), args.sampler, record)
                length = len(self._index_sampler)
        if self.in_process:
            return self._in_process_epoch(record, index_iter, length, resume, shared_seed)
        if not self._cpus_checked:
            self._check_cpus()
        base_seed = self._epoch_seed(resume)
        skip = resume.batches_consumed if resume is not None else 0
        ahead = list(resume.delivered_ahead or []) if resume is not None else []
        record.ahead = ahead
        pending, self._pending_states = self._pending_states, None
        states = self._state_tracker(resume, ahead, pending)
        record.states = states
        rest, start = _where_to_start(
            index_iter, skip, ahead, states.base if states is not None else None
        )
        here = (
            rest is not None
            and states is None
            and pending is None  # the workers go on from saved RNGs: no stand-ins for them
            and self._may_load_here(lookahead)
        )
        if here and self._startup is not None and not self._startup.done and self._spec_known():
            assert rest is not None
            starting = self._before_the_pool(epoch, base_seed, rest)
            if starting is not None:
                record.handed_by = starting
                record.worker_seed = self._worker_seed_of_record()
                return EpochStart(starting, record, skip=skip, length=length)
        self._connect()
        pool, on_close = self._epoch_pool(base_seed)
        if pending is not None and states is None:  # their RNGs (a dataset with no state)
            pool.load_states(pending)
        stand_ins = self._stand_ins_for(pool, base_seed) if here else None
        if self._settings.timeout > 0 or self._settings.worker_init_fn is not None:
            # torch's timeout bounds the wait for a batch, not for its workers' start
            # (torch starts its processes inside iter()): start them here too. With a
            # worker_init_fn (no batch loads here then) its failure is raised by iter(),
            # as torchdata raises it.
            pool.wait_ready()
        record.worker_seed = self._worker_seed_of_record()
        prefetch = self._settings.prefetch
        producer: Producer
        if rest is None:
            producer = IterableProducer(
                pool,
                prefetch=prefetch,
                skip=skip - start,
                on_close=on_close,
                shared_seed=shared_seed,
                watch=self._watch(skip),
                states=states,
            )
            record.states = producer.states  # None once its workers said nothing is Stateful
            length = self._length_or_none()
        else:
            # A resumed map-style epoch skips the consumed batches' indices: nothing is
            # fetched again.
            tuner = self._last_tuner = self._tuners.get(pool)
            workers = len(pool) if stand_ins is None else stand_ins.spec.num_workers
            producer = record.handed_by = MapStyleProducer(
                pool,
                rest,
                lookahead=(tuner.depth if tuner is not None else prefetch * workers) + lookahead,
                in_order=self._settings.in_order,
                on_close=on_close,
                tuner=tuner,
                epoch=epoch,
                here=stand_ins,
                start_of=self._first.actor_start,
                states=states,
            )
        return EpochStart(producer, record, skip=skip, length=length)

    def _state_tracker(
        self, resume: LoaderState | None, ahead: list[int], pending: list[Any] | None
    ) -> StateTracker | None:
        """The snapshots of a ``Stateful`` dataset's workers this epoch, ``None`` without any.

        A map-style dataset is stateful when it has ``state_dict``/``load_state_dict``;
        an iterable one's workers say so as they start (its iterator may be). A
        resumed epoch starts from its saved snapshot: the batches before it are
        skipped, those after it that were delivered are loaded again and dropped.
        ``pending``: persistent workers' states saved between epochs, to start from.
        """
        if not self._iterable and not is_stateful(self._dataset):
            return None
        tracker = StateTracker(self._settings.snapshot_every_n_steps, self._worker_count())
        saved = resume.worker_snapshot if resume is not None else None
        if saved is not None and resume is not None:
            tracker.base = Snapshot.from_dict(saved)
            prefix = resume.batches_consumed - len(ahead)
            delivered = {*range(tracker.base.step, prefix), *ahead}
            tracker.drop = frozenset(p for p in delivered if p >= tracker.base.step)
        elif pending is not None:
            tracker.base = Snapshot(0, 0, pending)  # persistent workers' states between epochs
        return tracker

    def _worker_count(self) -> int:
        return self._worker_budget() if self._args.auto_workers else self._settings.num_workers

    def states_between_epochs(self) -> dict[str, Any] | None:
        """What the next epoch starts from, for a state saved between epochs.

        The dataset of ``num_workers=0`` (``Stateful`` datasets), or each persistent
        worker's ``resting_state``: its global RNGs and its dataset's state. An
        ``IterableDataset``'s iterators are left out: the next epoch starts a new pass
        (torchdata's convention: a dataset's state between passes describes the start
        of the next).
        """
        if self._pending_states is not None:
            return Snapshot(0, 0, self._pending_states).to_dict()
        if self.in_process:
            state = stateful.capture(self._dataset, None, iterable=False)
            return None if state is None else Snapshot(0, 0, [state]).to_dict()
        if not self._settings.persistent_workers:
            return None
        pool, standing_in = self._pool, self._first.standing_in()
        if pool is None and not standing_in:
            return None  # no epoch ran yet: the workers start seeded
        states = (
            pool.resting_states() if pool is not None else [{} for _ in range(self._worker_count())]
        )
        for worker_id, rng in standing_in.items():  # the trainer loaded as these workers
            states[worker_id]["rng"] = rng.to_json()
        return Snapshot(0, 0, list(states)).to_dict()

    def _length_or_none(self) -> int | None:
        try:
            return self._batches()
        except TypeError:
            return None

    def _watch(self, skip: int) -> LengthWatch | None:
        if self._len_called is None:
            return None
        return LengthWatch(
            self._dataset,
            reported=self._len_called,
            num_workers=self._settings.num_workers,
            start=skip,
        )

    def _datapipe_seed(self) -> int | None:
        """A DataPipe's shuffle seed for this epoch (torch's ``_share_dist_seed``), else ``None``."""
        if not isinstance(self._dataset, IterDataPipe):
            return None
        return self._draw_seed()

    def _in_process_epoch(
        self,
        record: EpochRecord,
        index_iter: Iterator[Any] | None,
        length: int | None,
        resume: LoaderState | None,
        shared_seed: int | None,
    ) -> EpochStart:
        """An epoch loaded in this process, batch by batch in ``next()`` (``num_workers=0``)."""
        args, dataset = self._args, self._dataset
        self._draw_seed()  # torch draws a base seed for its (absent) workers too
        if shared_seed is not None:
            apply_random_seed(dataset, torch.Generator().manual_seed(shared_seed))
        if isinstance(dataset, (IterDataPipe, MapDataPipe)):
            apply_sharding(dataset, self._world.world_size, self._world.rank)
        skip = resume.batches_consumed if resume is not None else 0
        ahead = (resume.delivered_ahead or []) if resume is not None else []
        saved = resume.worker_snapshot if resume is not None else None
        snapshot = Snapshot.from_dict(saved) if saved is not None else None
        rest, start = _where_to_start(index_iter, skip, ahead, snapshot)
        if rest is None:
            index_iter, length = iter(self._index_sampler), self._length_or_none()
        else:
            index_iter = (indices for _, indices in rest)
        producer = InProcessProducer(
            dataset,
            index_iter,
            iterable=self._iterable,
            auto_collation=args.batch_sampler is not None,
            collate_fn=args.collate_fn,
            drop_last=args.drop_last,
            skip=skip - start,
            watch=self._watch(skip) if self._iterable else None,
            resume=snapshot,
            every=self._settings.snapshot_every_n_steps,
        )
        record.states = producer
        return EpochStart(producer, record, skip=skip, length=length)

    # -- workers --------------------------------------------------------------------

    def _epoch_seed(self, resume: LoaderState | None) -> int:
        """The base seed of the epoch's workers, drawn now where torch draws it.

        Persistent workers are seeded once: their seed is drawn by the first epoch
        (or comes from the resumed state) and kept. A resumed epoch draws it again
        where that epoch drew it (from the restored RNG: the same seed), so that the
        sampler's own draws come after it, as they did; a pool seeded otherwise is
        replaced.
        """
        settings = self._settings
        drawn = self._draw_seed() if self._draws_worker_seed(resume) else None
        saved = resume.worker_seed if resume is not None else None
        if settings.persistent_workers and saved is not None:
            self._reseed_persistent(saved)
            return saved
        if settings.persistent_workers and self._worker_seed is not None:
            return self._worker_seed
        assert drawn is not None  # drawn unless persistent workers have their seed
        if settings.persistent_workers:
            self._worker_seed = drawn
        return drawn

    def _reseed_persistent(self, seed: int | None) -> None:
        """Persistent workers take ``seed``; a pool started with another is replaced."""
        if seed != self._worker_seed and self._pool is not None:
            pool, self._pool = self._pool, None
            self._park(pool)
        self._worker_seed = seed

    def _draws_worker_seed(self, resume: LoaderState | None) -> bool:
        """Whether this epoch draws the workers' base seed (torch: persistent ones once)."""
        if not self._settings.persistent_workers:
            return True
        if resume is not None and resume.worker_seed is not None:
            return bool((resume.order or {}).get("worker_seed_drawn"))
        return self._worker_seed is None

    def _draw_seed(self) -> int:
        """torch's draw of the workers' base seed, from the loader's generator or the global RNG."""
        generator = self._settings.generator
        return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())

    def _worker_seed_of_record(self) -> int | None:
        return self._worker_seed if self._settings.persistent_workers else None

    def _epoch_pool(self, base_seed: int) -> tuple[WorkerPool, Callable[[], None] | None]:
        """The epoch's pool, and what to do with it when the epoch ends (Ray is connected)."""
        if self._settings.persistent_workers:
            if self._pool is None:
                self._pool = self._fresh_pool(base_seed)
            return self._pool, None
        pool = self._fresh_pool(base_seed)
        return pool, lambda: self._park(pool)

    # -- the first batches, loaded here while the actors start ---------------------------

    def _may_load_here(self, lookahead: int) -> bool:
        """Whether a map-style epoch may load batches here while its actors start.

        Not with ``in_order=False`` (a slow batch loading here would hold back every
        batch behind it), a ``worker_init_fn`` (it would run in the trainer), torch's ``timeout``
        (it starts the workers first), nor a device copy stage (``lookahead > 0``: that
        stage takes the batches on its own thread, and the stand-ins must load on the
        trainer's).
        """
        settings = self._settings
        return (
            settings.start_in_process
            and settings.in_order
            and settings.worker_init_fn is None
            and settings.timeout == 0
            and lookahead == 0
        )

    def _spec_known(self) -> bool:
        """Whether the workers' spec can be made before Ray is up.

        ``num_workers="auto"``'s worker count (which ``get_worker_info()`` reports) is
        the cluster's CPUs less one per rank unless a CPU budget is given: until Ray
        is up, its epochs wait for the pool, and load here only while its actors start.
        """
        if not self._args.auto_workers or self._budget is not None:
            return True
        return bool(self._settings.cpu_budget or cpu_budget_default())

    def _before_the_pool(
        self, epoch: int, base_seed: int, index_iter: Iterator[Any]
    ) -> MapStyleProducer | None:
        """A map-style epoch started while the loader's start still makes its pool.

        Its first batches load here; the trainer's thread takes the pool once the
        start has ended (the producer's ``acquire``, which raises the start's error).
        ``None``: no stand-ins (the dataset is too large to copy here).
        """
        settings = self._settings
        stand_ins = self._stand_ins_for(None, base_seed)
        if stand_ins is None:
            return None
        taken: list[WorkerPool] = []

        def acquire() -> tuple[WorkerPool, AutoTuner | None] | None:
            if self._startup is not None and not self._startup.done:
                return None
            self._connect()
            pool, _ = self._epoch_pool(base_seed)
            taken.append(pool)
            self._last_tuner = tuner = self._tuners.get(pool)
            return pool, tuner

        def release() -> None:
            if taken and not settings.persistent_workers:
                self._park(taken[0])

        # With "auto", the rule's settings until the pool brings its own rule (the same).
        tuner = self._new_tuner(stand_ins.spec) if self._auto else None
        return MapStyleProducer(
            None,
            index_iter,
            lookahead=tuner.depth if tuner else settings.prefetch * stand_ins.spec.num_workers,
            in_order=settings.in_order,
            on_close=release,
            tuner=tuner,
            epoch=epoch,
            here=stand_ins,
            start_of=self._first.actor_start,
            acquire=acquire,
        )

    def _stand_ins_for(self, pool: WorkerPool | None, base_seed: int) -> EmulatedWorkers | None:
        persistent = self._settings.persistent_workers
        return self._first.stand_ins(pool, self._spec(base_seed), persistent=persistent)

    def _pickle(self) -> bytes:
        settings = self._settings
        return pickle_payload(self._dataset, settings.worker_init_fn, self._args.collate_fn)

    def _fresh_pool(self, base_seed: int) -> WorkerPool:
        """A pool whose workers are new for this epoch: a parked one reset, or a new one."""
        spec = self._spec(base_seed)
        if self._parked:
            pool = self._parked.pop()
            pool.reset(spec)
            return pool
        return self._new_pool(spec)

    def _new_pool(self, spec: WorkerSpec, *, ahead: bool = False) -> WorkerPool:
        tuner = self._new_tuner(spec) if self._auto else None
        pool = self._first.new_pool(
            lambda payload: WorkerPool(
                self._dataset,
                spec,
                restartable=not self._iterable,
                options=self._settings.worker_options,
                ahead=ahead,
                # With 'auto', the workers in use only (one): on a small machine the first
                # actor answers sooner alone; the rule's spare is started at the hand-over
                # (MapStyleProducer._tune), as the first batches are taken.
                start=tuner.workers if tuner is not None else None,
                payload=payload,
            ),
            spec.num_workers,
        )
        if tuner is not None:
            self._tuners[pool] = tuner
        return pool

    def _new_tuner(self, spec: WorkerSpec) -> AutoTuner:
        """The rule's state for a new pool: one worker (or the fixed count), factor 2 (or the fixed one)."""
        args = self._args
        return AutoTuner(
            budget=spec.num_workers,
            workers=1 if args.auto_workers else spec.num_workers,
            factor=self._settings.prefetch,
            auto_workers=args.auto_workers,
            auto_factor=args.auto_prefetch,
        )

    def _spec(self, base_seed: int) -> WorkerSpec:
        args, settings = self._args, self._settings
        workers = self._worker_budget() if args.auto_workers else max(1, settings.num_workers)
        return WorkerSpec(
            num_workers=workers,
            collate_fn=args.collate_fn,
            auto_collation=args.batch_sampler is not None,
            worker_init_fn=settings.worker_init_fn,
            base_seed=base_seed,
            batch_size=args.batch_size,
            drop_last=args.drop_last,
            world_size=self._world.world_size,
            rank=self._world.rank,
        )

    def _park(self, pool: WorkerPool) -> None:
        # Parked actors only cost memory when they hold no resources (Ray's actor
        # default). Workers given resources (worker_options) release them as torch's
        # processes would: other work on the cluster may need those CPUs/GPUs.
        if pool.actors and not self._settings.worker_options:
            self._parked.append(pool)
        else:
            pool.kill()

    # -- RNG ------------------------------------------------------------------------

    def rng_now(self) -> dict[str, str]:
        """The RNG state the next epoch will draw from (a state saved between epochs)."""
        return self._capture_rng()

    @property
    def state_workers(self) -> int:
        """The workers an epoch's state records (``num_workers``)."""
        return self._settings.num_workers

    def load_between_epochs(self, state: LoaderState) -> None:
        """Take a state saved between epochs: the next epoch draws as the saved loader's would.

        Its RNG is restored now, at the load (a script that seeds torch after loading
        still decides), and persistent workers take the saved base seed, which torch
        draws only once (a pool of this loader seeded otherwise is replaced).
        """
        self._restore_rng(state)
        self._restore_samplers(state.sampler_state)
        states = state.worker_snapshot["states"] if state.worker_snapshot is not None else None
        if self.in_process and states:  # the dataset is this process's own
            stateful.restore_dataset(self._dataset, states[0])
        if not self._settings.persistent_workers:
            return
        self._pending_states = list(states) if states is not None else None
        self._reseed_persistent(state.worker_seed)

    def _stateful_samplers(self) -> dict[str, Any]:
        """The loader's ``Stateful`` samplers that are not torch's own (whose order the RNG decides)."""
        args = self._args
        found = {"sampler": args.sampler, "batch_sampler": args.batch_sampler}
        return {
            name: each
            for name, each in found.items()
            if each is not None
            and is_stateful(each)
            and type(each).__module__.split(".")[0] != "torch"
        }

    def samplers_now(self) -> dict[str, Any] | None:
        """``Stateful`` samplers' states now (before ``iter()``): an epoch draws its order from them."""
        states = {name: each.state_dict() for name, each in self._stateful_samplers().items()}
        return states or None

    def _restore_samplers(self, states: dict[str, Any] | None) -> None:
        """Load the samplers' states an epoch started from, so it draws its order again."""
        for name, each in self._stateful_samplers().items():
            if states is not None and name in states:
                each.load_state_dict(states[name])

    def _capture_rng(self) -> dict[str, str]:
        generator = self._settings.generator
        if generator is not None:
            return {"source": "generator", "state": encode_rng(generator.get_state())}
        return {"source": "global", "state": encode_rng(torch.get_rng_state())}

    def _restore_rng(self, state: LoaderState) -> None:
        if state.rng is None:
            return
        rng = decode_rng(state.rng["state"])
        generator = self._settings.generator
        if state.rng["source"] == "generator" and generator is not None:
            generator.set_state(rng)
        elif state.rng["source"] == "global":
            torch.set_rng_state(rng)
        set_epoch = getattr(self._args.sampler, "set_epoch", None)
        if state.sampler_epoch is not None and set_epoch is not None:
            set_epoch(state.sampler_epoch)

    # -- the loader's life ------------------------------------------------------------

    def expect(self, epoch: int, *, resume: bool) -> None:
        """The loader's next ``iter()`` runs ``epoch``; torch epochs are never started early."""

    def discard_early(self, keep: int | None = None) -> None:
        """Nothing is started early for torch datasets."""

    def close(self) -> None:
        """Stop every actor of this source (the next epoch starts new ones)."""
        startup, self._startup = self._startup, None
        if startup is not None:
            startup.cancel()
        pool, self._pool = self._pool, None
        self._worker_seed = None  # the next epoch's workers are new
        self._first.forget_stand_ins()
        parked, self._parked = self._parked, []
        for each in [pool, *parked]:
            if each is not None:
                each.kill()


def _where_to_start(
    index_iter: Iterator[Any] | None, skip: int, ahead: list[int], snapshot: Snapshot | None
) -> tuple[Iterator[tuple[int, Any]] | None, int]:
    """Where a run of an epoch starts: its positioned index batches (map-style) and step.

    A ``Stateful`` dataset's resume starts at its snapshot (what was delivered after
    it is loaded again and dropped); otherwise a map-style resume starts past what was
    delivered (``skip`` batches, and ``ahead``: nothing loaded again), an iterable one
    at the epoch's start (what was delivered is read again and dropped).
    """
    if index_iter is None:
        return None, snapshot.step if snapshot is not None else 0
    if snapshot is not None:
        return positioned(index_iter, snapshot.step), snapshot.step
    return positioned(index_iter, skip, ahead), skip


def _noting_sampler_epoch(
    indices: Iterator[Any], sampler: Any, record: EpochRecord
) -> Iterator[Any]:
    """``indices``, noting in ``record`` the sampler's epoch when its order is drawn.

    torch's ``BatchSampler`` iterates the sampler at its first ``next()``, not at
    ``iter()``: a ``set_epoch`` in between (Lightning calls it after its own
    ``iter()``) decides the order, so the record takes the epoch then.
    """
    for first in indices:
        record.sampler_epoch = getattr(sampler, "epoch", None)
        yield first
        break
    yield from indices
