"""A streaming direct epoch served to several ranks: rank 0 loads, deals rows through a board.

Under ``torchrun``, an epoch of a plan the direct path accepts in a streaming
mode (``shuffle_mode="files"``, or no shuffle) runs on rank 0's raydl actors for
every rank, not through Ray Data's ``streaming_split``:

* rank 0's dealer thread (:class:`~raydl._internal.stream.deal_producers.DealingProducer`)
  loads the epoch's runs in run order on the shared pool, as on one rank, and
  deals each run's rows by the rule of ``deal.py`` (each rank's allowance is the
  rows loaded so far over the world size): the other ranks' deals, row ranges
  of runs with the runs' object references, go to the loader's
  :class:`~raydl._internal.epochs.board.Board` (the actor that also
  carries the globally shuffled epochs); rank 0's own go to its cutter thread;
* every other rank's producer thread
  (:class:`~raydl._internal.stream.deal_producers.DealtProducer`) fetches its
  deals from the board, gets the runs' batches from the object store and cuts
  its rows through its own local shuffle buffer (seeded per rank, ``rank_seed``).

Every rank holds the same number of rows, within one, at every moment, and
exactly ``T // world_size`` at the epoch's end: equal batch counts, at most
``world_size - 1`` rows left out (the epoch's last), whatever filters did. The
deal and each rank's batches are pure functions of (seed, epoch, world size)
and the runs' outputs, not of timing.

Should a run fail to load on rank 0 (a stage raising on a file, an actor dying on
every retry), rank 0 raises the error and posts it on the board; every other rank
then raises a :class:`~raydl.errors.RayDLError` naming rank 0 and that error,
instead of waiting for deals that never come.

A start of an epoch on rank 0 opens it on the board under a new *generation*
(``Board.open``), which rank 0 broadcasts in the epoch's plan: a rank whose
early start took deals of an abandoned start of the epoch is found out and
rebuilt (or fails with an error naming it), never mixing two starts' rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from raydl._internal.epochs.board import Failed, failed
from raydl._internal.epochs.deal import Dealer
from raydl._internal.epochs.direct import (
    WINDOW_BYTES,
    DealRun,
    DirectPlan,
    describe_run,
)
from raydl._internal.stream.batching import Batch
from raydl._internal.stream.deal_producers import (
    FETCH_WAIT_S,
    DealingProducer,
    DealtProducer,
    Item,
    Reply,
)
from raydl._internal.stream.dispatch import Pool
from raydl.errors import RayDLError

#: What every rank needs to cut its batches: ``(local buffer rows, its seed before the rank's offset)``.
CutSettings = tuple[int | None, int | None]
Cut = Callable[[Iterator[Batch]], Iterator[Any]]


def _board_gone(err: BaseException, rank: int, epoch: int) -> RayDLError:
    return RayDLError(
        f"rank {rank}: the board through which rank 0 deals epoch {epoch}'s rows is gone "
        f"({type(err).__name__}): rank 0 has died or closed its loader; see rank 0's log."
    )


def _call(board: Any, method: str, rank: int, epoch: int, *args: Any) -> Any:
    import ray
    from ray.exceptions import RayActorError

    try:
        return ray.get(getattr(board, method).remote(*args))
    except RayActorError as err:
        raise _board_gone(err, rank, epoch) from err


def rank_zero(
    board: Any,
    epoch: int,
    world_size: int,
    *,
    pool: Pool,
    work: Any,
    direct: DirectPlan,
    settings: CutSettings,
    cut_for: Callable[[CutSettings], Cut],
    window: int,
    description: str,
    **producer: Any,
) -> DealingProducer:
    """Rank 0's producer of ``epoch``, opened on ``board`` under a new ``generation``."""
    generation = _call(board, "open", 0, epoch, epoch, settings)

    def post(per_rank: list[list[Item]], ended: bool) -> None:
        _call(board, "deal", 0, epoch, epoch, generation, per_rank, ended)

    def fail(err: BaseException) -> None:
        with contextlib.suppress(Exception):  # best effort: the board may be gone
            _call(board, "fail_deals", 0, epoch, generation, failed(epoch, err))

    holder = [work]  # nested in a list, the reference reaches the actors unresolved
    return DealingProducer(
        pool,
        [(holder, DealRun(tuple(run))) for run in direct.runs()],
        dealer=Dealer(world_size),
        post=post,
        fail=fail,
        generation=generation,
        settings=settings,
        window=window,
        window_bytes=WINDOW_BYTES,
        cut_for=cut_for,
        describe=lambda request: describe_run(request[1].paths),
        description=f"{description}, rank 0 of {world_size}",
        **producer,
    )


def other_rank(
    board: Any,
    epoch: int,
    rank: int,
    world_size: int,
    *,
    generation: int | None,
    cut_for: Callable[[CutSettings], Cut],
    **producer: Any,
) -> DealtProducer:
    """Rank ``rank``'s producer of ``epoch``: its deals fetched from ``board``."""

    def fetch() -> Reply | None:
        reply: Reply | Failed | None = _call(board, "dealt", rank, epoch, epoch, rank, FETCH_WAIT_S)
        if isinstance(reply, Failed):
            raise reply.error(rank)
        return reply

    return DealtProducer(
        fetch,
        cut_for=cut_for,
        generation=generation,
        description=f"rows dealt by rank 0 from raydl actors, rank {rank} of {world_size}",
        **producer,
    )
