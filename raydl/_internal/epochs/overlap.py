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
from typing import Any

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
    """At most one epoch iterator started ahead of its ``iter()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch: int | None = None
        self._thread: threading.Thread | None = None
        self._iterator: Any = None

    @property
    def epoch(self) -> int | None:
        """The epoch started ahead, if any."""
        return self._epoch

    def start(self, epoch: int, build: Callable[[], Any]) -> bool:
        """Build epoch ``epoch``'s iterator in the background; ``False`` if one is pending."""
        with self._lock:
            if self._epoch is not None:
                return False
            self._epoch = epoch
            _live.add(self)
            _register_exit_hook()
            self._thread = threading.Thread(
                target=self._build, args=(build,), name=f"raydl-epoch-{epoch}-prestart", daemon=True
            )
            self._thread.start()
            return True

    def _build(self, build: Callable[[], Any]) -> None:
        try:
            iterator = build()
        except Exception:
            # The regular iter() builds it again and raises the error where the user sees it.
            logger.debug("starting the next epoch early failed", exc_info=True)
            return
        with self._lock:
            self._iterator = iterator

    def take(self, epoch: int) -> Any:
        """The early iterator if it is for ``epoch`` (else it is discarded); ``None`` if none."""
        thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            iterator, started = self._iterator, self._epoch
            self._iterator = self._epoch = self._thread = None
        if iterator is not None and started != epoch:
            iterator.close()
            return None
        return iterator

    def discard(self) -> None:
        """Stop the early iterator, if any."""
        with contextlib.suppress(Exception):
            self.take(-1)  # no epoch is -1: whatever was started is closed
