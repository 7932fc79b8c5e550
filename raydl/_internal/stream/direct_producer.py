"""A direct epoch's producer: runs of files on raydl's actors, cut into batches here.

See :mod:`~raydl._internal.epochs.direct` for what a run is and why a run is a pure
function of its files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from raydl._internal.stream.batching import skip_consumed
from raydl._internal.stream.dispatch import ActorStart, Calls, Dispatcher, Pool, RayCalls
from raydl._internal.stream.handoff import Handoff
from raydl._internal.stream.pool_producers import PoolProducer, unwrap
from raydl._internal.workers.convert import owned_blocks


class DirectProducer(PoolProducer):
    """A direct epoch (see :mod:`~raydl._internal.epochs.direct`): runs of files on actors.

    The thread sends the epoch's runs of files to the pool's actors, ``window`` in
    flight, takes their blocks in order, cuts them into batches with ``cut``,
    drops the first ``skip`` (a resume), converts the rest with ``collate`` and
    hands them over (``prefetch`` queued). Worker deaths are handled as for
    map-style batches (a run is a pure function of its files). Once every run is
    sent, ``start_next`` is asked to start the next epoch (and asked again at each
    block while it answers ``False``: too soon). Fewer runs are in flight when
    loaded runs are large: at most ``window_bytes`` by the largest run so far
    (``size_of`` a run's blocks). ``describe`` names a run in an error.

    A run's blocks were loaded for this epoch alone, so they are *owned*
    (:func:`~raydl._internal.workers.convert.owned_blocks`): the batches cut from
    them reach ``collate`` writable, over the object store's memory, not copied.

    With ``local`` and ``start`` (:class:`ActorStart`), the first runs are loaded in
    this process by ``local(request)`` while the actors start: a warm-up goes to
    every actor once, and runs go to the actors from the first run after all of them
    answered (or failed: their runs then meet the failure as usual). A run is a pure
    function of its files, so the epoch's blocks, and its batches, are the same
    either way; only its first batch comes sooner (an actor's first reply waits for
    its process and imports, seconds on a small machine).
    """

    def __init__(
        self,
        pool: Pool,
        runs: Sequence[Any],
        *,
        window: int,
        prefetch: int,
        cut: Callable[[Iterator[Any]], Iterator[Any]],
        collate: Callable[[Any], Any],
        skip: int,
        start_next: Callable[[], bool] | None,
        window_bytes: int,
        size_of: Callable[[Any], int],
        describe: Callable[[Any], str],
        description: str,
        name: str,
        calls: Calls | None = None,
        local: Callable[[Any], list[Any]] | None = None,
        start: ActorStart | None = None,
    ) -> None:
        super().__init__(None)
        self._pool = pool
        self._calls = calls or RayCalls()
        self._local = local if start is not None else None
        self._start = start
        self._window_bytes = window_bytes
        self._size_of = size_of
        self._runs = runs
        self._window = max(1, window)
        self._cut = cut
        self._collate = collate
        self._skip = skip
        self._start_next = start_next
        self._description = description
        self._dispatch = Dispatcher(
            pool, self._calls, method="fetch", describe=describe, between=self._check_stop
        )
        self.blocks = 0  # blocks received so far (for the epoch's summary)
        self.loaded_here = 0  # runs loaded by ``local`` while the actors started
        self._largest = 0  # bytes of the largest loaded run so far
        self.handoff = Handoff(maxsize=max(1, prefetch))
        self.handoff.start(self._loop, name=name)

    def summary(self) -> str | None:
        here = self.loaded_here
        started = f", {here} runs loaded in the training process while they started" if here else ""
        return f"{self._description}: {self.blocks} blocks{started}"

    def _loop(self) -> None:
        for batch in skip_consumed(self._cut(self._blocks()), self._skip):
            self.handoff.put(self._collate(batch))

    def _blocks(self) -> Iterator[Any]:
        runs = iter(self._runs)
        if self._local is not None:
            yield from self._while_the_actors_start(runs)
        sent_all = False
        while True:
            # Fewer runs in flight once loaded runs proved large (the largest so far).
            window = max(1, min(self._window, self._window_bytes // max(1, self._largest)))
            sent_all = sent_all or self._dispatch.top_up(runs, window)
            start = self._start_next
            if sent_all and start is not None and not self.handoff.stopped and start():
                self._start_next = None
            if not self._dispatch:
                return
            yield from self._loaded(owned_blocks(unwrap(self._dispatch.collect())))

    def _loaded(self, blocks: list[Any]) -> list[Any]:
        """A loaded run's blocks, counted (the summary's blocks, the largest run so far)."""
        self.blocks += len(blocks)
        self._largest = max(self._largest, self._size_of(blocks))
        return blocks

    def _while_the_actors_start(self, runs: Iterator[Any]) -> Iterator[Any]:
        """The first of ``runs``, loaded here while some actor has not answered its warm-up."""
        assert self._local is not None and self._start is not None
        while self._start.starting(self._pool, self._calls):
            request = next(runs, None)
            if request is None:
                return
            self._check_stop()
            self.loaded_here += 1
            yield from self._loaded(owned_blocks(self._local(request)))  # this epoch's alone
