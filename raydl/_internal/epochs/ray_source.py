"""Epochs of a Ray Data plan: one rank or several, on Ray Data or on raydl's actors.

A :class:`RaySource` turns the user's plan (a ``ray.data.Dataset`` or a
:class:`~raydl.PerEpoch`) into one epoch at a time:

* **one rank**: the epoch's plan (``plan.py``: shuffle, retries, fused reads) runs
  as a Ray Data execution (:class:`~raydl._internal.stream.ray_producer.RayDataProducer`),
  or, for a simple file plan, on raydl's own actors (direct execution, a strategy:
  ``direct.py`` and :class:`~raydl._internal.stream.direct_producer.DirectProducer`).
* **several ranks**: rank 0 plans the epoch and every rank receives a
  :class:`RankPlan` by broadcast. A simple file plan runs on rank 0's actors for
  every rank (globally shuffled: ``exchange_ranks.py``; streaming: rows dealt,
  ``deal_ranks.py``); any other is split with ``streaming_split(world_size,
  equal=True)``. An epoch resumed at another world size is rebuilt on rank 0 and
  dealt as tables (``resume.py``).

The early start of the next epoch is a policy owned here, under one lock: a
producer thread asks (:meth:`RaySource._start_early`), and the source starts the
epoch only if it is the one the next ``iter()`` will run and no resume is armed
(the loader says so through :meth:`RaySource.expect`).
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from raydl._internal.epochs.board import stop_board
from raydl._internal.epochs.direct import (
    MAP_HERE_BYTES,
    PART_BYTES,
    WARM_UP,
    WINDOW_BYTES,
    DirectPlan,
    EpochWork,
    LoadRun,
    MapRun,
    describe_run,
    direct_plan,
    load_here,
    loaded_bytes,
    map_phase,
    start_pool,
)
from raydl._internal.epochs.elastic import batch_counts
from raydl._internal.epochs.overlap import NextEpoch
from raydl._internal.epochs.plan import (
    STAGE_RETRIES,
    EpochPlan,
    exchange_seed,
    plan_epoch,
    stage_names,
)
from raydl._internal.epochs.ray_ranks import RankEpochs, RaySettings
from raydl._internal.epochs.record import EpochRecord, EpochStart
from raydl._internal.epochs.state import LoaderState
from raydl._internal.io.file_dataset import FileDataset
from raydl._internal.ray_compat.datasets import known_row_count
from raydl._internal.runtime import cluster
from raydl._internal.runtime.startup import BackgroundStart, Warm, connect
from raydl._internal.runtime.world import World
from raydl._internal.stream.batching import cut_batches
from raydl._internal.stream.direct_producer import DirectProducer
from raydl._internal.stream.dispatch import Actors, ActorStart, LateActors
from raydl._internal.stream.epoch_iterator import Producer
from raydl._internal.stream.exchange_producer import ExchangeProducer, Partitions
from raydl._internal.stream.pinned import HostArrays
from raydl._internal.stream.ray_producer import RayDataProducer
from raydl._internal.workers.convert import numpy_batch_to_tensors
from raydl._internal.workers.pool import WorkerPool
from raydl.pipelines import PerEpoch


def _ignore(_: object) -> None:
    """Nothing to stop."""


class RaySource(RankEpochs):
    """The epochs of a ``ray.data.Dataset`` or :class:`~raydl.PerEpoch` plan."""

    def __init__(self, dataset: Any, settings: RaySettings, world: World) -> None:
        # Ray Data's bars and banners off, unless nothing here needs Ray Data yet (raydl's
        # own plan of a read, a PerEpoch in a process without Ray Data): then once it does.
        if not isinstance(dataset, (FileDataset, PerEpoch)) or "ray.data" in sys.modules:
            cluster.quiet_ray_data()
        self._dataset = dataset
        self._settings = settings
        self._world = world
        self._lock = threading.Lock()  # guards the early-start policy
        self._build_lock = threading.Lock()  # one PerEpoch build at a time
        self._pool_lock = threading.Lock()  # one direct pool, made by whichever epoch binds first
        self._built: tuple[int, Any] | None = None  # PerEpoch: the last epoch's plan
        self._expected = 0  # the epoch the loader's next iter() runs
        self._resume_armed = False  # that iter() resumes a saved epoch
        self._next = NextEpoch()  # the next epoch, started early
        self._direct_pool: WorkerPool | None = None  # runs simple file plans (direct.py)
        self._actor_start: ActorStart | None = None  # whether that pool's actors answered
        self._startup: BackgroundStart | None = None  # the loader's start, while it runs
        self._splits: Any = None  # rank 0: the epoch's parts, alive until every rank ended it
        self._board: Any = None  # several ranks, direct epochs: rank 0's board (its actor)
        self._mode: str | None = None  # several ranks: the last epoch's direct mode, if any
        self._dealing: EpochStart | None = None  # rank 0: its dealt epoch, until it is taken
        # One rank: the last global shuffle's map output in bytes, written by its producer's
        # thread (a hint for the next epoch's layout, _whole_runs; it changes no order).
        self._exchange_bytes: int | None = None

    # -- what the loader asks -----------------------------------------------------------

    #: Epochs of Ray Data plans always run on Ray.
    in_process = False

    @functools.cached_property
    def _direct_at_start(self) -> DirectPlan | None:
        """The plan's direct form as given, if raydl's actors run it (a ``PerEpoch``'s
        plans are made per epoch: ``None``)."""
        dataset = self._dataset
        if self._settings.options.direct_execution is False or isinstance(dataset, PerEpoch):
            return None
        return direct_plan(dataset)

    @property
    def worker_modules(self) -> tuple[str, ...]:
        """What an embedded instance it starts has its workers import as they start.

        Ray Data, for a plan Ray Data runs (its tasks import it; ``cluster.ensure_ray``);
        nothing for one raydl's actors run, which import no Ray Data (docs/design/direct-execution.md,
        "Actors without Ray Data").
        """
        return () if self._direct_at_start is not None else cluster.RAY_DATA_WORKERS

    @property
    def shared_modules(self) -> tuple[str, ...]:
        """What its actors import, for the embedded instance's fork server to share
        (docs/design/embedded-runtime.md, "Forked workers"): numpy and pyarrow (reads and stages), never
        torch, and pandas unless its direct plan converts without it
        (:attr:`~raydl._internal.epochs.direct.DirectPlan.without_pandas`).

        A package the server imports costs its memory once whether or not an actor
        uses it: pandas shared but unused put 47 MB on the benchmark's small images
        (peak 620 -> 573 MB without it), while actors that import it each on their
        own pay about 40 MB apiece.
        """
        plain = ("numpy", "pyarrow")
        plan = self._direct_at_start
        return plain if plan is not None and plan.without_pandas else (*plain, "pandas")

    def takes_start(self, startup: BackgroundStart | None) -> bool:
        """Keep the loader's start on one rank: an epoch waits for it only when it needs Ray.

        A streaming direct epoch may start while Ray still starts (a reader's plan is
        built without Ray): its first runs then load here (``DirectProducer``).
        Several ranks agree on each epoch over Ray, so there the loader waits.
        """
        if self._world.is_distributed:
            return False
        if startup is not None:
            self._startup = startup
        return True

    def _connect(self) -> None:
        """Wait for the loader's start, raising its error, and make sure Ray is connected."""
        startup, self._startup = self._startup, None
        connect(startup, self._settings.options.ray_address, self._world, self.worker_modules)

    def _ray_up(self) -> bool:
        """Whether an epoch may use Ray without waiting for a start under way.

        The loader's start, or a reader's (``cluster.begin_ray_for_reads``); with
        neither under way the epoch connects (starting Ray) itself.
        """
        startup = self._startup
        if startup is not None:
            return startup.done
        return not cluster.reads_starting()

    def warm(self) -> Warm[None] | None:
        """What the loader's background start warms: epoch 0, started at construction.

        One rank only (several ranks agree on each epoch at its ``iter()``). Its
        order is already fixed (the seed is drawn when the loader is built); an
        ``iter()`` of another epoch, ``set_epoch`` or ``load_state_dict`` discards it
        as any early epoch.
        """
        if self._world.is_distributed:
            return None
        return Warm(build=lambda: None, adopt=lambda _: self._start_early(0), discard=_ignore)

    @property
    def early_epoch(self) -> int | None:
        """The epoch started ahead of its ``iter()``, if any."""
        return self._next.epoch

    def dataset(self, epoch: int) -> Any:
        """The user's plan for ``epoch`` (a :class:`PerEpoch` is built once for it)."""
        if not isinstance(self._dataset, PerEpoch):
            return self._dataset
        with self._build_lock:
            built = self._built
            if built is None or built[0] != epoch:
                built = self._built = (epoch, self._dataset.dataset(epoch))
            return built[1]

    def length(self, epoch: int) -> int:
        """This rank's batches of ``epoch``; ``TypeError`` when Ray cannot tell without running it."""
        rows = known_row_count(self.dataset(epoch))
        if rows is None:
            raise TypeError(
                "len() of a RayDataLoader over a ray.data.Dataset whose row count is only "
                "known after executing it (e.g. after filter or a row-changing map_batches); "
                "materialize() the dataset first, or do not call len()."
            )
        # streaming_split(equal=True) gives each rank the same share and drops the rest.
        settings = self._settings
        return batch_counts(rows // self._world.world_size, settings.batch_size, settings.drop_last)

    def _length_or_none(self, epoch: int) -> int | None:
        try:
            return self.length(epoch)
        except TypeError:
            return None

    #: A Ray Data epoch's order is a function of (seed, epoch): no RNG, no worker count.
    state_workers: int | None = None

    def rng_now(self) -> None:
        """No torch RNG decides a Ray Data epoch."""
        return None

    def load_between_epochs(self, state: LoaderState) -> None:
        """Nothing to take: the next epoch's order follows from (seed, epoch)."""

    def samplers_now(self) -> None:
        """A Ray Data source has no sampler."""
        return None

    def states_between_epochs(self) -> None:
        """Ray Data stages keep no ``Stateful`` worker state."""
        return None

    def expect(self, epoch: int, *, resume: bool) -> None:
        """The loader's next ``iter()`` runs ``epoch`` (resuming it if ``resume``)."""
        with self._lock:
            self._expected, self._resume_armed = epoch, resume

    def discard_early(self, keep: int | None = None) -> None:
        """Stop the epoch started early, unless it is epoch ``keep``.

        Not under the policy's lock: closing that epoch joins its producer thread,
        which may be waiting for the lock to ask for its own successor.
        """
        if keep is None or self._next.epoch not in {None, keep}:
            self._next.discard()

    def start_epoch(self, epoch: int, resume: LoaderState | None) -> EpochStart:
        """Start ``epoch``, or the rest of it when ``resume``; the epoch run may be rank 0's."""
        world = self._world
        elastic = resume is not None and resume.needs_elastic(world.world_size)
        if elastic:
            self._connect()
        if not world.is_distributed and not elastic:
            skip = resume.batches_consumed if resume is not None else 0
            started = self._next.take(epoch) if skip == 0 else None
            if started is None:
                self._next.discard()
                # A resumed epoch runs the way it was saved (its order depends on it).
                direct = resume.direct_execution is True if resume is not None else None
                started = self._single_rank(epoch, skip, direct=direct)
            return started
        return self._ranks_epoch(epoch, resume, elastic=elastic)

    def close(self) -> None:
        """Stop the loader's start, the early epoch, the direct actors and rank 0's splits."""
        startup, self._startup = self._startup, None
        if startup is not None:
            startup.cancel()
        self._next.discard()
        dealing, self._dealing = self._dealing, None
        if dealing is not None:
            dealing.close()
        pool, self._direct_pool = self._direct_pool, None
        self._actor_start = None
        if pool is not None:
            pool.kill()
        self._retire_splits()
        board, self._board = self._board, None
        if board is not None and self._world.rank == 0 and cluster.is_connected():
            stop_board(board)

    # -- one rank -----------------------------------------------------------------------

    def _epoch_plan(
        self, epoch: int, *, shuffle: bool | None = None, ray_data: bool = False
    ) -> EpochPlan:
        """The epoch's plan (``ray_data``: Ray Data's, also for raydl's own plan of a read)."""
        settings, options = self._settings, self._settings.options
        plan = plan_epoch(
            self.dataset(epoch),
            shuffle=settings.shuffle if shuffle is None else shuffle,
            shuffle_mode=options.shuffle_mode,
            local_shuffle_buffer_size=options.local_shuffle_buffer_size
            or max(1024, 4 * settings.batch_size),
            seed=settings.seed,
            epoch=epoch,
            deterministic=options.deterministic,
            ray_data=ray_data,
        )
        if not isinstance(plan.dataset, FileDataset):
            cluster.quiet_ray_data()  # once it runs Ray Data's plans (idempotent)
        return plan

    def _plans(self, epoch: int, direct: bool) -> tuple[EpochPlan, DirectPlan | None]:
        """The epoch's plan, and its direct form when ``direct`` and raydl's actors can run it.

        A global shuffle on the direct path is raydl's exchange (``exchange.py``) over
        the unshuffled plan; a plan the direct path refuses keeps Ray Data's
        ``random_shuffle``.
        """
        settings = self._settings
        if direct and settings.shuffle and settings.options.shuffle_mode == "global":
            plain = self._epoch_plan(epoch, shuffle=False)
            simple = direct_plan(plain.dataset)
            if simple is not None:
                return plain, simple.shuffled(exchange_seed(settings.seed, epoch))
        plan = self._epoch_plan(epoch)
        simple = direct_plan(plan.dataset) if direct else None
        if simple is None and isinstance(plan.dataset, FileDataset):
            plan = self._epoch_plan(epoch, ray_data=True)  # Ray Data runs it
        return plan, simple

    def _single_rank(self, epoch: int, skip: int, direct: bool | None = None) -> EpochStart:
        """Epoch ``epoch`` on one rank; it starts the next epoch early when allowed.

        ``direct``: run a simple file plan on raydl's actors or on Ray Data;
        ``None``: as the ``direct_execution`` option says.
        """
        options = self._settings.options
        if direct is None:
            direct = options.direct_execution
        plan, simple = self._plans(epoch, direct)
        if simple is None:
            self._connect()  # a direct epoch may start before Ray is up
        start_next = self._next_starter(epoch)
        record = EpochRecord(epoch=epoch, direct=simple is not None)
        producer: Producer
        if simple is not None:
            producer = self._direct_producer(plan, simple, epoch, skip, start_next)
        else:
            producer = self._ray_producer(
                plan.dataset,
                epoch,
                skip,
                plan.local_shuffle_buffer_size,
                plan.local_shuffle_seed,
                start_next=start_next,
                start_next_early=plan.all_to_all,
            )
        return EpochStart(producer, record, skip=skip, length=self._length_or_none(epoch))

    def _next_starter(self, epoch: int) -> Callable[[], bool] | None:
        """What epoch ``epoch``'s producer calls to start the next epoch early (if allowed)."""
        if not self._settings.options.overlap_epochs:
            return None
        # A weak reference: a producer thread must not keep a dropped loader's
        # source (and so its early epoch) alive; the loader's close() stops both.
        source = weakref.ref(self)

        def start_next() -> bool:
            owner = source()
            return owner is None or owner._start_early(epoch + 1)

        return start_next

    def _start_early(self, epoch: int) -> bool:
        """Start ``epoch`` ahead of its ``iter()``; ``False`` if it is too soon to tell.

        Only the epoch the next ``iter()`` will run, and not when a resume is armed
        (that ``iter()`` skips batches of its own epoch, so it builds its own
        epoch). Asked by epoch ``epoch - 1`` while that one was itself started
        early and not yet taken, the answer is "not yet".
        """
        with self._lock:  # no iter(), set_epoch or load_state_dict in between
            if self._expected == epoch - 1:
                return False
            if self._expected == epoch and not self._resume_armed:
                if self._world.is_distributed:  # only direct epochs start early there
                    mode = self._mode  # as the current epoch: the broadcast says if not
                    self._next.start(epoch, lambda: self._rank_direct(epoch, mode))
                else:
                    self._next.start(epoch, lambda: self._single_rank(epoch, skip=0))
            return True

    def _ray_producer(
        self,
        source: Any,
        epoch: int,
        skip: int,
        buffer: int | None,
        buffer_seed: int | None,
        **hooks: Any,
    ) -> RayDataProducer:
        settings = self._settings
        return RayDataProducer(
            source,
            batch_size=settings.batch_size,
            drop_last=settings.drop_last,
            local_shuffle_buffer_size=buffer,
            local_shuffle_seed=buffer_seed,
            collate=settings.collate_fn or numpy_batch_to_tensors,
            prefetch=settings.prefetch,
            epoch=epoch,
            stages=stage_names(self.dataset(epoch)),
            attempts=STAGE_RETRIES + 1,
            skip=skip,
            **hooks,
        )

    def _direct_producer(
        self,
        plan: EpochPlan,
        direct: DirectPlan,
        epoch: int,
        skip: int,
        start_next: Callable[[], bool] | None,
    ) -> Producer:
        """Epoch ``epoch`` of a simple file plan, on this source's own actors (``direct.py``)."""

        settings = self._settings
        files = direct.source.files
        here = direct.work(plan.context)
        names = " -> ".join(direct.names)
        # While Ray and the pool's actors start, runs load here (the same batches).
        local = functools.partial(load_here, here) if settings.options.start_in_process else None
        actors = LateActors(self._actors_for(direct, plan, here), self._ray_up)
        if direct.exchange is not None:
            exchange = direct.exchange
            return self._exchange_producer(
                self._map_phase(actors, direct, local=local),
                exchange.reduce,
                epoch=epoch,
                skip=skip,
                start_next=start_next,
                description=(
                    f"{names} -> global shuffle ({exchange.partitions} partitions) "
                    f"on {{actors}} raydl actors ({len(files)} files)"
                ),
            )
        return DirectProducer(
            actors,
            [LoadRun(tuple(run)) for run in direct.runs()],
            window_per_actor=settings.prefetch,
            prefetch=settings.prefetch,
            cut=self._cut(plan.local_shuffle_buffer_size, plan.local_shuffle_seed),
            collate=settings.collate_fn or numpy_batch_to_tensors,
            skip=skip,
            start_next=start_next,
            window_bytes=WINDOW_BYTES,
            size_of=loaded_bytes,
            describe=lambda request: describe_run(request[1].paths),
            description=f"{names} on {{actors}} raydl actors ({len(files)} files)",
            name=f"raydl-epoch-{epoch}-direct",
            local=local,
            part_bytes=PART_BYTES,
        )

    def _actors_for(
        self, direct: DirectPlan, plan: EpochPlan, here: EpochWork
    ) -> Callable[[], Actors]:
        """What makes a direct epoch's :class:`Actors`: called on the epoch's thread once
        Ray is up (connecting, starting this source's pool, putting the epoch's work)."""
        import ray

        settings = self._settings

        def actors() -> Actors:
            self._connect()
            # Nested in a list, the reference reaches the actors unresolved (they keep it).
            work = [ray.put(here)]
            # An epoch and the next one, started early, may both bind as Ray comes up:
            # one pool, and one warm-up, for both.
            with self._pool_lock:
                pool = self._pool_for(direct, plan)
                if self._actor_start is None and settings.options.start_in_process:
                    self._actor_start = ActorStart("fetch", (work, WARM_UP))  # once per pool
                start = self._actor_start
            return Actors(pool, lambda run: (work, run), start)

        return actors

    #: A global shuffle's map phase replies with one object per run (``map_phase``'s
    #: ``whole``) when the previous epoch's map output took at most this share of the
    #: object store: that layout holds the whole epoch until its last partition is
    #: reduced, with the next epoch's map phase beside it.
    WHOLE_RUNS_STORE_SHARE = 0.25

    def _map_phase(
        self, actors: LateActors, direct: DirectPlan, local: Callable[[MapRun], Any] | None = None
    ) -> Callable[[Callable[[], None]], Partitions]:
        """The epoch's map phase on ``actors`` (``map_phase``), with runs mapped here by
        ``local`` while they start; the phase notes the size of its output."""

        def phase(between: Callable[[], None]) -> Partitions:
            partitions = map_phase(
                actors,
                direct,
                between,
                whole=self._whole_runs,
                local=local,
                here_bytes=self._here_bytes,
            )
            self._exchange_bytes = partitions.nbytes
            return partitions

        return phase

    @staticmethod
    def _here_bytes() -> int:
        """Bytes of runs a map phase may keep in the training process (``map_phase``):
        ``MAP_HERE_BYTES`` while Ray is not up, none once it is. Mapped here, a run stays
        in this process's memory until the epoch's reduces, where the object store would
        have spilled it; a running Ray has its store (tried with a store capped at 100 MiB
        and actors starting on a running cluster: two runs mapped here took the
        trainer's peak from 58 to 121 MiB over its start)."""
        return 0 if cluster.is_connected() else MAP_HERE_BYTES

    def _whole_runs(self) -> bool:
        """Whether this epoch's map phase replies with whole runs (see ``map_phase``).

        Only once an epoch told how large the stages' output is (not epoch 0, nor the
        first epoch after a resume: a decode may make it many times the files), and
        only on a one-node cluster: every rank slices every run, so on several nodes
        each node would pull the whole epoch instead of its ranks' partitions.
        """
        last = self._exchange_bytes
        return (
            last is not None
            and last <= self.WHOLE_RUNS_STORE_SHARE * cluster.object_store_bytes()
            and (not self._world.is_distributed or cluster.nodes() == 1)
        )

    def _exchange_producer(
        self,
        phase: Callable[[Callable[[], None]], Partitions],
        reduce: Callable[[int, Any, int, int], Any],
        *,
        epoch: int,
        skip: int,
        start_next: Callable[[], bool] | None,
        description: str,
        share: Callable[[int], tuple[int, int]] = lambda total: (0, total),
    ) -> ExchangeProducer:
        """A globally shuffled direct epoch: ``phase`` gives its map phase, ``share`` this
        rank's rows of it; the first ``skip`` batches (a resume) are not reduced at all."""
        settings = self._settings

        def rows(total: int) -> tuple[int, int]:
            start, stop = share(total)
            return min(stop, start + skip * settings.batch_size), stop

        return ExchangeProducer(
            map_phase=phase,
            rows=rows,
            reduce=reduce,
            cut=self._cut(None, None),  # contiguous batches: a resume skips rows, not batches
            batch_size=settings.batch_size,
            collate=settings.collate_fn or numpy_batch_to_tensors,
            prefetch=settings.prefetch,
            start_next=start_next,
            description=description,
            name=f"raydl-epoch-{epoch}-exchange",
        )

    def _cut(self, buffer: int | None, seed: int | None) -> Callable[[Any], Any]:
        """Blocks -> this loader's batches (through a local shuffle buffer if ``buffer``).

        One epoch's: the arrays the buffer gathers its batches into come from a pool of
        the epoch's own (``pinned.HostArrays``), used on its producer thread.
        """
        settings = self._settings
        return functools.partial(
            cut_batches,
            batch_size=settings.batch_size,
            drop_last=settings.drop_last,
            buffer=buffer,
            seed=seed,
            empty=HostArrays().empty,
        )

    def _pool_for(self, direct: DirectPlan, plan: EpochPlan) -> WorkerPool:
        """The actors that run direct plans (started at the first direct epoch)."""
        if self._direct_pool is None:
            # Sized once: an epoch started early shares it with the current one, so it is
            # never replaced while the loader lives (close() drops it).
            self._direct_pool = start_pool(direct, plan.context, self._settings.seed)
        pool = self._direct_pool
        return pool
