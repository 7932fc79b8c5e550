"""``num_workers="auto"`` and ``prefetch_factor="auto"``: the control rule, without Ray.

:class:`AutoTuner` is fed, one call per batch, what the trainer waited inside
``next()`` for that batch and when it got it. Over windows of at least
:data:`WINDOW_BATCHES` batches and :data:`WINDOW_S` seconds it computes the stall
(waited / elapsed) and the rate (batches / s) and decides:

* **Starved** (stall above :data:`TARGET_STALL`) and fewer workers than the
  ceiling: ask for more. With ``k`` workers and stall ``s`` the loader delivers
  ``1 - s`` of what the trainer would take, so ``k / (1 - s)`` workers would keep
  up; the request is that, at least ``k + 1``, at most ``2 k`` and the ceiling
  (the budget). Nothing else is decided until the new workers are admitted (the
  fetch thread admits an actor only once it answers, so a worker importing torch
  never stalls a batch); the window then starts afresh.
* Starved at the workers' ceiling, with ``prefetch_factor="auto"``: one more
  batch in flight per worker (at most :data:`MAX_FACTOR`).
* **Each step is a trial.** One of the next :data:`TRIAL_WINDOWS` full windows
  keeps it when the rate rose by :data:`MIN_GAIN` or the stall fell to the target
  or to half of what it was; otherwise the step is undone and its value becomes the ceiling (more workers
  than cores, or a bottleneck in the trainer, gains nothing). Undone workers stay
  alive, idle (no requests); the pool never kills a worker it grew.
* Never fewer workers otherwise: no shrinking when the trainer is fed.

The first batch of each epoch is not measured (its wait is the pipeline's fill), nor the
gap before it; a window goes on across epochs, so short epochs add up.
The depth (batches requested and not yet taken by the trainer) is
``factor * workers``. Every decision is appended to :attr:`AutoTuner.changes`.

Threads: the fetch thread of the epoch that uses the pool calls every method;
``report()`` is also read by the trainer's thread (``loader.stats()``): it copies
plain values and the list of changes, which the fetch thread only appends to.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

#: The stall fraction above which the trainer counts as starved (the issue's target).
TARGET_STALL = 0.02
#: The fewest batches of one measurement window.
WINDOW_BATCHES = 8
#: The shortest measurement window, in seconds.
WINDOW_S = 0.25
#: The rise in rate that keeps a step (when the stall did not fall enough).
MIN_GAIN = 0.05
#: Windows a step gets to show a gain before it is undone (one noisy window must not undo it).
TRIAL_WINDOWS = 2
#: The most batches in flight per worker with ``prefetch_factor="auto"``.
MAX_FACTOR = 8


def worker_budget(cpus: float, cpus_per_worker: float, *, ranks: int = 0) -> int:
    """The ceiling of ``num_workers="auto"``: a share of ``cpus``, in workers.

    Args:
        cpus: The CPUs (the cluster's, or the ``cpu_budget`` option).
        cpus_per_worker: What one worker counts as (``worker_options["num_cpus"]``, or 1).
        ranks: Trainer processes sharing the cluster: each is left one CPU and gets an
            equal share of the rest. ``0``: ``cpus`` are this loader's alone (an
            explicit budget).

    Returns:
        At least 1.

    Example:
        >>> worker_budget(8, 1, ranks=1), worker_budget(2, 1, ranks=1)
        (7, 1)
        >>> worker_budget(18, 2, ranks=2)  # two ranks, two CPUs per worker
        4
    """
    per = cpus_per_worker if cpus_per_worker > 0 else 1.0
    share = (cpus - ranks) / ranks if ranks else cpus
    return max(1, math.floor(share / per + 1e-9))


@dataclass(frozen=True)
class Change:
    """One decision of the rule, as ``stats()["autotune"]["changes"]`` lists it."""

    epoch: int
    batch: int  # batches the trainer had taken in that epoch
    workers: int  # workers in use after the decision (wanted, for "grow")
    depth: int  # batches in flight or waiting, after the decision
    stall: float | None  # the window's stall fraction that led to it (None: admitted)
    rate: float | None  # the window's batches per second
    reason: str


@dataclass
class _Trial:
    knob: str  # "workers" or "factor"
    before: int
    rate: float
    stall: float
    windows: int = TRIAL_WINDOWS  # windows left to show a gain


class AutoTuner:
    """The rule's state for one pool of workers (see the module docstring).

    Args:
        budget: The most workers.
        workers: Workers at the start.
        factor: Batches in flight per worker at the start.
        auto_workers: Grow the workers (``num_workers="auto"``).
        auto_factor: Grow the factor (``prefetch_factor="auto"``).

    Example:
        >>> t = AutoTuner(budget=4, workers=1, factor=2, auto_workers=True, auto_factor=False)
        >>> for i in range(10):
        ...     t.observe(waited=0.1, at=0.1 * i)  # the trainer only waits
        >>> t.want  # two workers asked for; they count once admitted
        2
    """

    def __init__(
        self,
        *,
        budget: int,
        workers: int,
        factor: int,
        auto_workers: bool,
        auto_factor: bool,
    ) -> None:
        if budget < 1 or not 1 <= workers <= budget or factor < 1:
            raise ValueError(
                f"AutoTuner needs 1 <= workers <= budget and factor >= 1, got "
                f"workers={workers}, budget={budget}, factor={factor}"
            )
        self.budget = budget
        self.workers = workers  # in use: requests go round-robin over the first `workers`
        self.want = workers  # asked for; above `workers` while new ones start
        self.factor = factor
        self.auto_workers = auto_workers
        self.auto_factor = auto_factor
        self._workers_ceiling = budget if auto_workers else workers
        self._factor_ceiling = max(factor, MAX_FACTOR) if auto_factor else factor
        self._trial: _Trial | None = None
        self.changes: list[Change] = []
        self.epoch = 0
        self._batch = 0
        self._last: float | None = None  # when the last measured batch came (None: not yet)
        self._elapsed = self._waited = 0.0  # the window's, between measured batches
        self._n = 0

    @property
    def depth(self) -> int:
        """Batches requested and not yet taken by the trainer (``factor * workers``)."""
        return self.factor * self.workers

    @property
    def started(self) -> int:
        """Workers to keep started: those wanted, and one spare while the rule may grow.

        The spare imports torch and unpickles the dataset before it is needed, so
        the first step up is admitted at once; it gets requests only once wanted. A
        new pool starts only the workers in use (``workers``); the producer starts the
        spare once it dispatches to them: started together on 2 CPUs, where the
        trainer loads the first batches on one, two actors importing torch answered
        an epoch later than one does.
        """
        if self.workers < self._workers_ceiling:
            return min(self._workers_ceiling, max(self.want, self.workers + 1))
        return self.want

    @property
    def max_depth(self) -> int:
        """The deepest the rule can go: how far ahead the trainer draws from the sampler."""
        return self._factor_ceiling * (self.budget if self.auto_workers else self.workers)

    def start_epoch(self, epoch: int) -> None:
        """A new epoch uses the pool: its first batch is not measured.

        The window goes on across epochs (less the gap between them), so epochs
        shorter than a window still add up to decisions.
        """
        self.epoch = epoch
        self._batch = 0
        self._last = None

    def observe(self, *, waited: float, at: float) -> None:
        """The trainer waited ``waited`` s for a batch it got at time ``at`` (s, monotonic)."""
        self._batch += 1
        last, self._last = self._last, at
        if last is None:
            return
        self._elapsed += at - last
        self._waited += waited
        self._n += 1
        if self._n < WINDOW_BATCHES or self._elapsed < WINDOW_S:
            return
        elapsed = self._elapsed
        stall, rate = min(1.0, self._waited / elapsed), self._n / elapsed
        self._restart_window(at)
        self._decide(stall, rate)

    def admitted(self, workers: int, *, at: float) -> None:
        """The first ``workers`` actors of the pool answer: requests may go to them."""
        if workers <= self.workers:
            return
        self.workers = workers
        if workers >= self.want:
            self._restart_window(at)  # measure the new setting alone
            self._note("admitted", stall=None, rate=None)

    def report(self) -> dict[str, Any]:
        """What ``stats()["autotune"]`` shows: the setting now, the budget, every change."""
        return {
            "workers": self.workers,
            "factor": self.factor,
            "depth": self.depth,
            "budget": self.budget,
            "changes": [asdict(c) for c in list(self.changes)],
        }

    # -- the rule ---------------------------------------------------------------------

    def _restart_window(self, at: float) -> None:
        self._last, self._elapsed, self._waited, self._n = at, 0.0, 0.0, 0

    def _decide(self, stall: float, rate: float) -> None:
        if self.want > self.workers:
            return  # new workers are starting: judge them once they are in
        trial, self._trial = self._trial, None
        if trial is not None:
            if rate >= trial.rate * (1 + MIN_GAIN) or stall <= max(TARGET_STALL, trial.stall / 2):
                self._note("kept", stall, rate)
            elif trial.windows > 1:
                trial.windows -= 1
                self._trial = trial  # one more window to show it
                return
            else:
                self._undo(trial)
                self._note(f"no gain: back to {trial.knob} {trial.before}", stall, rate)
                return
        if stall <= TARGET_STALL:
            return
        if self.workers < self._workers_ceiling:
            k = self.workers
            enough = 2 * k if stall >= 0.5 else math.ceil(k / (1 - stall) - 1e-6)
            self.want = min(self._workers_ceiling, 2 * k, max(k + 1, enough))
            self._trial = _Trial("workers", k, rate, stall)
            self._note(f"starved: grow to {self.want} workers", stall, rate, workers=self.want)
        elif self.factor < self._factor_ceiling:
            self._trial = _Trial("factor", self.factor, rate, stall)
            self.factor += 1
            self._note(f"starved: factor {self.factor}", stall, rate)

    def _undo(self, trial: _Trial) -> None:
        if trial.knob == "workers":
            self.workers = self.want = self._workers_ceiling = trial.before
        else:
            self.factor = self._factor_ceiling = trial.before

    def _note(
        self, reason: str, stall: float | None, rate: float | None, workers: int | None = None
    ) -> None:
        workers = self.workers if workers is None else workers
        self.changes.append(
            Change(
                epoch=self.epoch,
                batch=self._batch,
                workers=workers,
                depth=self.factor * workers,
                stall=None if stall is None else round(stall, 4),
                rate=None if rate is None else round(rate, 2),
                reason=reason,
            )
        )
