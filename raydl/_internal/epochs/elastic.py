"""Elastic resume: the rest of an interrupted epoch, re-dealt to a new number of ranks.

An epoch's order at world size ``W`` is a pure function of (seed, epoch, W):
rank ``r`` receives a known sequence of batches. A state saved after every rank
consumed ``k`` batches (DDP ranks step in lockstep, and raydl gives every rank
the same batch count) therefore pins down exactly which samples are left:
rank ``r``'s batches from ``k`` on. :func:`remaining` lays them out as one
sequence (rank by rank), and :func:`shares` deals that sequence to ``W'`` ranks
in contiguous slices with equal batch counts.

A resumed epoch may be interrupted again; its state then records every segment
``[(W1, k1), (W2, k2), ...]`` and the rest is derived segment after segment.

Everything here is pure (no Ray, no torch), so it is unit-tested directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def batch_counts(count: int, batch_size: int | None, drop_last: bool) -> int:
    """Batches that ``count`` samples make."""
    if batch_size is None:
        return count
    return count // batch_size if drop_last else -(-count // batch_size)


def shares(
    total: int, world: int, batch_size: int | None, drop_last: bool
) -> list[tuple[int, int]]:
    """Per rank, the ``[start, stop)`` slice of ``total`` samples it gets; stop may pass total.

    Every rank gets the same number of batches (DDP steps in lockstep). When
    the samples cannot be dealt that way exactly once, the slices wrap around to
    the start (a few samples repeat, as torch's ``DistributedSampler`` pads), or,
    with ``drop_last``, the tail that makes no full batch on every rank is
    dropped, as ``drop_last`` drops it in an uninterrupted epoch.

    Example:
        >>> shares(11, 2, 4, False)  # 6 + 5 samples: 2 batches each, exactly once
        [(0, 6), (6, 11)]
        >>> shares(9, 2, 4, False)  # 5 + 4 would be 2 and 1 batches: pad one sample
        [(0, 5), (5, 10)]
    """
    if world < 1:
        raise ValueError(f"world size should be positive, got {world!r}")
    if drop_last and batch_size is not None:
        per_rank = (total // world) // batch_size * batch_size
        return [(r * per_rank, (r + 1) * per_rank) for r in range(world)]
    low, extra = divmod(total, world)
    counts = [low + (1 if r < extra else 0) for r in range(world)]
    if len({batch_counts(c, batch_size, drop_last) for c in counts}) > 1:
        counts = [low + 1] * world  # pad: the last ranks wrap around to the start
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


def take(items: Sequence[T], start: int, stop: int) -> list[T]:
    """``items[start:stop]``, wrapping around past the end (padding)."""
    if not items:
        return []
    return [items[i % len(items)] for i in range(start, stop)]


def batched(items: Sequence[T], batch_size: int | None, drop_last: bool) -> list[list[T]]:
    """``items`` cut into batches (``batch_size=None``: one item per batch)."""
    size = batch_size or 1
    batches = [list(items[i : i + size]) for i in range(0, len(items), size)]
    if drop_last and batches and len(batches[-1]) < size:
        batches.pop()
    return batches


def remaining(per_rank_batches: Sequence[Sequence[Sequence[T]]], consumed: int) -> list[T]:
    """The samples of every rank's batches from ``consumed`` on, rank by rank."""
    return [item for batches in per_rank_batches for batch in batches[consumed:] for item in batch]


def advance(
    rest: Sequence[T],
    segments: Sequence[tuple[int, int]],
    batch_size: int | None,
    drop_last: bool,
) -> list[T]:
    """What is left of ``rest`` after resumed segments ``[(W2, k2), (W3, k3), ...]``.

    Each segment dealt the rest to ``Wi`` ranks with :func:`shares` and every
    rank consumed ``ki`` batches of its slice before the next interruption.
    """
    left = list(rest)
    for world, consumed in segments:
        per_rank = [
            batched(take(left, start, stop), batch_size, drop_last)
            for start, stop in shares(len(left), world, batch_size, drop_last)
        ]
        left = remaining(per_rank, consumed)
    return left


def my_share(
    rest: Sequence[T], world: int, rank: int, batch_size: int | None, drop_last: bool
) -> list[T]:
    """The slice of ``rest`` that ``rank`` of ``world`` delivers in a resumed epoch."""
    start, stop = shares(len(rest), world, batch_size, drop_last)[rank]
    return take(rest, start, stop)
