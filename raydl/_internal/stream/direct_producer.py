"""A direct epoch's producer: runs of files on raydl's actors, cut into batches here.

See :mod:`~raydl._internal.epochs.direct` for what a run is and why a run is a pure
function of its files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from raydl._internal.stream.batching import skip_consumed
from raydl._internal.stream.dispatch import Actors, Calls, Dispatcher, LateActors, StreamedCalls
from raydl._internal.stream.handoff import Handoff
from raydl._internal.stream.pool_producers import PoolProducer, unwrap
from raydl._internal.workers.convert import owned_blocks

#: The actors' method a run is loaded by: its reply streamed in parts (``RunLoader.parts``).
RUN_METHOD = "fetch_parts"


class DirectProducer(PoolProducer):
    """A direct epoch (see :mod:`~raydl._internal.epochs.direct`): runs of files on actors.

    The thread sends the epoch's runs of files to the pool's actors,
    ``window_per_actor`` per actor in flight, takes their blocks in order, cuts them into batches with ``cut``,
    drops the first ``skip`` (a resume), converts the rest with ``collate`` and
    hands them over (``prefetch`` queued). Worker deaths are handled as for
    map-style batches (a run is a pure function of its files). Once every run is
    sent, ``start_next`` is asked to start the next epoch (and asked again at each
    block while it answers ``False``: too soon). Fewer runs are in flight when
    loaded runs are large: at most ``window_bytes`` by the largest run so far
    (``size_of`` a run's blocks). ``describe`` names a request in an error. A run's
    reply is streamed in parts (:data:`RUN_METHOD`) unless every run so far fit in
    ``part_bytes``: then it is asked for whole (one Ray object, not a stream).

    A run's blocks were loaded for this epoch alone, so they are *owned*
    (:func:`~raydl._internal.workers.convert.owned_blocks`): the batches cut from
    them reach ``collate`` writable, over the object store's memory, not copied.

    ``actors`` is an :class:`Actors`, or a :class:`LateActors` that makes them on
    this thread once Ray is up: an epoch may start while Ray itself still starts (a
    reader's plan, built without Ray). With ``local``, runs load in this process by
    ``local(run)`` until Ray is up and the actors answered their warm-up
    (:meth:`LateActors.starting`). A run is a pure function of its files, so the
    epoch's blocks, and its batches, are the same either way; only its first batch
    comes sooner (Ray's start and an actor's first reply wait for processes and
    imports, seconds on a small machine).
    ``description`` may name ``{actors}``, the pool's size, filled in once it is known.
    """

    def __init__(
        self,
        actors: Actors | LateActors,
        runs: Sequence[Any],
        *,
        window_per_actor: int,
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
        part_bytes: int = 0,
    ) -> None:
        super().__init__(None)
        self._calls = calls or StreamedCalls(RUN_METHOD, whole="fetch")
        self._part_bytes = part_bytes
        self._actors = (
            actors if isinstance(actors, LateActors) else LateActors(actors, calls=self._calls)
        )
        self._local = local
        self._window_bytes = window_bytes
        self._size_of = size_of
        self._runs = runs
        self._per_actor = max(1, window_per_actor)
        self._cut = cut
        self._collate = collate
        self._skip = skip
        self._start_next = start_next
        self._describe = describe
        self._description = description
        self.blocks = 0  # blocks received so far (for the epoch's summary)
        self.loaded_here = 0  # runs loaded by ``local`` while Ray or the actors started
        self._largest = 0  # bytes of the largest loaded run so far
        self.handoff = Handoff(maxsize=max(1, prefetch))
        self.handoff.start(self._loop, name=name)

    def summary(self) -> str | None:
        here = self.loaded_here
        started = f", {here} runs loaded in the training process while they started" if here else ""
        bound = self._actors.bound
        actors = "no" if bound is None else str(len(bound.pool))
        return f"{self._description.replace('{actors}', actors)}: {self.blocks} blocks{started}"

    def _loop(self) -> None:
        for batch in skip_consumed(self._cut(self._blocks()), self._skip):
            self.handoff.put(self._collate(batch))

    def _blocks(self) -> Iterator[Any]:
        runs = iter(self._runs)
        if self._local is not None:
            yield from self._while_starting(runs)
            if self.loaded_here == len(self._runs):  # all here: the epoch needs no Ray
                self._ask_next()
                return
        actors = self._actors.bind(self._check_stop)
        assert actors is not None
        dispatch = Dispatcher(
            actors.pool,
            self._calls,
            method=RUN_METHOD,
            describe=self._describe,
            between=self._check_stop,
        )
        requests = map(actors.request, runs)
        most = self._per_actor * max(1, len(actors.pool))
        sent_all = False
        while True:
            # Fewer runs in flight once loaded runs proved large (the largest so far).
            window = max(1, min(most, self._window_bytes // max(1, self._largest)))
            sent_all = sent_all or dispatch.top_up(requests, window)
            if sent_all:
                self._ask_next()
            if not dispatch:
                return
            yield from self._loaded(owned_blocks(unwrap(dispatch.collect())))

    def _ask_next(self) -> None:
        """Every run is sent: ask ``start_next`` to start the next epoch (until it says yes)."""
        start = self._start_next
        if start is not None and not self.handoff.stopped and start():
            self._start_next = None

    def _loaded(self, blocks: list[Any]) -> list[Any]:
        """A loaded run's blocks, counted (the summary's blocks, the largest run so far)."""
        self.blocks += len(blocks)
        self._largest = max(self._largest, self._size_of(blocks))
        if isinstance(self._calls, StreamedCalls):  # runs that fit in one part go whole
            self._calls.stream = self._largest > self._part_bytes
        return blocks

    def _while_starting(self, runs: Iterator[Any]) -> Iterator[Any]:
        """The first of ``runs``, loaded here while Ray or some actor has not answered yet."""
        assert self._local is not None
        while True:
            self._check_stop()  # before starting(), which may bind (connect, start the pool)
            if not self._actors.starting():
                return
            run = next(runs, None)
            if run is None:
                return
            self.loaded_here += 1
            yield from self._loaded(owned_blocks(self._local(run)))  # this epoch's alone
