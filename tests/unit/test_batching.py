"""raydl's own batching of Ray Data blocks (no Ray: plain numpy blocks)."""

from __future__ import annotations

import numpy as np
import pytest

from raydl._internal.stream.batching import rebatch, shuffle_rebatch


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


def _copying_shuffle_rebatch(
    blocks: list[dict[str, np.ndarray]], batch_size: int, drop_last: bool, buffer: int, seed: int
) -> list[dict[str, np.ndarray]]:
    """The buffer as first written: the pool concatenated and gathered each round."""

    def concat(pool: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        return {k: np.concatenate([p[k] for p in pool]) for k in pool[0]}

    def take(batch: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
        return {k: v[rows] for k, v in batch.items()}

    rng = np.random.default_rng(seed)
    out, pool, held = [], [], 0
    for block in blocks:
        rows = len(block["id"])
        if rows == 0:
            continue
        pool.append(block)
        held += rows
        if held >= buffer + batch_size:
            pooled, order = concat(pool), rng.permutation(held)
            cut = (held - buffer) // batch_size * batch_size
            out += [take(pooled, order[s : s + batch_size]) for s in range(0, cut, batch_size)]
            pool, held = [take(pooled, order[cut:held])], held - cut
    if held:
        pooled, order = concat(pool), rng.permutation(held)
        for s in range(0, held, batch_size):
            if min(s + batch_size, held) - s == batch_size or not drop_last:
                out.append(take(pooled, order[s : s + batch_size]))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["indices", "row_by_row", "small_rows"])
def test_shuffle_rebatch_gives_the_batches_of_the_copying_buffer_it_replaced(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pool holds indices, not gathered copies; states saved before must resume the same.
    # Large rows are gathered one by one (row_by_row: every column here is taken that way);
    # small ones once per round, its batches slices of that copy (small_rows).
    from raydl._internal.stream import batching

    monkeypatch.setattr(batching, "ROW_BY_ROW_BYTES", 0 if path == "row_by_row" else 1 << 62)
    monkeypatch.setattr(batching, "SMALL_ROW_BYTES", 1 << 62 if path == "small_rows" else -1)
    rng = np.random.default_rng(0)
    for _ in range(200):
        blocks, start = [], 0
        for _ in range(int(rng.integers(0, 8))):
            n = int(rng.integers(0, 40))
            blocks.append(
                {
                    "id": np.arange(start, start + n),
                    "x": rng.random((n, 2, 3)).astype(np.float32),
                    "s": np.array(
                        [f"r{i}" for i in range(start, start + n)],
                        dtype=object if path != "small_rows" else "U8",
                    ),
                }
            )
            start += n
        args = (int(rng.integers(1, 12)), bool(rng.integers(0, 2)), int(rng.integers(1, 50)))
        seed = int(rng.integers(0, 100))
        expected = _copying_shuffle_rebatch(blocks, *args, seed)
        got = list(shuffle_rebatch(iter(blocks), *args, seed))
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            for name in b:
                assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape
                assert (a[name] == b[name]).all()


@pytest.mark.timeout(60)
def test_shuffle_rebatch_copies_rows_rarely_and_holds_few_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from raydl._internal.stream import batching

    copied = 0
    real_take, real_gather = batching._Pool.take, batching.gather

    def checking(self: batching._Pool, rows: np.ndarray) -> dict[str, np.ndarray]:
        # the blocks alive hold at most SLACK times the rows held (80 here), plus one block
        alive = int(self._starts[-1])
        assert alive <= batching._Pool.SLACK * (64 + 16) + 32, alive
        return real_take(self, rows)

    def counting(
        blocks: list[dict[str, np.ndarray]], starts: np.ndarray, rows: np.ndarray, *args: object
    ) -> dict[str, np.ndarray]:
        nonlocal copied
        copied += len(rows)
        return real_gather(blocks, starts, rows, *args)  # type: ignore[arg-type]

    blocks = [{"id": np.arange(i * 32, (i + 1) * 32)} for i in range(200)]
    monkeypatch.setattr(batching._Pool, "take", checking)
    monkeypatch.setattr(batching, "gather", counting)  # batches and compacted blocks
    monkeypatch.setattr(batching, "SMALL_ROW_BYTES", -1)  # the rows that are not gathered per round
    ids = [i for b in shuffle_rebatch(iter(blocks), 16, False, 64, 1) for i in b["id"]]
    assert sorted(ids) == list(range(6400))
    # Into its batch, and sometimes into a compacted block: only the sparsest blocks' rows
    # (1.16 copies per row; gathering every held row when compacting made it 1.40, the
    # copying buffer 3-4).
    assert 6400 < copied <= 1.25 * 6400, copied


def test_a_ragged_column_across_blocks_becomes_an_object_array_of_rows() -> None:
    from raydl._internal.stream.batching import rebatch

    wide = {"x": np.zeros((2, 3)), "id": np.array([0, 1])}
    wider = {"x": np.ones((2, 5)), "id": np.array([2, 3])}
    rows = {"x": np.array([np.zeros(3), np.zeros(3)], dtype=object), "id": np.array([4, 5])}
    batches = list(rebatch([wide, wider, rows], batch_size=6, drop_last=False))
    assert len(batches) == 1
    column = batches[0]["x"]
    assert (
        column.dtype == object and [r.shape for r in column] == [(3,)] * 2 + [(5,)] * 2 + [(3,)] * 2
    )
    assert batches[0]["id"].tolist() == [0, 1, 2, 3, 4, 5]


def test_the_local_buffer_gives_mixed_blocks_the_dtype_and_shape_concatenation_gives() -> None:
    # Ray Data turns an integer column with a null into float64 in that block only, strings
    # differ in width from block to block, and a tensor column may change shape (ragged).
    blocks = [
        {"n": np.array([1, 2]), "s": np.array(["a", "b"]), "x": np.zeros((2, 3))},
        {"n": np.array([np.nan, 4.0]), "s": np.array(["ccc", "dddd"]), "x": np.ones((2, 5))},
    ]
    (batch,) = shuffle_rebatch(blocks, batch_size=4, drop_last=False, buffer=2, seed=0)
    (plain,) = rebatch(blocks, batch_size=4, drop_last=False)
    order = np.argsort(np.nan_to_num(batch["n"], nan=3.0))  # rows back in block order
    assert batch["n"].dtype == plain["n"].dtype == np.float64
    np.testing.assert_array_equal(batch["n"][order], plain["n"])
    assert batch["s"].dtype == plain["s"].dtype
    assert batch["s"][order].tolist() == ["a", "b", "ccc", "dddd"]
    assert batch["x"].dtype == object
    assert [batch["x"][i].shape for i in order] == [(3,), (3,), (5,), (5,)]
