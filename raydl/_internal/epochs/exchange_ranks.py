"""Direct epochs served to several ranks through a board; here the globally shuffled ones.

The board (``board.py``) also carries the streaming epochs' deals (``deal_ranks.py``).

Rank 0 runs the epoch's map phase on raydl's actors (``exchange.py``) and posts
its result, the exchange and every partition's row count and pieces (object
references), on a :class:`~raydl._internal.epochs.board.Board`: one small Ray
actor per loader, created by rank 0. Every other rank fetches the result from the
board; no rank talks to the actors but rank 0, and no collective runs off the
trainer's thread.

Each rank then reduces its own rows of the epoch, in its own process: the
epoch's rows are dealt as contiguous, equal shares (:func:`exchange.shares`),
known exactly once the map phase has counted every partition, so every rank
gets the same number of batches and at most ``world_size - 1`` rows (the
epoch's last) are left out, whatever filters did to the row count. A share of
a uniform permutation is a uniform sample, so each rank sees a uniform draw.

The next epoch starts early on every rank: rank 0's map phase of epoch e+1 runs
on the actors while the ranks drain epoch e, and the other ranks' early epochs
wait on the board for it.

Should rank 0's map phase fail (a stage raising on a file, an actor dying on every
retry), rank 0 raises the error and posts it on the board: every other rank then
raises a :class:`~raydl.errors.RayDLError` naming rank 0 and that error, instead
of waiting for a map phase that never comes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from raydl._internal.epochs.board import Failed, failed
from raydl._internal.epochs.exchange import Exchange
from raydl._internal.stream.exchange_producer import Partitions
from raydl._internal.stream.handoff import Stopped
from raydl.errors import RayDLError

#: How long one fetch from the board waits before the caller checks whether to stop.
FETCH_WAIT_S = 0.2


def post_failure(board: Any, epoch: int, err: BaseException) -> None:
    """Tell the ranks waiting on ``board`` that rank 0's map phase of ``epoch`` failed.

    Best effort: the board may be gone (rank 0's loader closing).
    """
    import ray

    with contextlib.suppress(Exception):
        ray.get(board.fail_phase.remote(failed(epoch, err)))


class RankZeroPhase:
    """Rank 0's map phase of ``epoch``: ``phase`` runs it on the actors, then the board gets it."""

    def __init__(
        self,
        phase: Callable[[Callable[[], None]], Partitions],
        exchange: Exchange,
        board: Any,
        epoch: int,
    ) -> None:
        self._phase, self.exchange = phase, exchange
        self._board, self._epoch = board, epoch

    def __call__(self, between: Callable[[], None]) -> Partitions:
        import ray

        try:
            partitions = self._phase(between)
        except Stopped:
            raise  # the epoch was abandoned here: nothing failed
        except Exception as err:
            post_failure(self._board, self._epoch, err)  # the other ranks wait on the board
            raise
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
            if isinstance(entry, Failed):
                raise entry.error(self._rank)
            if entry is not None:
                break
            between()
        self.exchange, counts, pieces = entry
        return Partitions(list(counts), list(pieces))

    def reduce(self, part: int, pieces: list[Any], start: int, stop: int) -> Any:
        assert self.exchange is not None, "reduce before the map phase"
        return self.exchange.reduce(part, pieces, start, stop)
