"""A direct plan's epoch loaded in this process, run after run (elastic resume).

The same runs, in the same order, give the same blocks the actors gave
(:mod:`~raydl._internal.epochs.direct`: a run is a pure function of its files).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from raydl._internal.epochs.deal import deal
from raydl._internal.epochs.direct import DirectPlan
from raydl._internal.epochs.exchange import shares as exchange_shares
from raydl._internal.stream.batching import Batch, concat, row_count


class LocalRuns:
    """An epoch of a :class:`DirectPlan` loaded in this process, run after run.

    Stands in for a Ray Data source where a stream of blocks is re-run to rebuild
    an interrupted epoch (elastic resume): the same runs, in the same order (and
    through the same exchange, for a global shuffle), give the same blocks the
    actors gave. One process does the whole rest of the epoch: an elastic resume
    of a large epoch takes that long on rank 0.
    """

    def __init__(self, plan: DirectPlan, context: Any) -> None:
        self._work = plan.work(context)
        self._runs = plan.runs()

    def iter_batches(self, **_: Any) -> Iterator[dict[str, np.ndarray]]:
        """The epoch's blocks as numpy batches (Ray's ``batch_size=None`` iteration)."""
        exchange = self._work.exchange
        if exchange is None:
            for run in self._runs:
                yield from self._work.load(run, own_context=False)
            return
        pieces = [
            exchange.split(index, self._work.load(run, own_context=False))[1]
            for index, run in enumerate(self._runs)
        ]
        for part in range(exchange.partitions):
            block = exchange.reduce(part, [run_pieces[part] for run_pieces in pieces])
            if row_count(block):
                yield block

    def dealt(self, world_size: int) -> list[LocalBlocks]:
        """The epoch's blocks as ``world_size`` ranks were dealt them (``deal.py``), per rank.

        The same runs loaded the same way and dealt by the same rule give each rank
        the blocks (row ranges of the runs' batches) it had, in its order.
        """
        # Here, not at the top: the actors import this module, and the producers' modules import torch.
        from raydl._internal.stream.deal_producers import dealt_blocks

        loaded = [self._work.load(run, own_context=False) for run in self._runs]
        counts = [[row_count(batch) for batch in batches] for batches in loaded]
        return [
            LocalBlocks(
                [
                    piece
                    for each in mine
                    for piece in dealt_blocks(
                        loaded[each.run], counts[each.run], each.start, each.stop
                    )
                ]
            )
            for mine in deal([sum(c) for c in counts], world_size)
        ]

    def shares(self, world_size: int) -> list[LocalRows]:
        """The epoch's rows as ``world_size`` ranks had them (``exchange.shares``)."""
        whole = concat(list(self.iter_batches()))
        return [
            LocalRows({name: column[start:stop] for name, column in whole.items()})
            for start, stop in exchange_shares(row_count(whole), world_size)
        ]


class LocalBlocks:
    """One rank's blocks of a dealt :class:`LocalRuns` epoch, as a source of them."""

    def __init__(self, blocks: list[Batch]) -> None:
        self._blocks = blocks

    def iter_batches(self, **_: Any) -> Iterator[Batch]:
        yield from self._blocks


class LocalRows:
    """One rank's rows of a :class:`LocalRuns` epoch, as a source of one block."""

    def __init__(self, rows: dict[str, np.ndarray]) -> None:
        self._rows = rows

    def iter_batches(self, **_: Any) -> Iterator[dict[str, np.ndarray]]:
        if row_count(self._rows):
            yield self._rows
