"""Dealing a streaming epoch's rows to ranks as they are loaded: a pure rule.

Under several ranks, a streaming direct epoch (``shuffle_mode="files"`` or no
shuffle) is loaded on rank 0's actors run after run, in run order, and its rows
are dealt to the ranks as the runs arrive (``deal_ranks.py``). The rule, with
``T`` the rows loaded so far and ``w`` the world size:

* each rank's *allowance* is ``T // w``;
* the rows not yet dealt wait in a queue, in run order; after each run, ranks
  0, 1, ..., ``w - 1`` in turn take rows from the head of the queue up to their
  allowance (a run's rows may go to several ranks, as row ranges of it).

So at every moment each rank holds ``T // w`` rows (every rank the same), at
the epoch's end ``T_total // w``: equal batch counts on every rank, and the
last ``T_total % w`` rows (at most ``w - 1``) are left out, whatever filters did
to the row count. The deal is a pure function of the runs' row counts and the
world size, not of timing, so a rerun (and an elastic resume, which loads the
runs again) deals the same rows to the same ranks in the same order.

Example:
    >>> dealer = Dealer(2)
    >>> [(d.rank, d.run, d.start, d.stop) for d in dealer.add(5)]
    [(0, 0, 0, 2), (1, 0, 2, 4)]
    >>> [(d.rank, d.run, d.start, d.stop) for d in dealer.add(3)]
    [(0, 0, 4, 5), (0, 1, 0, 1), (1, 1, 1, 3)]
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Deal:
    """Rows ``start:stop`` of run ``run`` (its rows after every stage) go to rank ``rank``."""

    rank: int
    run: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


class Dealer:
    """The deal of one epoch, run by run (see the module docstring)."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size!r}")
        self.world_size = world_size
        self.loaded = 0  # T: rows of the runs added so far
        self.given = [0] * world_size  # rows dealt to each rank so far
        self._runs = 0
        self._waiting: deque[list[int]] = deque()  # [run, start, stop] not dealt yet

    def add(self, rows: int) -> list[Deal]:
        """The next run (in run order) has ``rows`` rows: the deals it makes possible."""
        if rows < 0:
            raise ValueError(f"a run has at least 0 rows, got {rows!r}")
        run, self._runs = self._runs, self._runs + 1
        self.loaded += rows
        if rows:
            self._waiting.append([run, 0, rows])
        allowance = self.loaded // self.world_size
        deals = []
        for rank in range(self.world_size):
            while self.given[rank] < allowance:
                head = self._waiting[0]
                take = min(allowance - self.given[rank], head[2] - head[1])
                deals.append(Deal(rank, head[0], head[1], head[1] + take))
                self.given[rank] += take
                head[1] += take
                if head[1] == head[2]:
                    self._waiting.popleft()
        return deals

    @property
    def first_waiting(self) -> int:
        """The first run with rows not dealt yet (the runs before it are dealt in full)."""
        return self._waiting[0][0] if self._waiting else self._runs

    @property
    def left_out(self) -> int:
        """Rows not dealt (so far; at the epoch's end: the rows left out, ``< world_size``)."""
        return self.loaded - sum(self.given)


def deal(counts: Sequence[int], world_size: int) -> list[list[Deal]]:
    """Per rank, its deals of an epoch whose runs have ``counts`` rows, in order.

    Example:
        >>> [[(d.run, d.start, d.stop) for d in mine] for mine in deal([3, 0, 4], 2)]
        [[(0, 0, 1), (0, 2, 3), (2, 0, 1)], [(0, 1, 2), (2, 1, 3)]]
    """
    dealer = Dealer(world_size)
    per_rank: list[list[Deal]] = [[] for _ in range(world_size)]
    for rows in counts:
        for each in dealer.add(rows):
            per_rank[each.rank].append(each)
    return per_rank
