"""Direct epochs served to several ranks through a board; here the globally shuffled ones.

The board (:class:`Board`) also carries the streaming epochs' deals (``deal_ranks.py``).

Rank 0 runs the epoch's map phase on raydl's actors (``exchange.py``) and posts
its result, the exchange and every partition's row count and pieces (object
references), on a :class:`Board`: one small Ray actor per loader, created by
rank 0. Every other rank fetches the result from the board; no rank talks to
the actors but rank 0, and no collective runs off the trainer's thread.

Each rank then reduces its own rows of the epoch, in its own process: the
epoch's rows are dealt as contiguous, equal shares (:func:`exchange.shares`),
known exactly once the map phase has counted every partition, so every rank
gets the same number of batches and at most ``world_size - 1`` rows (the
epoch's last) are left out, whatever filters did to the row count. A share of
a uniform permutation is a uniform sample, so each rank sees a uniform draw.

The next epoch starts early on every rank: rank 0's map phase of epoch e+1 runs
on the actors while the ranks drain epoch e, and the other ranks' early epochs
wait on the board for it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from raydl._internal.epochs.direct import DirectPlan, map_phase
from raydl._internal.epochs.exchange import Exchange
from raydl._internal.stream.dispatch import Pool
from raydl._internal.stream.exchange_producer import Partitions
from raydl.errors import RayDLError

#: How long one fetch from the board waits before the caller checks whether to stop.
FETCH_WAIT_S = 0.2


class Board:
    """A Ray actor (threaded, ``num_cpus=0``) that hands an epoch's map phase to the ranks.

    An entry goes once every other rank fetched it, or when rank 0 posts an epoch
    two ahead of it (an abandoned epoch), so an epoch's pieces are not held here
    longer than the ranks need them.
    """

    def __init__(self, world_size: int) -> None:
        self._readers = world_size - 1
        self._posted: dict[int, tuple[Exchange, list[int], list[list[Any] | None]]] = {}
        self._fetched: dict[int, set[int]] = {}
        self._dealt: dict[int, _Dealt] = {}  # streaming epochs' deals (deal_ranks.py)
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

    def dealt(self, epoch: int, rank: int, wait_s: float) -> Any:
        """``(generation, settings, new items, ended)`` for ``rank``, or ``None`` after ``wait_s``.

        The items are handed over once (forgotten here, so their blocks go with the rank).
        """

        def ready() -> bool:
            entry = self._dealt.get(epoch)
            return entry is not None and (bool(entry.items[rank]) or entry.ended)

        with self._changed:
            if not self._changed.wait_for(ready, timeout=wait_s):
                return None
            entry = self._dealt[epoch]
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
            self._posted[epoch] = (exchange, counts, pieces)
            self._fetched[epoch] = set()
            self._changed.notify_all()

    def fetch(self, epoch: int, rank: int, wait_s: float) -> Any:
        """``epoch``'s map phase for ``rank``, waiting up to ``wait_s``; ``None`` if not posted yet."""
        with self._changed:
            self._changed.wait_for(lambda: epoch in self._posted, timeout=wait_s)
            entry = self._posted.get(epoch)
            if entry is None:
                return None
            fetched = self._fetched[epoch]
            fetched.add(rank)
            if len(fetched) >= self._readers:
                self._forget(epoch)
            return entry

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


class RankZeroPhase:
    """Rank 0's map phase of ``epoch``: run on the actors, then posted on the board."""

    def __init__(self, pool: Pool, work: Any, plan: DirectPlan, board: Any, epoch: int) -> None:
        self._pool, self._work, self._direct = pool, work, plan
        self._board, self._epoch = board, epoch
        assert plan.exchange is not None
        self.exchange: Exchange = plan.exchange

    def __call__(self, between: Callable[[], None]) -> Partitions:
        import ray

        partitions = map_phase(self._pool, self._work, self._direct, between)
        # Awaited, so that no rank can ask for the epoch before it is there to wait for.
        ref = self._board.post.remote(
            self._epoch, self.exchange, partitions.counts, list(partitions.pieces)
        )
        ray.get(ref)
        return partitions

    def reduce(self, part: int, pieces: list[Any], start: int, stop: int) -> Any:
        return self.exchange.reduce(part, pieces, start, stop)


class BoardPhase:
    """Another rank's map phase of ``epoch``: rank 0's, fetched from the board."""

    def __init__(self, board: Any, epoch: int, rank: int) -> None:
        self._board, self._epoch, self._rank = board, epoch, rank
        self.exchange: Exchange | None = None

    def __call__(self, between: Callable[[], None]) -> Partitions:
        import ray
        from ray.exceptions import RayActorError

        while True:
            try:
                entry = ray.get(self._board.fetch.remote(self._epoch, self._rank, FETCH_WAIT_S))
            except RayActorError as err:
                raise RayDLError(
                    f"rank {self._rank}: the board through which rank 0 shares epoch "
                    f"{self._epoch}'s global shuffle is gone ({type(err).__name__}): rank 0 "
                    "has died or closed its loader; see rank 0's log."
                ) from err
            if entry is not None:
                break
            between()
        self.exchange, counts, pieces = entry
        return Partitions(list(counts), list(pieces))

    def reduce(self, part: int, pieces: list[Any], start: int, stop: int) -> Any:
        assert self.exchange is not None, "reduce before the map phase"
        return self.exchange.reduce(part, pieces, start, stop)
