"""The pure arithmetic of elastic resume (no Ray)."""

from __future__ import annotations

import itertools

import pytest

from raydl._internal.epochs import elastic

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("total", "world", "batch", "drop_last"),
    list(itertools.product(range(0, 30), [1, 2, 3], [None, 1, 4], [False, True])),
)
def test_shares_give_equal_batch_counts_and_cover_everything(
    total: int, world: int, batch: int | None, drop_last: bool
) -> None:
    bounds = elastic.shares(total, world, batch, drop_last)
    assert len(bounds) == world
    counts = [elastic.batch_counts(stop - start, batch, drop_last) for start, stop in bounds]
    assert len(set(counts)) == 1  # DDP steps in lockstep
    items = list(range(total))
    dealt = [x for start, stop in bounds for x in elastic.take(items, start, stop)]
    if drop_last and batch is not None:
        assert len(set(dealt)) == len(dealt)  # only the tail no rank can batch is dropped
        assert total - len(dealt) < world * batch
    else:
        assert set(dealt) == set(items)  # nothing missing
        assert len(dealt) - total < world  # at most world - 1 repeats (torch pads likewise)
    slices_are_contiguous = all(b[0] == a[1] for a, b in itertools.pairwise(bounds))
    assert slices_are_contiguous


def test_shares_are_exact_when_batch_counts_allow() -> None:
    assert elastic.shares(11, 2, 4, False) == [(0, 6), (6, 11)]
    assert elastic.shares(9, 2, 4, False) == [(0, 5), (5, 10)]  # 5 + 4 would be 2 vs 1 batches
    assert elastic.shares(9, 2, 4, True) == [(0, 4), (4, 8)]


def test_rest_after_two_segments_is_exactly_what_no_rank_consumed() -> None:
    # epoch of 40 samples at 2 ranks, batches of 3: rank r holds samples r, r+2, ...
    first = [elastic.batched(list(range(r, 40, 2)), 3, False) for r in range(2)]
    consumed = [x for batches in first for batch in batches[:2] for x in batch]
    rest = elastic.remaining(first, 2)
    assert sorted(rest + consumed) == list(range(40))
    # resumed at 4 ranks (7 samples each), interrupted again after 1 batch each
    after = elastic.advance(rest, [(4, 1)], 3, False)
    per_rank = [
        elastic.batched(elastic.take(rest, a, b), 3, False)
        for a, b in elastic.shares(len(rest), 4, 3, False)
    ]
    second = [x for batches in per_rank for x in batches[0]]
    assert sorted(consumed + second + after) == list(range(40))
    assert elastic.my_share(after, 1, 0, 3, False) == after


def test_batched_and_take() -> None:
    assert elastic.batched([1, 2, 3, 4, 5], 2, False) == [[1, 2], [3, 4], [5]]
    assert elastic.batched([1, 2, 3, 4, 5], 2, True) == [[1, 2], [3, 4]]
    assert elastic.batched([1, 2], None, False) == [[1], [2]]
    assert elastic.take([1, 2, 3], 2, 5) == [3, 1, 2]
    assert elastic.take([], 0, 3) == []
