"""The producer of a globally shuffled direct epoch: a map phase, then local reduces.

The epoch's rows were grouped by output partition on raydl's actors (the map
phase, ``epochs/exchange.py``), left in Ray's object store: one object per run and
partition, or one per run that the partitions slice (``Piece``). The producer's
thread waits for that phase (``map_phase``: run it on the actors, or, on a rank
other than 0, fetch rank 0's result), then takes this consumer's rows of the epoch
(``rows``), partition by partition: it gets the partition's pieces (zero-copy for
numeric columns on the same node; an object several partitions slice is fetched
once and kept until the last of them), reduces them (``reduce``: concatenate and
permute), cuts batches, converts them and hands them over.

Large rows (images, ``ROW_BY_ROW_BYTES`` and up) are reduced a batch at a time,
each chunk ending where a batch ends: a batch is then its own array, not a view
that keeps its whole partition alive, so the trainer holds the batches in flight
rather than a partition per batch (a partition may be a few batches of images).

The reduce runs here rather than on an actor so that it never queues behind the
next epoch's map phase, which starts on the actors as soon as this epoch's map
phase is done (``start_next``): the actors read and process epoch e+1 while the
trainer drains epoch e. It costs the trainer's process one concatenation and one
gather per row, both memory copies.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from raydl._internal.epochs.exchange import Here, Piece, piece_bounds
from raydl._internal.stream.batching import ROW_BY_ROW_BYTES, Batch, row_bytes, row_count
from raydl._internal.stream.dispatch import Calls, RayCalls, ResultTimeout
from raydl._internal.stream.epoch_iterator import Producer
from raydl._internal.stream.handoff import SLICE_S, Handoff, Stopped


@dataclass
class Partitions:
    """An epoch's map phase, done: per output partition, its rows and its pieces.

    Attributes:
        counts: Rows of each output partition.
        pieces: Per partition, its non-empty piece of each run (a slice of a Ray
            object, in run order); an entry is dropped (``None``) once taken, so its
            memory can go.
        nbytes: The map phase's output, in bytes (``map_phase``'s ``whole`` rule).
        mapped_here: Runs mapped in the training process (their pieces slice a
            :class:`Here`) while Ray or raydl's actors started.
        whole: Whether the actors replied with whole runs (``map_phase``).
        actors: How many of raydl's actors the other runs went to (0: none).
    """

    counts: list[int]
    pieces: list[list[Piece] | None]
    nbytes: int = 0
    mapped_here: int = 0
    whole: bool = False
    actors: int = 0

    @classmethod
    def empty(cls, partitions: int) -> Partitions:
        """No run yet, ``partitions`` partitions."""
        return cls([0] * partitions, [[] for _ in range(partitions)])

    def add(self, counts: Sequence[int], refs: Sequence[Any], *, whole: bool, nbytes: int) -> None:
        """The next run's map output (runs come in order): its row count per partition, and
        its objects (``whole``: one, its rows sorted by partition; else one per partition)."""
        self.nbytes += nbytes
        for part, (lo, hi) in enumerate(piece_bounds(counts)):
            self.counts[part] += hi - lo
            pieces = self.pieces[part]
            if hi > lo and pieces is not None:  # an empty piece is never fetched
                pieces.append(Piece(refs[0], lo, hi) if whole else Piece(refs[part], 0, hi - lo))

    def take(self, part: int) -> list[Piece]:
        """Partition ``part``'s pieces, forgotten here."""
        pieces = self.pieces[part]
        assert pieces is not None, f"partition {part} was taken twice"
        self.pieces[part] = None
        return pieces


@dataclass(frozen=True)
class Slice:
    """Rows ``start:stop`` of output partition ``part``."""

    part: int
    start: int
    stop: int


def slices(counts: list[int], start: int, stop: int) -> list[Slice]:
    """The partition slices holding rows ``start:stop`` of the epoch (partitions in order).

    ``counts``: rows per partition.

    Example:
        >>> [(s.part, s.start, s.stop) for s in slices([3, 0, 4], 2, 6)]
        [(0, 2, 3), (2, 0, 3)]
    """
    out = []
    offset = 0
    for part, count in enumerate(counts):
        lo, hi = max(start, offset), min(stop, offset + count)
        if lo < hi:
            out.append(Slice(part, lo - offset, hi - offset))
        offset += count
    return out


class ExchangeProducer(Producer):
    """A globally shuffled epoch of a direct plan (see the module docstring).

    Args:
        map_phase: Runs (or fetches) the epoch's map phase on the producer's thread;
            given a stop check to call while it waits.
        rows: The epoch's total row count -> this consumer's rows ``(start, stop)``
            (a rank's share, less the rows a resume already consumed).
        reduce: ``(part, pieces, start, stop)`` -> rows ``start:stop`` of partition
            ``part`` in the epoch's order.
        cut: Blocks -> batches.
        batch_size: The rows of the batches ``cut`` makes (``None``: not known), for
            reducing large rows a batch at a time.
        collate: A batch -> what the trainer receives.
        prefetch: Batches handed over ahead of the trainer.
        start_next: Asked once the map phase is done (and again per partition while
            it answers ``False``: too soon) to start the next epoch.
        description: Names the epoch's work in its summary; ``{actors}`` in it stands
            for the number of raydl's actors the map phase used ("no" until it is done,
            or when every run was mapped here).
        name: The thread's name.
        calls: How results are fetched (:class:`RayCalls`; fakes in tests).
    """

    def __init__(
        self,
        *,
        map_phase: Callable[[Callable[[], None]], Partitions],
        rows: Callable[[int], tuple[int, int]],
        reduce: Callable[[int, list[Batch], int, int], Batch],
        cut: Callable[[Iterator[Batch]], Iterator[Any]],
        collate: Callable[[Any], Any],
        prefetch: int,
        start_next: Callable[[], bool] | None,
        description: str,
        name: str,
        batch_size: int | None = None,
        calls: Calls | None = None,
    ) -> None:
        self._map_phase = map_phase
        self._batch_size = batch_size
        self._rows = rows
        self._reduce = reduce
        self._cut = cut
        self._collate = collate
        self._start_next = start_next
        self._description = description
        self._calls = calls or RayCalls()
        self.partitions = 0  # partitions reduced so far (for the summary)
        self.map_s: float | None = None  # how long the map phase took (or was waited for)
        self._mapped = ""  # the summary's words on the map phase, once it is done
        self._actors = "no"  # the actors it used, once it is done
        self.handoff = Handoff(maxsize=max(1, prefetch))
        self.handoff.start(self._loop, name=name)

    def summary(self) -> str | None:
        waited = "" if self.map_s is None else f", map phase {self.map_s:.2f} s{self._mapped}"
        description = self._description.replace("{actors}", self._actors)
        return f"{description}: {self.partitions} partitions reduced{waited}"

    @staticmethod
    def _describe(partitions: Partitions) -> str:
        """The summary's words on a finished map phase: its layout, the runs mapped here."""
        words = ", whole runs" if partitions.whole else ""
        if partitions.mapped_here:
            words += (
                f", {partitions.mapped_here} runs mapped in the training process"
                " while raydl's actors started"
            )
        return words

    def _check_stop(self) -> None:
        if self.handoff.stopped:
            raise Stopped

    def _loop(self) -> None:
        began = time.perf_counter()
        partitions = self._map_phase(self._check_stop)
        self._mapped = self._describe(partitions)
        self._actors = str(partitions.actors or "no")
        self.map_s = time.perf_counter() - began
        self._ask_next()
        start, stop = self._rows(sum(partitions.counts))
        for batch in self._cut(self._blocks(partitions, start, stop)):
            self.handoff.put(self._collate(batch))

    def _ask_next(self) -> None:
        start = self._start_next
        if start is not None and not self.handoff.stopped and start():
            self._start_next = None

    def _blocks(self, partitions: Partitions, start: int, stop: int) -> Iterator[Batch]:
        wanted = slices(partitions.counts, start, stop)
        # An object several partitions slice (a whole run) is fetched once and kept
        # until its last partition here is reduced.
        uses = Counter(p.ref for s in wanted for p in partitions.pieces[s.part] or [])
        fetched: dict[Any, Batch] = {}
        done = 0  # rows of this consumer's share reduced so far
        for piece in wanted:
            pieces = partitions.take(piece.part)
            views = self._get(pieces, fetched)
            *ahead, (lo, hi) = self._chunks(views, done, piece.start, piece.stop)
            for first, last in ahead:  # large rows: a batch at a time, the pieces still needed
                yield self._reduce(piece.part, views, first, last)
            block = self._reduce(piece.part, views, lo, hi)
            done += piece.stop - piece.start
            del views
            for ref in (p.ref for p in pieces):
                uses[ref] -= 1
                if not uses[ref]:
                    # Its memory goes before the block's batches are handed over (the
                    # reference too: a Counter keeps its keys at zero).
                    del fetched[ref], uses[ref]
            del pieces
            self.partitions += 1
            self._ask_next()
            if row_count(block):
                yield block

    def _chunks(
        self, views: list[Batch], done: int, start: int, stop: int
    ) -> list[tuple[int, int]]:
        """Rows ``start:stop`` of a partition as the ranges to reduce at a time.

        One range, unless the rows are large and the batch size known: then ranges that
        end where this consumer's batches end (``done`` rows of its share precede
        ``start``), so that each batch is its own array.
        """
        size = self._batch_size
        sample = next((view for view in views if row_count(view)), None)
        if size is None or sample is None or _row_size(sample) < ROW_BY_ROW_BYTES:
            return [(start, stop)]
        bounds = [start, *range(start + size - done % size, stop, size), stop]
        return [(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]

    def _get(self, pieces: list[Piece], fetched: dict[Any, Batch]) -> list[Batch]:
        """The pieces' rows (views), fetching the objects not in ``fetched`` (and adding them)."""
        missing = list(dict.fromkeys(p.ref for p in pieces if p.ref not in fetched))
        fetched.update((ref, ref.rows) for ref in missing if isinstance(ref, Here))
        missing = [ref for ref in missing if not isinstance(ref, Here)]
        while missing:
            try:
                fetched.update(zip(missing, self._calls.get(missing, SLICE_S), strict=True))
                break
            except ResultTimeout:
                self._check_stop()
        return [
            {name: column[p.start : p.stop] for name, column in fetched[p.ref].items()}
            for p in pieces
        ]


def _row_size(batch: Batch) -> int:
    """Bytes of ``batch``'s first row: an object column counts what its first value holds
    (encoded images, ragged arrays), whose objects a view of the column keeps alive."""
    return sum(row_bytes(column) + _held(column) for column in batch.values())


def _held(column: np.ndarray) -> int:
    """Bytes the first value of an object column holds (0 for other columns)."""
    if column.dtype != object or not len(column):
        return 0
    value = column[0]
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    return len(value) if isinstance(value, (bytes, str)) else 0
