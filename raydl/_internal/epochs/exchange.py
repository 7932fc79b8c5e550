"""The per-epoch global shuffle on raydl's own actors: a two-phase exchange.

An epoch of a direct plan (``direct.py``: a file read and ``map_batches``
functions) is cut into runs of files. With ``shuffle_mode="global"`` every row
of the epoch lands at a place drawn from (seed, epoch) over the whole dataset:

* **map phase**: an actor loads one run (read and stages, as in the streaming
  mode) and draws, for each of the run's rows, one of :attr:`Exchange.partitions`
  output partitions, independently and uniformly (a generator seeded from the
  epoch's seed and the run's index). It returns the run's rows sorted by
  partition, as one object per partition or as one object the partitions slice
  (:class:`Piece`), plus the count per partition; the objects stay in Ray's
  object store, owned by the trainer's process;
* **reduce phase**: partition ``p``'s pieces (one per run, in run order) are
  concatenated in the trainer's process and permuted by a generator seeded from
  the epoch's seed and ``p``; the epoch is partition 0, then 1, ..., cut into
  batches.

Each row picks its partition uniformly and independently, and each partition is
permuted uniformly, so for every vector of partition sizes every ordering of the
rows is equally likely: the epoch's order is a uniform random permutation (the
same argument as for Ray Data's ``random_shuffle``, whose map phase splits blocks
at random). It is a pure function of (seed, epoch) and the rows each run yields,
not of the cluster's size or of timing.

Nothing comes out of an epoch before its whole map phase has run (every
partition may hold rows of the last run). The next epoch's map phase starts while
the current one drains (``DirectProducer``'s ``start_next``), so a warm epoch's
first batch does not wait for it.

Everything here is a pure function of its arguments (tests run it without Ray);
the actors call :meth:`Exchange.split` and :meth:`Exchange.reduce`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from raydl._internal.stream.batching import Batch, concat, gather, row_count

_ASSIGN = 0
_PERMUTE = 1


def partition_count(runs: int) -> int:
    """Output partitions of an epoch cut into ``runs`` runs: as many (a reduce is the size of a run)."""
    return max(1, runs)


@functools.lru_cache(maxsize=2)  # the partition being reduced (and the one before)
def _permutation(seed: int, part: int, rows: int) -> np.ndarray:
    order = np.random.default_rng([seed, _PERMUTE, part]).permutation(rows)
    order.flags.writeable = False  # shared by every caller
    return order


@dataclass(frozen=True)
class Exchange:
    """The global shuffle of one epoch: its seed and its number of output partitions."""

    seed: int
    partitions: int

    def assign(self, run: int, rows: int) -> np.ndarray:
        """The output partition of each of run ``run``'s ``rows`` rows (uniform, independent)."""
        rng = np.random.default_rng([self.seed, _ASSIGN, run])
        return rng.integers(0, self.partitions, size=rows)

    def permutation(self, part: int, rows: int) -> np.ndarray:
        """The order of partition ``part``'s ``rows`` rows (its pieces concatenated in run order).

        Read-only, and kept for the next call: a partition of large rows is reduced a
        batch at a time (``ExchangeProducer._chunks``), each chunk a slice of this.
        """
        return _permutation(self.seed, part, rows)

    def group(self, run: int, blocks: Sequence[Batch]) -> tuple[list[int], Batch]:
        """Run ``run``'s rows (its loaded blocks) sorted by output partition.

        Returns:
            The row count of each partition, and one copy of the run's rows with
            partition 0's first, then partition 1's, ... (within a partition, in the
            run's order).
        """
        rows = concat(blocks)
        parts = self.assign(run, row_count(rows))
        # The same stable order, sorted as the narrowest integer that holds a partition:
        # numpy radix-sorts 8- and 16-bit integers (a run of 312k rows: 9.3 -> 2.5 ms).
        order = np.argsort(parts.astype(np.min_scalar_type(self.partitions - 1)), kind="stable")
        counts = np.bincount(parts, minlength=self.partitions)
        return [int(c) for c in counts], {name: column[order] for name, column in rows.items()}

    def split(self, run: int, blocks: Sequence[Batch]) -> tuple[list[int], list[Batch]]:
        """Run ``run``'s rows grouped by output partition: one piece per partition.

        Returns:
            The row count of each partition's piece, and the pieces (views of
            :meth:`group`'s copy; row order within a piece is the run's).
        """
        counts, grouped = self.group(run, blocks)
        return counts, [
            {name: column[lo:hi] for name, column in grouped.items()}
            for lo, hi in piece_bounds(counts)
        ]

    def reduce(
        self, part: int, pieces: Sequence[Batch], start: int = 0, stop: int | None = None
    ) -> Batch:
        """Rows ``start:stop`` of partition ``part`` in the epoch's order.

        ``pieces``: the partition's piece of every run, in run order. The rows are
        gathered from the pieces (``batching.gather``: the pieces concatenated, then one
        fancy index per column); each column takes the dtype concatenation gives.
        """
        pieces = [piece for piece in pieces if row_count(piece)]
        sizes = [row_count(piece) for piece in pieces]
        order = self.permutation(part, sum(sizes))[start:stop]
        if not pieces:
            return {}
        return gather(pieces, np.cumsum([0, *sizes]), order)


class Piece(NamedTuple):
    """Rows ``start:stop`` of the Ray object ``ref``: one run's rows of one partition.

    ``ref`` is a :class:`Here` for a run mapped in the training process.

    Here, not with the producer: the ranks' board (``board.py``), which imports no
    torch, unpickles pieces.
    """

    ref: Any
    start: int
    stop: int


class Here:
    """A run's grouped rows held in the training process, in place of a Ray object.

    The runs of an epoch mapped while Ray or raydl's actors still start
    (``direct.map_phase``); compared by identity, as object references are.
    """

    __slots__ = ("rows",)

    def __init__(self, rows: Batch) -> None:
        self.rows = rows


def piece_bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Where each partition's rows lie in a run grouped by :meth:`Exchange.group`.

    Example:
        >>> piece_bounds([2, 0, 3])
        [(0, 2), (2, 2), (2, 5)]
    """
    ends = np.cumsum(counts).tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def shares(total: int, world_size: int) -> list[tuple[int, int]]:
    """Each rank's rows of an epoch of ``total`` rows: contiguous and equal.

    At most ``world_size - 1`` rows are left out (the epoch's last).

    Example:
        >>> shares(10, 3)
        [(0, 3), (3, 6), (6, 9)]
    """
    each = total // world_size
    return [(rank * each, (rank + 1) * each) for rank in range(world_size)]
