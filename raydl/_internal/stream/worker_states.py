"""Snapshots of ``Stateful`` workers: which worker states a resume restores, and from where.

torchdata's ``snapshot_every_n_steps``: the workers' own states (``workers/stateful.py``)
are captured every ``n`` batches of an epoch. A :class:`Snapshot` at step ``s``
holds each worker's state after its last batch before ``s``; a resume restores
those states on the matching workers, skips the first ``s`` batches without
loading them, and loads the batches from ``s`` to the position saved once more,
dropping them, so that every worker's state moves on exactly as it had.

Which requests carry a state: those in the last ``num_workers`` positions before
each multiple of ``n`` (torchdata's rule), so that each worker is asked about once
per ``n`` batches; with ``n=1``, every batch. A snapshot at ``s`` is complete when
every worker's last batch before ``s`` carried its state; :meth:`StateTracker.snapshot`
takes the latest complete one (else an earlier one, and the resume loads more
batches again). The bookkeeping is pure: the producers record what each reply
was (position, worker, state) and the loader asks for the snapshot of what the
trainer took.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

#: A reply that carried no state.
NO_STATE = object()


@dataclass(frozen=True)
class Snapshot:
    """Where a resume restores ``Stateful`` workers.

    Attributes:
        step: The batches of the epoch before it (skipped at a resume, never loaded).
        next_worker: The worker that loads the batch at ``step`` (round-robin goes on).
        states: Each worker's state then (``None``: nothing to restore).
    """

    step: int
    next_worker: int
    states: list[Any]

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form kept in a loader state (as JSON-able as the states)."""
        return {"step": self.step, "next_worker": self.next_worker, "states": list(self.states)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Snapshot:
        """The inverse of :meth:`to_dict`."""
        return cls(int(data["step"]), int(data["next_worker"]), list(data["states"]))


def asks_state(position: int, every: int | None, workers: int) -> bool:
    """Whether the request for the batch at ``position`` should carry its worker's state.

    Example:
        >>> [p for p in range(12) if asks_state(p, every=4, workers=2)]
        [2, 3, 6, 7, 10, 11]
    """
    if not every:
        return False
    return position % every + workers >= every


@dataclass
class StateTracker:
    """What one epoch's ``Stateful`` workers loaded, for the snapshots of a state.

    Written by the producer's fetch thread (:meth:`loaded`), read by the trainer's
    ``state_dict()`` (:meth:`snapshot`).

    Args:
        every: ``snapshot_every_n_steps`` (``None`` or ``0``: never; only ``base``).
        workers: The epoch's workers.
        base: Where the epoch's run started: its first batch's worker and the
            workers' states then (a fresh epoch: step 0), or ``None`` until the
            producer asked the workers.
        drop: Batches from ``base.step`` on that were delivered before a resume:
            loaded again and dropped.
    """

    every: int | None
    workers: int
    base: Snapshot | None = None
    drop: frozenset[int] = frozenset()
    _loaded_by: dict[int, int] = field(default_factory=dict)
    _states: dict[int, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def asks(self, position: int) -> bool:
        """Whether the request at ``position`` carries its worker's state."""
        return asks_state(position, self.every, self.workers)

    def loaded(self, position: int, worker: int, state: Any = NO_STATE) -> None:
        """Worker ``worker`` loaded the batch at ``position`` (its ``state`` after it, if asked)."""
        with self._lock:
            self._loaded_by[position] = worker
            if state is not NO_STATE:
                self._states[position] = state

    def snapshot(self, delivered: int) -> Snapshot | None:
        """The latest complete snapshot within the first ``delivered`` batches of the epoch."""
        base = self.base
        if base is None:
            return None
        with self._lock:
            loaded_by, states = dict(self._loaded_by), dict(self._states)
        last: dict[int, int] = {}  # worker -> its last position so far
        best = base
        for position in range(base.step, delivered):
            worker = loaded_by.get(position)
            if worker is None:
                return best  # not loaded by this run (cannot happen before `delivered`)
            last[worker] = position
            step = position + 1
            if self.every and step % self.every == 0 and all(p in states for p in last.values()):
                nxt = loaded_by.get(step, (worker + 1) % self.workers)
                merged = list(base.states)
                for each, p in last.items():
                    merged[each] = states[p]
                best = Snapshot(step, nxt, merged)
        return best
