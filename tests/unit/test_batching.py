"""raydl's own batching of Ray Data blocks (no Ray: plain numpy blocks)."""

from __future__ import annotations

import numpy as np
import pytest

from raydl._internal.batching import rebatch, shuffle_rebatch


def _blocks(sizes: list[int]) -> list[dict[str, np.ndarray]]:
    out, start = [], 0
    for size in sizes:
        ids = np.arange(start, start + size)
        out.append({"id": ids, "x": np.stack([ids, -ids], axis=1).astype(np.float32)})
        start += size
    return out


SIZES = [[0], [5], [3, 0, 4, 9, 1, 1, 1, 20, 2], [7] * 6, [1] * 30, [100]]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("batch_size", [1, 4, 7, 64])
@pytest.mark.parametrize("drop_last", [False, True])
def test_rebatch_is_contiguous_rows_across_blocks(
    sizes: list[int], batch_size: int, drop_last: bool
) -> None:
    total = sum(sizes)
    batches = list(rebatch(_blocks(sizes), batch_size, drop_last))
    expected = [
        list(range(s, min(s + batch_size, total)))
        for s in range(0, total, batch_size)
        if not drop_last or s + batch_size <= total
    ]
    assert [b["id"].tolist() for b in batches] == expected
    for batch in batches:  # every column cut the same way
        assert batch["x"][:, 0].tolist() == batch["id"].tolist()


@pytest.mark.timeout(10)
def test_rebatch_hands_out_views_of_a_block_where_it_can() -> None:
    block = _blocks([10])[0]
    first, second, last = rebatch([block], 4, drop_last=False)
    assert np.shares_memory(first["id"], block["id"]) and np.shares_memory(second["x"], block["x"])
    assert last["id"].tolist() == [8, 9]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("batch_size", [1, 4, 7])
@pytest.mark.parametrize("buffer", [1, 10, 1000])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffle_rebatch_keeps_every_row_once_and_the_batch_count(
    sizes: list[int], batch_size: int, buffer: int, drop_last: bool
) -> None:
    total = sum(sizes)
    batches = list(shuffle_rebatch(_blocks(sizes), batch_size, drop_last, buffer, seed=3))
    plain = list(rebatch(_blocks(sizes), batch_size, drop_last))
    assert [len(b["id"]) for b in batches] == [len(b["id"]) for b in plain]
    ids = [i for b in batches for i in b["id"].tolist()]
    if drop_last:
        assert len(set(ids)) == len(ids) == total - total % batch_size
    else:
        assert sorted(ids) == list(range(total))
    for batch in batches:  # rows stay whole
        assert batch["x"][:, 0].tolist() == batch["id"].tolist()


@pytest.mark.timeout(10)
def test_shuffle_rebatch_is_a_pure_function_of_the_seed() -> None:
    def order(seed: int | None) -> list[int]:
        batches = shuffle_rebatch(_blocks([50, 30, 70, 50]), 16, False, 64, seed)
        return [i for b in batches for i in b["id"].tolist()]

    assert order(7) == order(7)
    assert order(7) != order(8)
    assert order(7) != list(range(200))


@pytest.mark.timeout(10)
def test_shuffle_rebatch_mixes_rows_from_beyond_one_block() -> None:
    """With a buffer larger than a block, the first batch draws from several blocks."""
    first = next(shuffle_rebatch(_blocks([10] * 20), 10, False, 50, seed=0))
    assert len({int(i) // 10 for i in first["id"]}) > 1
