"""The global shuffle's exchange without Ray: its order, its uniformity, its producer."""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from typing import Any

import numpy as np
import pytest

from raydl._internal.epochs.exchange import Exchange, shares
from raydl._internal.stream.batching import concat, rebatch
from raydl._internal.stream.dispatch import ResultTimeout
from raydl._internal.stream.epoch_iterator import EpochIterator
from raydl._internal.stream.exchange_producer import ExchangeProducer, Partitions, slices

pytestmark = pytest.mark.timeout(30)


def _runs(sizes: list[int]) -> list[list[dict[str, np.ndarray]]]:
    """Runs of consecutive ids, each run as two blocks (a run is loaded as several)."""
    out, start = [], 0
    for size in sizes:
        ids = np.arange(start, start + size)
        half = size // 2
        out.append(
            [{"id": ids[:half], "x": ids[:half] * 10}, {"id": ids[half:], "x": ids[half:] * 10}]
        )
        start += size
    return out


def _epoch(exchange: Exchange, runs: list[list[dict[str, np.ndarray]]]) -> np.ndarray:
    """The epoch's ids in order, as the actors' map phase and the trainer's reduces give them."""
    split = [exchange.split(index, blocks) for index, blocks in enumerate(runs)]
    for counts, pieces in split:
        assert [len(p.get("id", [])) for p in pieces] == counts
    parts = [
        exchange.reduce(part, [pieces[part] for _, pieces in split])
        for part in range(exchange.partitions)
    ]
    ids = concat([p for p in parts if p])["id"]
    return np.asarray(ids)


def test_every_row_once_rows_keep_their_columns_and_the_order_is_seeded() -> None:
    runs = _runs([50, 0, 33, 70])
    exchange = Exchange(seed=7, partitions=4)
    ids = _epoch(exchange, runs)
    assert sorted(ids.tolist()) == list(range(153))
    again = _epoch(Exchange(seed=7, partitions=4), runs)
    assert np.array_equal(ids, again)  # a pure function of the seed
    assert not np.array_equal(ids, _epoch(Exchange(seed=8, partitions=4), runs))
    split = [exchange.split(i, blocks) for i, blocks in enumerate(runs)]
    part = exchange.reduce(1, [pieces[1] for _, pieces in split])
    assert np.array_equal(part["x"], part["id"] * 10)  # columns stay aligned


@pytest.mark.parametrize("partitions", [3, 300])  # sorted as uint8 and as uint16
def test_each_piece_holds_its_partitions_rows_in_the_runs_order(partitions: int) -> None:
    exchange = Exchange(seed=5, partitions=partitions)
    blocks = [{"id": np.arange(0, 700)}, {"id": np.arange(700, 2000)}]
    counts, pieces = exchange.split(4, blocks)
    parts = exchange.assign(4, 2000)
    for p, piece in enumerate(pieces):
        expected = np.flatnonzero(parts == p)  # the ids are the rows' places in the run
        assert counts[p] == len(expected)
        np.testing.assert_array_equal(piece["id"], expected)


def test_the_order_is_a_uniform_permutation() -> None:
    # 4 rows in 2 runs, 3 partitions: every one of the 24 orders should be equally likely.
    runs = _runs([2, 2])
    seen = Counter(tuple(_epoch(Exchange(seed, 3), runs).tolist()) for seed in range(12_000))
    assert set(seen) == set(itertools.permutations(range(4)))
    expected = 500
    chi2 = sum((count - expected) ** 2 / expected for count in seen.values())
    assert chi2 < 50  # 23 degrees of freedom: p < 0.0005 above 50


def test_a_run_that_yields_nothing_gives_empty_pieces() -> None:
    counts, pieces = Exchange(seed=0, partitions=3).split(0, [])
    assert counts == [0, 0, 0] and pieces == [{}, {}, {}]


def test_slices_and_shares_cover_the_epoch_exactly() -> None:
    counts = [5, 0, 7, 3]
    assert [(s.part, s.start, s.stop) for s in slices(counts, 0, 15)] == [
        (0, 0, 5),
        (2, 0, 7),
        (3, 0, 3),
    ]
    assert [(s.part, s.start, s.stop) for s in slices(counts, 4, 6)] == [(0, 4, 5), (2, 0, 1)]
    assert slices(counts, 15, 15) == []
    assert shares(15, 2) == [(0, 7), (7, 14)]  # one row (the last) left out, at most world - 1
    assert shares(3, 4) == [(0, 0)] * 4


class _Store:
    """``Calls`` whose references are keys of a dict of objects (``get`` looks them up)."""

    def __init__(self, objects: dict[Any, Any], slow_first: int = 0) -> None:
        self.objects, self.slow, self.got = objects, slow_first, Counter[Any]()

    def get(self, refs: list[Any], timeout: float) -> Any:
        if self.slow:
            self.slow -= 1
            raise ResultTimeout
        self.got.update(refs)
        return [self.objects[ref] for ref in refs]

    def submit(self, actor: Any, method: str, *args: Any) -> Any:
        raise AssertionError("the producer sends nothing")

    def wait(self, refs: Any, timeout: float) -> list[Any]:
        raise AssertionError("the producer waits for nothing")


def _partitions(
    exchange: Exchange,
    runs: list[list[dict[str, np.ndarray]]],
    objects: dict[Any, Any],
    *,
    whole: bool,
) -> Partitions:
    """The map phase's result, its objects in ``objects`` (keys: run, or run and partition)."""
    partitions = Partitions.empty(exchange.partitions)
    for run, blocks in enumerate(runs):
        if whole:
            counts, objects[run] = exchange.group(run, blocks)
            refs: list[Any] = [run]
        else:
            counts, pieces = exchange.split(run, blocks)
            objects.update(((run, part), piece) for part, piece in enumerate(pieces))
            refs = [(run, part) for part in range(exchange.partitions)]
        partitions.add(counts, refs, whole=whole, nbytes=0)
    return partitions


def _producer(
    runs: list[list[dict[str, np.ndarray]]],
    exchange: Exchange,
    *,
    rows: Any = lambda total: (0, total),
    asked: list[str] | None = None,
    batch_size: int = 10,
    whole: bool = False,
    calls: _Store | None = None,
) -> ExchangeProducer:
    calls = calls or _Store({}, slow_first=2)

    def phase(between: Any) -> Partitions:
        between()  # the producer's stop check, callable while the phase waits
        return _partitions(exchange, runs, calls.objects, whole=whole)

    def start_next() -> bool:
        if asked is not None:
            asked.append(threading.current_thread().name)
        return True

    return ExchangeProducer(
        map_phase=phase,
        rows=rows,
        reduce=exchange.reduce,
        cut=lambda blocks: rebatch(blocks, batch_size, False),
        collate=lambda batch: batch["id"].tolist(),
        prefetch=2,
        start_next=start_next,
        description="test",
        name="raydl-test-exchange",
        calls=calls,
    )


@pytest.mark.parametrize("whole", [False, True])  # one object per partition / per run
def test_the_producer_delivers_the_epoch_cut_into_batches_and_starts_the_next_once(
    whole: bool,
) -> None:
    runs = _runs([40, 25, 35])
    exchange = Exchange(seed=3, partitions=5)
    asked: list[str] = []
    calls = _Store({}, slow_first=2)
    producer = _producer(runs, exchange, asked=asked, whole=whole, calls=calls)
    batches = list(EpochIterator(producer, epoch=0))
    assert [i for b in batches for i in b] == _epoch(exchange, runs).tolist()
    assert [len(b) for b in batches] == [10] * 10
    assert asked == ["raydl-test-exchange"]  # once, on its own thread, after the map phase
    # Every object fetched once: a whole run is kept for the partitions after the first.
    assert sorted(calls.got) == sorted(calls.objects) and set(calls.got.values()) == {1}


@pytest.mark.parametrize("whole", [False, True])
def test_a_share_and_a_resume_offset_deliver_exactly_those_rows(whole: bool) -> None:
    runs = _runs([40, 25, 35])
    exchange = Exchange(seed=3, partitions=5)
    everything = _epoch(exchange, runs).tolist()
    mine = _producer(runs, exchange, rows=lambda total: (37, 77), whole=whole)  # rank 1's share
    assert [i for b in EpochIterator(mine, epoch=0) for i in b] == everything[37:77]
    assert shares(len(everything), 2)[1] == (50, 100)


def test_closing_during_the_epoch_stops_the_thread() -> None:
    producer = _producer(_runs([400, 400]), Exchange(seed=1, partitions=8), batch_size=1)
    iterator = EpochIterator(producer, epoch=0)
    next(iterator)
    iterator.close()
    producer.handoff._thread.join(5)  # type: ignore[union-attr]
    assert not producer.handoff._thread.is_alive()  # type: ignore[union-attr]


# -- the order's fingerprint (stats()) ----------------------------------------------


def test_the_fingerprint_follows_the_order_of_batches_and_of_rows() -> None:
    import torch

    from raydl._internal.stream.metrics import fingerprint_step

    def run(batches: list[Any]) -> str:
        fingerprint = ""
        for batch in batches:
            fingerprint = fingerprint_step(fingerprint, batch)
        return fingerprint

    a = {"id": torch.arange(0, 64), "x": torch.rand(64, 3)}
    b = {"id": torch.arange(64, 128), "x": torch.rand(64, 3)}
    assert run([a, b]) == run([dict(a), dict(b)])  # values, not identities
    assert run([a, b]) != run([b, a])  # batch order
    swapped = {"id": a["id"].flip(0), "x": a["x"]}
    assert run([swapped]) != run([a])  # row order (the sampled rows include the first and last)
    assert run([np.array(["u", "v"], dtype=object)]) != run([np.array(["v", "u"], dtype=object)])
    assert run([(torch.zeros(2, 3, 4, 4), 1)]) != run([(torch.zeros(2, 3, 4, 5), 1)])  # shapes
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    assert run([nested]) == run([nested])  # nested tensors have no shape: counted by kind


@pytest.mark.parametrize(("start", "stop"), [(0, None), (1, 3)])  # most rows / a few of them
def test_a_reduce_gives_mixed_pieces_the_dtype_and_shape_concatenation_gives(
    start: int, stop: int | None
) -> None:
    # Pieces of different runs differ as blocks do: an integer column with a null is float64
    # in that run only, strings differ in width, a tensor column may change shape (ragged).
    pieces = [
        {"n": np.array([0, 1, 2]), "s": np.array(["a", "b", "c"]), "x": np.zeros((3, 2))},
        {"n": np.array([np.nan, 4.0]), "s": np.array(["dddd", "e"]), "x": np.ones((2, 5))},
    ]
    exchange = Exchange(seed=3, partitions=1)
    part = exchange.reduce(0, pieces, start, stop)
    order = exchange.permutation(0, 5)[start:stop]
    whole = concat(pieces)
    assert part["n"].dtype == np.float64
    np.testing.assert_array_equal(part["n"], whole["n"][order])
    assert part["s"].dtype == whole["s"].dtype and part["s"].tolist() == whole["s"][order].tolist()
    assert part["x"].dtype == object
    assert [row.shape for row in part["x"]] == [(2,) if i < 3 else (5,) for i in order]
