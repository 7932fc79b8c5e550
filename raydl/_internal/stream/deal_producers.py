"""The producers of a streaming direct epoch under several ranks: rank 0's and the others'.

Rank 0's thread (:class:`DealingProducer`) sends the epoch's runs to raydl's
actors in run order, as :class:`~raydl._internal.stream.direct_producer.DirectProducer`
does (``window`` in flight, fewer when runs prove large). Each reply is two
objects: the rows of each of the run's batches (fetched) and the batches (left
in the object store). It hands each run's row count to the epoch's dealer
(``epochs/deal.py``), posts the other ranks' new deals (row ranges of runs,
with the runs' object references) through ``post``, and then cuts its own.
Another rank's thread (:class:`DealtProducer`) fetches its deals (``fetch``),
gets the runs' batches and cuts its own rows of them.

On every rank the blocks a rank cuts are its deals' row ranges, in deal order,
as views of the run's batches (:func:`dealt_blocks`): a pure function of the
runs' outputs and the world size, so its batches (through its own local
shuffle buffer) are reproducible. Two ranks may cut disjoint rows of the same
batch; each rank's rows are its own, so they are made writable (``owned``)
and reach the trainer without a copy, as on one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from raydl._internal.stream.batching import Batch, skip_consumed
from raydl._internal.stream.dispatch import (
    Calls,
    Dispatcher,
    Pool,
    RayCalls,
    ResultTimeout,
    SplitCalls,
)
from raydl._internal.stream.epoch_iterator import Producer
from raydl._internal.stream.exchange_producer import slices
from raydl._internal.stream.handoff import SLICE_S, Handoff, Stopped
from raydl._internal.workers.convert import owned_blocks
from raydl._internal.workers.failure import RemoteError
from raydl.errors import LoaderTimeoutError, RayDLError

#: How long one wait for deals lasts before the caller checks whether to stop.
FETCH_WAIT_S = 0.2

#: One deal as it travels: ``(rows of each batch of the run, [the batches' reference],
#: start, stop)``; the reference nested in a list so that Ray passes it on unresolved.
Item = tuple[list[int], list[Any], int, int]
#: A fetch's answer: ``(generation, settings, new items, ended)``, ``None`` while none came.
Reply = tuple[int, Any, list[Item], bool]


class Dealer(Protocol):
    """The epoch's deal (:class:`raydl._internal.epochs.deal.Dealer`)."""

    world_size: int

    def add(self, rows: int) -> Sequence[Any]: ...

    @property
    def first_waiting(self) -> int: ...


def dealt_blocks(
    batches: Sequence[Batch], counts: Sequence[int], start: int, stop: int
) -> list[Batch]:
    """Rows ``start:stop`` of a run, as views of its ``batches`` (``counts`` rows each).

    Example:
        >>> import numpy as np
        >>> run = [{"x": np.arange(3)}, {"x": np.arange(3, 7)}]
        >>> [b["x"].tolist() for b in dealt_blocks(run, [3, 4], 2, 5)]
        [[2], [3, 4]]
    """
    return [
        {name: column[piece.start : piece.stop] for name, column in batches[piece.part].items()}
        for piece in slices(list(counts), start, stop)
    ]


class _DealtBase(Producer):
    """What both ranks' producers share: a thread cutting its blocks, getting runs' batches."""

    def __init__(self, *, collate: Callable[[Any], Any], prefetch: int, skip: int,
                 start_next: Callable[[], bool] | None, description: str,
                 gets: Calls | None) -> None:  # fmt: skip
        self._collate = collate
        self._skip = skip
        self._start_next = start_next
        self._description = description
        self._gets = gets or RayCalls()
        self._last: tuple[Any, list[Batch]] | None = None  # the last run's batches got
        self.rows = 0  # rows this rank was dealt so far (for the summary)
        self.generation: int | None = None  # rank 0's start of the epoch (deal_ranks.py)
        self.handoff = Handoff(maxsize=max(1, prefetch))

    def summary(self) -> str | None:
        return f"{self._description}: {self.rows} rows dealt"

    def _check_stop(self) -> None:
        if self.handoff.stopped:
            raise Stopped

    def _emit(
        self, cut: Callable[[Iterator[Batch]], Iterator[Any]], blocks: Iterator[Batch]
    ) -> None:
        for batch in skip_consumed(cut(blocks), self._skip):
            self.handoff.put(self._collate(batch))

    def _ask_next(self) -> None:
        start = self._start_next
        if start is not None and not self.handoff.stopped and start():
            self._start_next = None

    def _batches(self, ref: Any) -> list[Batch]:
        """A run's batches (the last run's are kept: consecutive deals share a run)."""
        if self._last is not None and self._last[0] == ref:
            return self._last[1]
        while True:
            try:
                batches = owned_blocks(self._gets.get(ref, SLICE_S))
                break
            except ResultTimeout:
                self._check_stop()
        self._last = (ref, batches)
        return batches

    def _cut_item(self, counts: list[int], ref: Any, start: int, stop: int) -> Iterator[Batch]:
        self.rows += stop - start
        yield from dealt_blocks(self._batches(ref), counts, start, stop)


class DealtProducer(_DealtBase):
    """A rank's part of a streaming epoch under several ranks (see the module docstring).

    On a rank other than 0, its deals come from rank 0's board; on rank 0, from its
    dealer thread (:class:`DealingProducer`).

    Args:
        fetch: This rank's next deals from rank 0 (a :data:`Reply`), ``None`` while none
            came; given a stop check.
        cut_for: The epoch's settings (posted by rank 0) -> blocks -> this rank's batches.
        generation: The start of the epoch on rank 0 whose deals this rank takes, when
            known (see :meth:`expect`).
        skip: Batches to drop first (a resume at the same world size).
        start_next: Asked once rank 0 dealt the whole epoch, to start the next one.
    """

    def __init__(
        self,
        fetch: Callable[[], Reply | None],
        *,
        cut_for: Callable[[Any], Callable[[Iterator[Batch]], Iterator[Any]]],
        collate: Callable[[Any], Any],
        prefetch: int,
        skip: int,
        start_next: Callable[[], bool] | None,
        generation: int | None,
        description: str,
        name: str,
        gets: Calls | None = None,
    ) -> None:
        super().__init__(collate=collate, prefetch=prefetch, skip=skip, start_next=start_next,
                         description=description, gets=gets)  # fmt: skip
        self._fetch = fetch
        self._expected = generation  # self.generation: that of the deals taken, once known
        self.handoff.start(lambda: self._run(cut_for), name=name)

    def expect(self, generation: int) -> bool:
        """Take only the deals of rank 0's start ``generation``; ``False`` if others were taken."""
        self._expected = generation
        return self.generation in (None, generation)

    def _reply(self) -> Reply:
        while True:
            reply = self._fetch()
            if reply is not None:
                break
            self._check_stop()
        generation = reply[0]
        if self.generation is None:
            self.generation = generation
        expected = self._expected
        if generation != self.generation or expected not in (None, generation):
            raise RayDLError(
                f"rank 0 restarted this epoch (start {generation}) after this rank took deals "
                f"of its start {self.generation}; iterate every rank's loader the same way "
                "(the same epochs, set_epoch and load_state_dict on every rank)."
            )
        return reply

    def _run(self, cut_for: Callable[[Any], Callable[[Iterator[Batch]], Iterator[Any]]]) -> None:
        first = self._reply()
        self._emit(cut_for(first[1]), self._blocks(first))

    def _blocks(self, reply: Reply) -> Iterator[Batch]:
        while True:
            _, _, items, ended = reply
            for counts, holder, start, stop in items:
                if ended:
                    self._ask_next()
                yield from self._cut_item(counts, holder[0], start, stop)
            if ended:
                self._ask_next()
                return
            reply = self._reply()


class DealingProducer(DealtProducer):
    """Rank 0's part of a streaming epoch under several ranks (see the module docstring).

    Two named threads: the dealer (``<name>-dealer``) sends the runs, deals each
    run's rows as soon as it is loaded, posts the other ranks' deals and hands
    rank 0's own to this rank's cutter (a :class:`Handoff` of ``window`` runs), which
    cuts them as any rank does. So rank 0's trainer being ``prefetch`` batches ahead
    never holds the other ranks' deals back; the dealer stops sending runs while
    rank 0 has ``window`` runs of its own not yet cut.

    Args:
        pool: raydl's actors.
        runs: The epoch's requests (``DealRun`` s with the epoch's work), in run order.
        dealer: The epoch's deal.
        post: ``(per-rank new items, ended)`` -> posted for the other ranks (waited for).
        fail: Called with the dealer's exception (a run that failed to load) before it
            ends the epoch on this rank, so that the other ranks learn of it.
        generation: This start of the epoch on the board.
        settings: The epoch's cut settings (as posted on the board).
        window: Runs in flight, at most; ``window_bytes``: bytes in flight, at most (by
            the largest run so far, as its actor measured it).
        cut_for: The epoch's settings -> blocks -> this rank's batches.
        describe: Names a request in an error.
        The rest as for :class:`DealtProducer`.
    """

    def __init__(
        self,
        pool: Pool,
        runs: Sequence[Any],
        *,
        dealer: Dealer,
        post: Callable[[list[list[Item]], bool], None],
        fail: Callable[[BaseException], None],
        generation: int,
        settings: Any,
        window: int,
        window_bytes: int,
        describe: Callable[[Any], str],
        start_next: Callable[[], bool] | None,
        name: str,
        calls: Calls | None = None,
        **rest: Any,
    ) -> None:
        self._runs = runs
        self._dealer = dealer
        self._post = post
        self._fail = fail
        self._settings = settings
        self._window = max(1, window)
        self._window_bytes = window_bytes
        self._largest = 0  # bytes of the largest run so far
        self._collected = 0  # runs loaded so far (the next one's index)
        self._dealer_start_next = start_next
        self._deals = Handoff(maxsize=self._window)  # rank 0's own deals, per run
        self._dispatch = Dispatcher(
            pool, calls or SplitCalls(2), method="fetch", describe=describe,
            between=self._check_dealer_stop,
        )  # fmt: skip
        self._deals.start(lambda: self._deal_or_fail(generation), name=f"{name}-dealer")
        super().__init__(self._own, start_next=start_next, generation=generation, name=name, **rest)
        self.generation = generation

    def close(self, *, stalled: bool = False) -> None:
        self._deals.stop()
        super().close(stalled=stalled)

    def _own(self) -> Reply | None:
        """Rank 0's next deals, from its dealer thread; ``None`` while none came."""
        try:
            reply: Reply = self._deals.take(FETCH_WAIT_S)
        except LoaderTimeoutError:
            return None
        except StopIteration:
            raise Stopped from None
        return reply

    def _check_dealer_stop(self) -> None:
        if self._deals.stopped:
            raise Stopped

    def _deal_or_fail(self, generation: int) -> None:
        """The dealer thread: :meth:`_deal`, telling the other ranks if it fails."""
        try:
            self._deal(generation)
        except Stopped:
            raise  # this rank stopped the epoch: nothing failed
        except Exception as err:
            if not self._deals.stopped:  # a failure of an epoch being stopped is no failure
                self._fail(err)
            raise

    def _deal(self, generation: int) -> None:
        """Every run of the epoch, in order, loaded and dealt."""
        runs = iter(self._runs)
        world = self._dealer.world_size
        loaded: dict[int, tuple[list[int], Any]] = {}  # runs with rows not dealt yet
        sent_all = False
        while True:
            window = max(1, min(self._window, self._window_bytes // max(1, self._largest)))
            sent_all = sent_all or self._dispatch.top_up(runs, window)
            start = self._dealer_start_next
            if sent_all and start is not None and not self._deals.stopped and start():
                self._dealer_start_next = None
            no_run: tuple[Any, list[Any]] = (([], 0), [None])  # an epoch of no runs at all
            head, refs = self._dispatch.collect() if self._dispatch else no_run
            if isinstance(head, RemoteError):
                head.reraise()
            counts, size = head
            self._largest = max(self._largest, size)
            ended = sent_all and not self._dispatch
            per_rank: list[list[Item]] = [[] for _ in range(world)]
            if refs[0] is not None:
                loaded[self._collected] = (counts, refs[0])
                self._collected += 1
                for each in self._dealer.add(sum(counts)):
                    run_counts, ref = loaded[each.run]
                    per_rank[each.rank].append((run_counts, [ref], each.start, each.stop))
                for old in [r for r in loaded if r < self._dealer.first_waiting]:
                    del loaded[old]
            mine, per_rank[0] = per_rank[0], []
            if ended or any(per_rank):
                self._post(per_rank, ended)
            if ended or mine:
                self._deals.put((generation, self._settings, mine, ended))
            if ended:
                return
