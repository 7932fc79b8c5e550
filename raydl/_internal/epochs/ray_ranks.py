"""The epochs of a Ray Data plan under several ranks (the :class:`RaySource`'s other half).

Rank 0 plans each epoch and broadcasts a :class:`RankPlan`:

* a plan the direct path accepts runs on rank 0's raydl actors for every rank,
  through the loader's board (``exchange_ranks.py``): a global shuffle (rank 0's
  map phase, every rank reducing its equal share) or a streaming epoch
  (``deal_ranks.py``: rank 0 loads the runs and deals their rows). Such epochs
  start early on every rank, as on one rank;
* any other plan is split with ``streaming_split(world_size, equal=True)``;
* an epoch resumed at another world size is rebuilt on rank 0 and dealt as tables
  (``resume.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raydl._internal.epochs import deal_ranks
from raydl._internal.epochs.board import start_board
from raydl._internal.epochs.direct import DirectPlan, MapRun
from raydl._internal.epochs.elastic import batch_counts
from raydl._internal.epochs.exchange import shares as exchange_shares
from raydl._internal.epochs.exchange_ranks import BoardPhase, RankZeroPhase, post_failure
from raydl._internal.epochs.overlap import NextEpoch
from raydl._internal.epochs.plan import EpochPlan
from raydl._internal.epochs.record import EpochRecord, EpochStart, RankPlan
from raydl._internal.epochs.resume import ShareHolder, ray_shares
from raydl._internal.epochs.shuffle import rank_seed
from raydl._internal.epochs.state import LoaderState
from raydl._internal.ray_compat.datasets import split_coordinator
from raydl._internal.runtime import cluster
from raydl._internal.runtime.world import Channel, World
from raydl._internal.stream.deal_producers import DealingProducer, DealtProducer
from raydl._internal.stream.dispatch import Actors, LateActors
from raydl._internal.stream.exchange_producer import ExchangeProducer
from raydl._internal.workers.convert import numpy_batch_to_tensors
from raydl._internal.workers.pool import WorkerPool
from raydl.options import LoaderOptions

if TYPE_CHECKING:
    from raydl._internal.stream.exchange_producer import Partitions
    from raydl._internal.stream.ray_producer import RayDataProducer


@dataclass(frozen=True)
class RaySettings:
    """The loader's arguments a Ray Data source's epochs need."""

    batch_size: int
    drop_last: bool
    shuffle: bool
    collate_fn: Callable[[Any], Any] | None
    prefetch: int
    timeout: float
    seed: int
    options: LoaderOptions


class RankEpochs:
    """The several-ranks half of :class:`~raydl._internal.epochs.ray_source.RaySource`."""

    _world: World
    _settings: RaySettings
    _next: NextEpoch
    _splits: Any  # rank 0: the epoch's parts, alive until every rank ended it
    _board: Any  # several ranks, direct epochs: rank 0's board (its actor)
    _mode: str | None  # the last epoch's direct mode, if any
    _dealing: EpochStart | None  # rank 0: its dealt epoch, until it is taken

    if TYPE_CHECKING:  # RaySource's, used here

        def _plans(self, epoch: int, direct: bool) -> tuple[EpochPlan, DirectPlan | None]: ...
        def _epoch_plan(
            self, epoch: int, *, shuffle: bool | None = None, ray_data: bool = False
        ) -> EpochPlan: ...
        def _pool_for(self, direct: DirectPlan, plan: EpochPlan) -> WorkerPool: ...
        def _next_starter(self, epoch: int) -> Callable[[], bool] | None: ...
        def _map_phase(
            self,
            actors: LateActors,
            direct: DirectPlan,
            local: Callable[[MapRun], Any] | None = None,
        ) -> Callable[[Callable[[], None]], Partitions]: ...
        def _length_or_none(self, epoch: int) -> int | None: ...
        def _cut(self, buffer: int | None, seed: int | None) -> Callable[[Any], Any]: ...
        def _exchange_producer(
            self, phase: Callable[[Callable[[], None]], Partitions],
            reduce: Callable[[int, Any, int, int], Any], *, epoch: int, skip: int,
            start_next: Callable[[], bool] | None, description: str,
            share: Callable[[int], tuple[int, int]] = ...,
        ) -> ExchangeProducer: ...  # fmt: skip
        def _ray_producer(
            self, source: Any, epoch: int, skip: int, buffer: int | None,
            buffer_seed: int | None, **hooks: Any,
        ) -> RayDataProducer: ...  # fmt: skip

    def _ranks_epoch(self, epoch: int, resume: LoaderState | None, *, elastic: bool) -> EpochStart:
        """This rank's part of the epoch rank 0 planned (the rest of ``resume``, if given).

        ``elastic``: ``resume`` was saved at another world size; its rest is re-dealt.

        Under several ranks the broadcast is also where rank 0 learns that every
        rank finished the previous epoch, so it can let go of the previous parts.
        Should rank 0 fail to plan the epoch, it broadcasts that failure, which every
        other rank raises, and raises its own exception.
        """
        world = self._world
        plan: RankPlan | None = None
        if world.rank == 0:
            try:
                plan = self._rank0_plan(epoch, resume, resume if elastic else None)
            except Exception as err:
                # The other ranks wait in the broadcast: tell them, then raise it here.
                if world.is_distributed:
                    with contextlib.suppress(Exception):  # raise the cause, not this
                        Channel.get(world).broadcast(RankPlan.failure_of(epoch, err))
                raise
        if world.is_distributed:
            plan = Channel.get(world).broadcast(plan)
        assert plan is not None
        failure = plan.failure(world.rank)
        if failure is not None:
            raise failure
        epoch = plan.epoch
        self._retire_splits()
        self._mode = plan.mode
        if plan.board is not None:
            self._board = plan.board
            skip = resume.batches_consumed if resume is not None else 0
            if plan.mode == "deal":
                return self._dealt_epoch(epoch, skip, plan.generation)
            started = self._next.take(epoch) if skip == 0 else None
            if started is not None and not isinstance(started.producer, ExchangeProducer):
                started.close()  # started early as the previous epoch's mode: not this one's
                started = None
            if started is None:
                self._next.discard()
                started = self._rank_exchange(epoch, skip)
            return started
        self._next.discard()  # an early exchange epoch, if the plan changed since
        self._splits = plan.parts if world.rank == 0 else None
        record = EpochRecord(epoch=epoch)
        if plan.are_splits:
            source, length = plan.parts[world.rank], None
            skip = resume.batches_consumed if resume is not None else 0
            buffer, buffer_seed = plan.buffer, rank_seed(plan.buffer_seed, world.rank)
        else:
            assert resume is not None
            source, length = self._elastic_share(plan.parts)
            record.prior = resume.segments
            skip, buffer, buffer_seed = 0, None, None
        on_exhausted = None
        if world.is_distributed:
            timeout = self._settings.timeout
            barrier_timeout = timeout if timeout > 0 else 1800.0
            channel = Channel.get(world)

            def on_exhausted() -> None:
                channel.barrier(barrier_timeout, f"the end of epoch {epoch}")

        producer = self._ray_producer(source, epoch, skip, buffer, buffer_seed)
        if length is None:
            length = self._length_or_none(epoch)
        return EpochStart(producer, record, skip=skip, length=length, on_exhausted=on_exhausted)

    def _rank0_plan(
        self, epoch: int, resume: LoaderState | None, elastic: LoaderState | None
    ) -> RankPlan:
        """Rank 0's plan of the epoch for every rank (see :class:`RankPlan`)."""
        world, settings = self._world, self._settings
        if elastic is None:
            # A resumed epoch runs the way it was saved (its order depends on it).
            run_direct = self._settings.options.direct_execution
            if resume is not None:
                run_direct = resume.direct_execution is True
            mode = self._direct_mode(epoch) if run_direct else None
            if mode is not None:
                if self._board is None:
                    self._board = start_board(world.world_size)
                generation = None
                stale, self._dealing = self._dealing, None
                if stale is not None:
                    stale.close()
                self._mode = mode  # before the deal starts: its dealer may ask for the next epoch
                if mode == "deal":  # started before the broadcast, which names its generation
                    skip = resume.batches_consumed if resume is not None else 0
                    self._dealing = self._dealt_epoch(epoch, skip, None)
                    generation = self._dealing.producer.generation  # type: ignore[attr-defined]
                return RankPlan(
                    epoch,
                    None,
                    are_splits=False,
                    board=self._board,
                    mode=mode,
                    generation=generation,
                )
            plan = self._epoch_plan(epoch, ray_data=True)
            splits = plan.dataset.streaming_split(world.world_size, equal=True)
            return RankPlan(
                epoch,
                splits,
                are_splits=True,
                buffer=plan.local_shuffle_buffer_size,
                buffer_seed=plan.local_shuffle_seed,
            )
        # The rest of the epoch is rebuilt the way it ran (its order depends on it).
        plan, direct = self._plans(epoch, elastic.direct_execution is True)
        shares: Any = ray_shares(
            plan.dataset,
            elastic,
            world.world_size,
            batch_size=settings.batch_size,
            drop_last=settings.drop_last,
            buffer=plan.local_shuffle_buffer_size,
            buffer_seed=plan.local_shuffle_seed,
            direct=direct,
        )
        if world.is_distributed:
            import ray

            shares = ray.remote(num_cpus=0)(ShareHolder).remote(shares)
        return RankPlan(epoch, shares, are_splits=False)

    def _direct_mode(self, epoch: int) -> str | None:
        """How ``epoch`` runs on raydl's actors for every rank (rank 0 decides): ``"exchange"``
        (a global shuffle), ``"deal"`` (streaming, rows dealt), or ``None`` (Ray Data)."""
        direct = self._plans(epoch, True)[1]
        if direct is None:
            return None
        return "deal" if direct.exchange is None else "exchange"

    def _rank_direct(self, epoch: int, mode: str | None) -> EpochStart:
        """Epoch ``epoch`` started early on this rank, as a direct epoch of ``mode``."""
        if mode == "deal":
            return self._rank_deal(epoch, skip=0, generation=None)
        return self._rank_exchange(epoch, skip=0)

    def _dealt_epoch(self, epoch: int, skip: int, generation: int | None) -> EpochStart:
        """This rank's streaming direct epoch: the one started early if it fits, else a new one.

        Rank 0 runs this before the broadcast (``generation`` is then its start's); the
        other ranks after it, keeping an early start only if it took that start's deals.
        """
        dealing, self._dealing = self._dealing, None
        if dealing is not None:
            return dealing
        started = self._next.take(epoch) if skip == 0 else None
        if started is not None:
            producer = started.producer
            if isinstance(producer, DealingProducer) or (
                isinstance(producer, DealtProducer)
                and (generation is None or producer.expect(generation))
            ):
                return started
            started.close()
        self._next.discard()
        return self._rank_deal(epoch, skip, generation)

    def _rank_deal(self, epoch: int, skip: int, generation: int | None) -> EpochStart:
        """This rank's part of a streaming direct epoch (``deal_ranks.py``): rank 0 loads
        the runs and deals their rows; ``generation``: rank 0's start to take them from."""
        import ray

        world, settings = self._world, self._settings
        producer: Any = {
            "collate": settings.collate_fn or numpy_batch_to_tensors,
            "prefetch": settings.prefetch,
            "skip": skip,
            "start_next": self._next_starter(epoch),
            "name": f"raydl-epoch-{epoch}-dealt",
        }

        def cut_for(cut: deal_ranks.CutSettings) -> Callable[[Any], Any]:
            return self._cut(cut[0], rank_seed(cut[1], world.rank))

        if world.rank == 0:
            plan, direct = self._plans(epoch, True)
            if direct is None or direct.exchange is not None:
                raise RuntimeError(f"epoch {epoch} is not a streaming epoch on raydl's actors")
            pool = self._pool_for(direct, plan)
            producer = deal_ranks.rank_zero(
                self._board, epoch, world.world_size, pool=pool, direct=direct,
                work=ray.put(direct.work(plan.context)), cut_for=cut_for,
                settings=(plan.local_shuffle_buffer_size, plan.local_shuffle_seed),
                window=settings.prefetch * len(pool),
                description=f"{' -> '.join(direct.names)} on {len(pool)} raydl actors",
                **producer,
            )  # fmt: skip
        else:
            producer = deal_ranks.other_rank(
                self._board, epoch, world.rank, world.world_size, generation=generation,
                cut_for=cut_for, **producer,
            )  # fmt: skip
        record = EpochRecord(epoch=epoch, direct=True)
        return EpochStart(producer, record, skip=skip, length=self._length_or_none(epoch))

    def _rank_exchange(self, epoch: int, skip: int) -> EpochStart:
        """This rank's share of a globally shuffled direct epoch (``exchange_ranks.py``).

        Rank 0 runs the map phase on the actors and posts it on the board; every
        rank reduces its own contiguous share. Raises ``RuntimeError`` on rank 0 when
        the epoch's plan is not one (an early start of it then does not happen).
        """
        import ray

        world = self._world
        board = self._board
        assert board is not None, "the board comes with the first exchange epoch's plan"
        phase: RankZeroPhase | BoardPhase
        if world.rank == 0:
            plan, direct = self._plans(epoch, True)
            if direct is None or direct.exchange is None:
                raise RuntimeError(f"epoch {epoch} is not a global shuffle on raydl's actors")
            try:
                pool = self._pool_for(direct, plan)
                work = [ray.put(direct.work(plan.context))]  # unresolved on the actors
                actors = LateActors(Actors(pool, lambda task: (work, task)))
                run_phase = self._map_phase(actors, direct)
            except Exception as err:  # the other ranks wait on the board for this map phase
                post_failure(board, epoch, err)
                raise
            phase = RankZeroPhase(run_phase, direct.exchange, board, epoch)
            description = (
                f"{' -> '.join(direct.names)} -> global shuffle "
                f"({direct.exchange.partitions} partitions) "
                f"on {len(pool)} raydl actors, rank 0 of {world.world_size}"
            )
        else:
            phase = BoardPhase(board, epoch, world.rank)
            description = f"global shuffle on raydl actors, rank {world.rank} of {world.world_size}"
        producer = self._exchange_producer(
            phase,
            phase.reduce,
            epoch=epoch,
            skip=skip,
            start_next=self._next_starter(epoch),
            description=description,
            share=lambda total: exchange_shares(total, world.world_size)[world.rank],
        )
        record = EpochRecord(epoch=epoch, direct=True)
        return EpochStart(producer, record, skip=skip, length=self._length_or_none(epoch))

    def _elastic_share(self, shares: Any) -> tuple[Any, int]:
        """This rank's dataset of the rest of an elastic epoch, and its batch count."""
        import ray
        import ray.data

        world, settings = self._world, self._settings
        if world.is_distributed:
            table = ray.get(shares.share.remote(world.rank))
        else:
            table = shares[world.rank]
        count = batch_counts(table.num_rows, settings.batch_size, settings.drop_last)
        return ray.data.from_arrow(table), count

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
            coordinator = split_coordinator(splits) if isinstance(splits, list) else splits
            if coordinator is not None:
                import ray

                with contextlib.suppress(Exception):
                    ray.kill(coordinator)
