"""A torch dataset's first pool of actors, and the trainer's stand-ins for its workers.

While the loader's first actors start (Ray's own start, their processes, ``import
torch``), a map-style epoch loads its first batches in the trainer, each as the
worker torch would have used (:mod:`~raydl._internal.workers.emulated`). The stand-ins
and that pool's actors must start from the same dataset, so both unpickle the same
bytes: whichever comes first (the loader's background start building the pool, or
the first ``iter()`` making stand-ins) pickles it, under :class:`FirstPool`'s lock,
and the other takes those bytes. Later pools pickle their own, as before (their
actors start while Ray is already up: nothing is loaded in the trainer for them).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from raydl._internal.stream.dispatch import FIRST_READY_WAIT_S, ActorStart, RayCalls
from raydl._internal.workers.emulated import MAX_COPIED_BYTES, EmulatedWorkers
from raydl._internal.workers.pool import WorkerPool
from raydl._internal.workers.worker import RngStates, WorkerSpec


class FirstPool:
    """The first pool's payload, whether pools' actors answered, and persistent stand-ins.

    Args:
        pickle: Pickles the dataset's payload (``workers/payload.py``), as a pool would.
    """

    def __init__(self, pickle: Callable[[], bytes]) -> None:
        self._pickle = pickle
        self._lock = threading.Lock()  # the background start's thread makes pools too
        self._payload: bytes | None = None
        self._pool: weakref.ref[WorkerPool] | None = None
        self._starts: weakref.WeakKeyDictionary[WorkerPool, ActorStart] = (
            weakref.WeakKeyDictionary()
        )
        self._persistent: EmulatedWorkers | None = None  # kept until its actors take over

    def new_pool(self, make: Callable[[bytes | None], WorkerPool], num_workers: int) -> WorkerPool:
        """``make(payload)``: the first pool gets the shared bytes, later ones ``None``."""
        with self._lock:
            later = self._pool is not None
        if later:
            return make(None)  # pickles its own, outside the lock
        with self._lock:
            if self._pool is not None:  # made meanwhile by another thread
                return make(None)
            if self._payload is None:
                self._payload = self._pickle()
            payload = self._payload
            if len(payload) * num_workers > MAX_COPIED_BYTES:
                self._payload = None  # too large to copy here: no stand-ins will load it
            pool = make(payload)
            self._pool = weakref.ref(pool)
            return pool

    def actor_start(self, pool: WorkerPool) -> ActorStart:
        """Whether ``pool``'s actors answered ``ready`` (asked once per pool)."""
        with self._lock:
            start = self._starts.get(pool)
            if start is None:
                start = self._starts[pool] = ActorStart("ready")
            return start

    def stand_ins(
        self, pool: WorkerPool | None, spec: WorkerSpec, *, persistent: bool
    ) -> EmulatedWorkers | None:
        """The trainer's stand-ins for ``pool``'s workers (``None``: the pool to come), if useful.

        ``None`` when its actors are up, when the pool is not the first (only the
        first start is loaded around), or when the dataset is too large to copy here
        (:data:`~raydl._internal.workers.emulated.MAX_COPIED_BYTES`). A persistent
        pool keeps its stand-ins, and their RNG states, until its actors take over.
        """
        if persistent and self._persistent is not None:
            return None if self._persistent.handed_over else self._persistent
        first = self._pool() if self._pool is not None else None
        if pool is None and self._pool is not None:
            return None  # made already (the start is handing it over): the epoch waits for it
        if pool is not None and (
            pool is not first
            or not self.actor_start(pool).starting(pool, RayCalls(), first_wait=FIRST_READY_WAIT_S)
        ):
            return None
        with self._lock:
            if self._payload is None and self._pool is None:
                try:
                    self._payload = self._pickle()
                except Exception:  # raised as the pool's own error, once the epoch waits for it
                    return None
            payload = self._payload
        if payload is None or len(payload) * spec.num_workers > MAX_COPIED_BYTES:
            return None
        stand_ins = EmulatedWorkers(payload, spec)
        if persistent:
            self._persistent = stand_ins
        return stand_ins

    def standing_in(self) -> dict[int, RngStates]:
        """The RNG states of the persistent pool's workers the trainer still stands in for.

        Until the actors take over, a worker that loaded here goes on from these
        states, not from its actor's.
        """
        stand_ins = self._persistent
        if stand_ins is None or stand_ins.handed_over:
            return {}
        return stand_ins.rng_states()

    def forget_stand_ins(self) -> None:
        """The loader stopped its actors: the next persistent pool's workers are new."""
        self._persistent = None
