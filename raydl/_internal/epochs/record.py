"""What an epoch source hands the loader for one epoch: its producer and its record.

Also :class:`RankPlan`, what rank 0 hands every rank for a multi-rank Ray Data epoch.

The :class:`EpochRecord` is everything a ``state_dict()`` taken during the epoch
needs besides the number of batches delivered (which the epoch's iterator
counts): one object per epoch, replaced at the next ``iter()``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raydl._internal.stream.batching import delivered_ahead
from raydl._internal.stream.epoch_iterator import Producer
from raydl.errors import RayDLError


@dataclass
class EpochRecord:
    """The resume record of one epoch.

    Attributes:
        epoch: The epoch's number.
        rng: The RNG state the epoch's sampler was drawn from (map-style).
        sampler_epoch: The sampler's ``epoch`` attribute at the start (map-style).
        prior: ``(world size, batches per rank)`` of the epoch's earlier segments,
            when it was resumed at another world size.
        order: How the epoch's order was drawn (map-style; for elastic resume).
        worker_seed: The workers' base seed (persistent workers: drawn once).
        direct: The epoch ran on raydl's own actors, not on Ray Data.
        ahead: The positions a resumed epoch had delivered beyond its first missing
            one (``in_order=False``).
        handed_by: A map-style epoch's producer, whose ``handed`` lists the positions
            of the batches handed over, in hand-over order.
        sampler_state: ``Stateful`` samplers' states as the epoch started.
        states: What snapshots a ``Stateful`` dataset's workers (``snapshot(delivered)``:
            a :class:`~raydl._internal.stream.worker_states.StateTracker`, or the
            in-process producer), ``None`` for other datasets.
    """

    epoch: int
    rng: dict[str, str] | None = None
    sampler_epoch: int | None = None
    prior: list[tuple[int, int]] = field(default_factory=list)
    order: dict[str, Any] | None = None
    worker_seed: int | None = None
    direct: bool = False
    ahead: list[int] = field(default_factory=list)
    handed_by: Any = None
    states: Any = None
    sampler_state: dict[str, Any] | None = None

    def worker_snapshot(self, consumed: int, ahead: list[int]) -> dict[str, Any] | None:
        """The snapshot of the workers' states a state saved now records, if any."""
        if self.states is None:
            return None
        snapshot = self.states.snapshot(consumed - len(ahead))
        return None if snapshot is None else snapshot.to_dict()

    def delivered(self, skip: int, taken: int) -> tuple[int, list[int]]:
        """``(batches_consumed, delivered_ahead)`` once ``taken`` batches of this run were taken.

        ``skip``: the batches a resume had consumed before this run.
        """
        if self.handed_by is None:
            return skip + taken, list(self.ahead)
        handed: list[int] = self.handed_by.handed[:taken]
        return delivered_ahead(skip - len(self.ahead), [*self.ahead, *handed])


@dataclass
class EpochStart:
    """One epoch, started: what feeds it and what the loader records of it.

    Attributes:
        producer: What feeds the epoch's iterator.
        record: Its resume record.
        skip: Batches of the epoch already consumed (a resume).
        length: The epoch's batches, when known.
        on_exhausted: Called once the epoch's last batch was taken.
    """

    producer: Producer
    record: EpochRecord
    skip: int = 0
    length: int | None = None
    on_exhausted: Callable[[], None] | None = None

    def close(self) -> None:
        """Stop an epoch that will not be iterated (an early start discarded)."""
        self.producer.close()


@dataclass(frozen=True)
class RankPlan:
    """What rank 0 broadcasts to every rank at the start of a multi-rank epoch.

    Attributes:
        epoch: The epoch every rank runs (rank 0's).
        parts: ``streaming_split`` iterators, one per rank; or, for an epoch resumed
            at another world size, the rest of it dealt as tables (behind a
            :class:`~raydl._internal.epochs.resume.ShareHolder` actor when other
            ranks fetch theirs).
        are_splits: Whether ``parts`` are split iterators.
        buffer: Rows of the local shuffle buffer (splits only).
        buffer_seed: Its seed before the rank's own offset (splits only).
        board: For a direct epoch: the actor through which rank 0 shares the epoch's
            map phase (a global shuffle, ``exchange_ranks.py``) or deals its rows
            (``deal_ranks.py``); ``parts`` is unused.
        mode: A direct epoch's kind: ``"exchange"`` or ``"deal"``.
        generation: A dealt epoch: rank 0's start of it, whose deals every rank takes.
        failed: Rank 0 failed to plan the epoch: ``"<type>: <message>"`` of its
            exception, which every other rank raises (see :meth:`failure`) instead of
            running the epoch; rank 0 raises the exception itself.
    """

    epoch: int
    parts: Any
    are_splits: bool
    buffer: int | None = None
    buffer_seed: int | None = None
    board: Any = None
    mode: str | None = None
    generation: int | None = None
    failed: str | None = None

    @classmethod
    def failure_of(cls, epoch: int, err: BaseException) -> RankPlan:
        """The plan rank 0 broadcasts when planning ``epoch`` raised ``err``."""
        return cls(epoch, None, are_splits=False, failed=f"{type(err).__name__}: {err}")

    def failure(self, rank: int) -> RayDLError | None:
        """The error rank ``rank`` raises for this plan, ``None`` unless rank 0 failed to plan it.

        Example:
            >>> plan = RankPlan.failure_of(2, FileNotFoundError("s3://b/x.parquet"))
            >>> print(plan.failure(1))
            rank 1: rank 0 failed to plan epoch 2, which every rank runs: FileNotFoundError: s3://b/x.parquet
        """
        if self.failed is None:
            return None
        return RayDLError(
            f"rank {rank}: rank 0 failed to plan epoch {self.epoch}, which every rank runs: "
            f"{self.failed}"
        )
