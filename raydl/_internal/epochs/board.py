"""The board: one small Ray actor per loader through which rank 0 hands epochs to the other ranks.

It carries a globally shuffled epoch's map phase (``exchange_ranks.py``) and a
streaming epoch's deals (``deal_ranks.py``). Its process starts with only this
module (no torch, no pyarrow, no numpy; a global shuffle's first post brings numpy,
with the exchange it unpickles), so that it starts in a fraction of the time an
actor running the epoch's work takes: it is on the path to every rank's first
batch.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raydl.errors import RayDLError

if TYPE_CHECKING:
    from raydl._internal.epochs.exchange import Exchange


@dataclass(frozen=True)
class Failed:
    """Rank 0's loading of ``epoch`` failed: what the other ranks get instead of its rows.

    Without it a rank other than 0 would wait on the board for rows that never come
    whenever rank 0's process lives on after the error (a script that catches it, or
    ranks launched without torchrun, whose agent ends every rank when one fails).

    Example:
        >>> str(Failed(3, "ValueError: bad row (files ['a.parquet'])").error(1))
        "rank 1: rank 0 failed to load epoch 3, whose rows this rank was to take: ValueError: bad row (files ['a.parquet'])"
    """

    epoch: int
    cause: str  # ``"<type>: <message>"`` of rank 0's exception

    def error(self, rank: int) -> RayDLError:
        """The error rank ``rank`` raises."""
        return RayDLError(
            f"rank {rank}: rank 0 failed to load epoch {self.epoch}, whose rows this rank "
            f"was to take: {self.cause}"
        )


def failed(epoch: int, err: BaseException) -> Failed:
    """Rank 0's ``err`` while loading ``epoch``, as the board hands it to the other ranks."""
    return Failed(epoch, f"{type(err).__name__}: {err}")


class Board:
    """A Ray actor (threaded, ``num_cpus=0``) that hands an epoch's map phase to the ranks.

    An entry goes once every other rank fetched it, or when rank 0 posts an epoch
    two ahead of it (an abandoned epoch), so an epoch's pieces are not held here
    longer than the ranks need them. A failure of rank 0's loading is posted as a
    :class:`Failed`, which every rank waiting for that epoch gets instead.
    """

    def __init__(self, world_size: int) -> None:
        self._readers = world_size - 1
        self._posted: dict[int, tuple[Exchange, list[int], list[list[Any] | None]]] = {}
        self._fetched: dict[int, set[int]] = {}
        self._dealt: dict[int, _Dealt] = {}  # streaming epochs' deals (deal_ranks.py)
        self._failed: dict[int, Failed] = {}  # global shuffles whose map phase failed
        self._told: dict[int, set[int]] = {}  # the ranks each failure was handed to
        self._generations = 0
        self._changed = threading.Condition()

    # -- streaming epochs: rows dealt to the ranks (deal_ranks.py) ----------------------

    def open(self, epoch: int, settings: Any) -> int:
        """Rank 0 starts dealing ``epoch``: its generation (a restart's deals replace the old).

        ``settings``: what every rank needs to cut its batches (its local buffer, seed).
        """
        with self._changed:
            for old in [e for e in self._dealt if e < epoch - 1]:
                del self._dealt[old]
            self._generations += 1
            self._dealt[epoch] = _Dealt(self._generations, settings, self._readers + 1)
            self._changed.notify_all()
            return self._generations

    def deal(self, epoch: int, generation: int, per_rank: list[list[Any]], ended: bool) -> None:
        """Rank 0's next deals of ``epoch`` (``per_rank[r]``: rank ``r``'s new items)."""
        with self._changed:
            entry = self._dealt.get(epoch)
            if entry is None or entry.generation != generation:
                return  # an abandoned start of the epoch
            for rank, items in enumerate(per_rank):
                entry.items[rank].extend(items)
            entry.ended = entry.ended or ended
            self._changed.notify_all()

    def fail_deals(self, generation: int, failure: Failed) -> None:
        """Rank 0's dealing of ``failure.epoch`` (its start ``generation``) failed: see :class:`Failed`."""
        with self._changed:
            entry = self._dealt.get(failure.epoch)
            if entry is None or entry.generation != generation:
                return  # an abandoned start of the epoch
            entry.failed = failure
            self._changed.notify_all()

    def dealt(self, epoch: int, rank: int, wait_s: float) -> Any:
        """``(generation, settings, new items, ended)`` for ``rank``, or ``None`` after ``wait_s``.

        The items are handed over once (forgotten here, so their blocks go with the rank).
        Once rank 0 failed to deal the epoch (:meth:`fail_deals`), its :class:`Failed`.
        """

        def ready() -> bool:
            entry = self._dealt.get(epoch)
            return entry is not None and (
                bool(entry.items[rank]) or entry.ended or entry.failed is not None
            )

        with self._changed:
            if not self._changed.wait_for(ready, timeout=wait_s):
                return None
            entry = self._dealt[epoch]
            if entry.failed is not None:
                return entry.failed
            items, entry.items[rank] = entry.items[rank], []
            return entry.generation, entry.settings, items, entry.ended

    # -- globally shuffled epochs: the map phase -----------------------------------------

    def post(
        self, epoch: int, exchange: Exchange, counts: list[int], pieces: list[list[Any] | None]
    ) -> None:
        """Rank 0's map phase of ``epoch``."""
        with self._changed:
            for old in [e for e in self._posted if e < epoch - 1]:
                self._forget(old)
            # Two epochs back, as the entries; and this epoch's: a new start of it succeeded.
            for old in [e for e in self._failed if e < epoch - 1 or e == epoch]:
                self._forget_failure(old)
            self._posted[epoch] = (exchange, counts, pieces)
            self._fetched[epoch] = set()
            self._changed.notify_all()

    def fail_phase(self, failure: Failed) -> None:
        """Rank 0's map phase of ``failure.epoch`` failed: see :class:`Failed`.

        Handed to each other rank once, then forgotten: a rank that tries the epoch
        again (a script that retries it) waits for rank 0's new map phase instead of
        raising the old failure.
        """
        with self._changed:
            self._failed[failure.epoch] = failure
            self._told[failure.epoch] = set()
            self._changed.notify_all()

    def fetch(self, epoch: int, rank: int, wait_s: float) -> Any:
        """``epoch``'s map phase for ``rank``, waiting up to ``wait_s``; ``None`` if not posted yet.

        Once rank 0's map phase of the epoch failed (:meth:`fail_phase`), its :class:`Failed`.
        """
        with self._changed:
            self._changed.wait_for(
                lambda: epoch in self._posted or epoch in self._failed, timeout=wait_s
            )
            entry = self._posted.get(epoch)
            if entry is None:
                failure = self._failed.get(epoch)
                if failure is not None:
                    told = self._told[epoch]
                    told.add(rank)
                    if len(told) >= self._readers:
                        self._forget_failure(epoch)
                return failure
            fetched = self._fetched[epoch]
            fetched.add(rank)
            if len(fetched) >= self._readers:
                self._forget(epoch)
            return entry

    def _forget_failure(self, epoch: int) -> None:
        self._failed.pop(epoch, None)
        self._told.pop(epoch, None)

    def _forget(self, epoch: int) -> None:
        self._posted.pop(epoch, None)
        self._fetched.pop(epoch, None)


class _Dealt:
    """One streaming epoch's deals on the board, not yet fetched, per rank."""

    def __init__(self, generation: int, settings: Any, world_size: int) -> None:
        self.generation = generation
        self.settings = settings
        self.items: list[list[Any]] = [[] for _ in range(world_size)]
        self.ended = False
        self.failed: Failed | None = None


def start_board(world_size: int) -> Any:
    """A new :class:`Board` actor for ``world_size`` ranks (rank 0 owns it)."""
    import ray

    # Each other rank may wait in two fetches (its epoch and the next); rank 0 posts.
    actor = ray.remote(Board).options(num_cpus=0, max_concurrency=2 * world_size + 4)
    return actor.remote(world_size)


def stop_board(board: Any) -> None:
    """Stop a board (its entries, and so the pieces they hold, go)."""
    import ray

    with contextlib.suppress(Exception):
        ray.kill(board)
