"""The producer of a Ray Data epoch: Ray's streaming executor, batches cut by raydl.

A named thread iterates the epoch's plan (a ``Dataset``, or this rank's
``streaming_split`` part), cuts Ray's blocks into batches (``batching.py``),
converts them and hands them over. It stops on ``close()``; a stage's exception
reaches the trainer with the user's own type. The thread never refers to the
iterator, so a ``break`` that drops the iterator lets it be collected, and its
``close()`` stops the thread and Ray's executor, as torch's iterators do.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

from raydl._internal.ray_compat.errors import users_error
from raydl._internal.ray_compat.iteration import RayIteration
from raydl._internal.runtime.cluster import is_connected
from raydl._internal.stream.batching import ray_batches, skip_consumed
from raydl._internal.stream.epoch_iterator import Producer
from raydl._internal.stream.handoff import Handoff
from raydl._internal.stream.pinned import HostArrays


class RayDataProducer(Producer):
    """Epoch batches of a Ray Data source, on a producer thread.

    Args:
        source: The epoch's ``ray.data.Dataset`` or this rank's split.
        batch_size: Rows per batch.
        drop_last: Drop the last incomplete batch.
        local_shuffle_buffer_size: Rows of the local shuffle buffer (``None``: none).
        local_shuffle_seed: Its seed.
        collate: Turns a numpy batch into what the trainer gets.
        prefetch: Batches handed over ahead of the trainer.
        epoch: The epoch (names the thread).
        stages: The plan's stage names, for an error that cannot say which failed.
        attempts: Times Ray runs a task before a dead worker is an error.
        skip: Batches to drop first (a resume). They still run through the pipeline
            (that is the cost of a resume).
        start_next: Starts the next epoch early; asked from the thread as soon as one
            of these holds: Ray's executor has run every task (its outputs wait for
            the trainer, the cluster is idle); a batch arrived and
            ``start_next_early`` (the plan has an all-to-all stage, so its execution
            is mostly done by then); the epoch is exhausted. It answers ``False``
            while it is too soon and is asked again at the next batch.
        start_next_early: See ``start_next``.
    """

    def __init__(
        self,
        source: Any,
        *,
        batch_size: int,
        drop_last: bool,
        local_shuffle_buffer_size: int | None,
        local_shuffle_seed: int | None,
        collate: Callable[[Any], Any],
        prefetch: int,
        epoch: int,
        stages: Sequence[str] = (),
        attempts: int = 1,
        skip: int = 0,
        start_next: Callable[[], bool] | None = None,
        start_next_early: bool = False,
    ) -> None:
        self._source = source
        self._ray = RayIteration(source)
        self._batches = ray_batches(
            self._ray.iterator,
            batch_size=batch_size,
            drop_last=drop_last,
            buffer=local_shuffle_buffer_size,
            seed=local_shuffle_seed,
            empty=HostArrays().empty,  # used on this producer's thread only
        )
        self._collate = collate
        self._skip = skip
        self._start_next = start_next
        self._start_next_early = start_next_early
        self._summary: str | None = None  # Ray Data's per-stage summary, once exhausted
        self.handoff = Handoff(maxsize=max(1, prefetch))
        self.handoff.start(
            self._run,
            name=f"raydl-epoch-{epoch}-producer",
            describe_error=lambda err: users_error(err, tuple(stages), attempts),
        )

    def summary(self) -> str | None:
        return self._summary

    def _run(self) -> None:
        if self.handoff.stopped:  # discarded before it began: start no Ray execution
            return
        batches = self._batches
        try:
            for batch in skip_consumed(self._watched(batches), self._skip):
                self.handoff.put(self._collate(batch))
            if self.handoff.stopped:  # closed while Ray's output ended: no next epoch, no stats
                return
            self._ask_next_epoch()
            with contextlib.suppress(Exception):  # a summary is a nicety, never a failure
                self._summary = self._source.stats()
        finally:
            # Clean-up never replaces the stage's own error (it is what the trainer sees).
            with contextlib.suppress(Exception):
                batches.close()  # shuts Ray Data's streaming executor down
            self._ray.stop_prefetchers()
            if self.handoff.stopped:  # closed early: Ray's threads may still be inside Ray
                self._ray.join_executor()
                self._ray.join_threads()

    def _watched(self, batches: Any) -> Any:
        """``batches``, asking for the next epoch as each arrives (see ``start_next``)."""
        for batch in batches:
            if self.handoff.stopped:
                return
            if self._start_next is not None and (
                self._start_next_early or self._ray.execution_done()
            ):
                self._ask_next_epoch()
            yield batch

    def _ask_next_epoch(self) -> None:
        start = self._start_next
        if start is not None and not self.handoff.stopped and start():
            self._start_next = None

    def close(self, *, stalled: bool = False) -> None:
        handoff = self.handoff
        # Stopped first: a producer whose Ray output ends now must see the stop (no next
        # epoch started, no stats asked, Ray's threads waited for).
        handoff.stop(join_s=0)
        if not is_connected():  # after ray.shutdown() there is no execution left to stop
            return
        if stalled:
            # The producer is stuck inside Ray's iterator until the stage yields: shut
            # its executor down from here, which cancels the stalled tasks.
            self._ray.abort()
        # Wait for the producer to close Ray's iterator (its executor shuts down and
        # nothing touches Ray after a later ray.shutdown()).
        thread = handoff.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 if stalled else 30)
        if stalled:
            self._ray.stop_prefetchers()
