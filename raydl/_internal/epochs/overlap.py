"""Start the next epoch's Ray Data pipeline before the current one drains.

A Ray Data execution has a fixed start-up cost (planning, scheduling the first
read tasks) and, with a shuffle, an all-to-all barrier: nothing comes out
until every input block went through the map phase. Paid at every epoch
boundary, that is a stall of the training loop. Since an epoch's plan is a pure
function of (seed, epoch), the loader can build and start epoch ``e + 1`` while
the trainer still consumes epoch ``e``, and hand it over at the next ``iter()``.

:class:`NextEpoch` holds at most one such early iterator. It is built on a
short-lived named thread (building may call the user's ``PerEpoch`` function,
which may list files), and anything that makes it stale (``set_epoch`` to
another epoch, ``load_state_dict``, ``close()``) discards it: its producer
thread stops and Ray's executor shuts down, so nothing leaks.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import weakref
from collections.abc import Callable

from raydl._internal.epochs.record import EpochStart
from raydl._internal.stream.handoff import Handoff, Stopped

logger = logging.getLogger(__name__)

_live: weakref.WeakSet[NextEpoch] = weakref.WeakSet()
_exit_hook_registered = False


def discard_all() -> None:
    """At exit, before Ray's own shutdown hook: stop every early epoch cleanly."""
    for each in list(_live):
        each.discard()


def _register_exit_hook() -> None:
    # atexit runs hooks last-in first-out; registered after ray.init(), this one
    # runs before Ray disconnects, so no executor thread dies mid-step at exit.
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(discard_all)
        _exit_hook_registered = True


class NextEpoch:
    """At most one epoch started ahead of its ``iter()`` (an :class:`EpochStart`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch: int | None = None
        self._handoff: Handoff | None = None

    @property
    def epoch(self) -> int | None:
        """The epoch started ahead, if any."""
        return self._epoch

    def start(self, epoch: int, build: Callable[[], EpochStart]) -> bool:
        """Build epoch ``epoch`` in the background; ``False`` if one is pending."""
        with self._lock:
            if self._epoch is not None:
                return False
            self._epoch = epoch
            _live.add(self)
            _register_exit_hook()
            handoff = self._handoff = Handoff(maxsize=1)

        def body() -> None:
            try:
                started = build()
            except Exception:
                # The regular iter() builds it again and raises the error where the user sees it.
                logger.debug("starting the next epoch early failed", exc_info=True)
                return
            try:
                handoff.put(started)
            except Stopped:
                started.close()  # discarded while it was being built
                raise

        handoff.start(body, name=f"raydl-epoch-{epoch}-prestart")
        return True

    def take(self, epoch: int) -> EpochStart | None:
        """The early epoch if it is ``epoch`` (else it is discarded); ``None`` if none."""
        with self._lock:
            handoff, started_epoch = self._handoff, self._epoch
            self._handoff = self._epoch = None
        if handoff is None:
            return None
        builder = handoff.thread
        here = builder is threading.current_thread()
        if started_epoch != epoch or here:
            # Not wanted: stopped, a build still running closes what it builds, and one
            # already handed over is taken here and closed. The build is waited for (it
            # must not call Ray after a ray.shutdown() that follows), unless this is the
            # build's own thread (a loader garbage-collected there).
            handoff.stop(join_s=0)
            if builder is not None and not here:
                builder.join()
            with contextlib.suppress(StopIteration):
                handoff.take(0).close()
            return None
        try:
            started: EpochStart = handoff.take(0)
        except StopIteration:  # the build failed: iter() builds the epoch itself
            return None
        return started

    def discard(self) -> None:
        """Stop the early epoch, if any."""
        with contextlib.suppress(Exception):
            self.take(-1)  # no epoch is -1: whatever was started is closed
