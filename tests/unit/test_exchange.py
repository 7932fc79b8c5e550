"""The global shuffle's exchange without Ray: its order, its uniformity, its producer."""

from __future__ import annotations

import itertools
import threading
import time
import weakref
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
    collate: Any = lambda batch: batch["id"].tolist(),
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
        collate=collate,
        prefetch=2,
        start_next=start_next,
        description="test",
        name="raydl-test-exchange",
        batch_size=batch_size,
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


def _owner(array: np.ndarray) -> np.ndarray:
    """The array that owns ``array``'s memory (``array`` itself unless it is a view)."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def _images(row: int, kind: str) -> list[list[dict[str, np.ndarray]]]:
    """``_runs([60, 45, 55])`` with an image per row, ``row`` bytes filled with its id: a
    2-d uint8 column (``"array"``) or an object column of encoded bytes (``"bytes"``)."""
    out = []
    for run in _runs([60, 45, 55]):
        blocks = []
        for block in run:
            pixels = np.repeat(block["id"], row).astype(np.uint8).reshape(-1, row)
            if kind == "bytes":
                encoded = np.empty(len(pixels), dtype=object)
                encoded[:] = [image.tobytes() for image in pixels]
                blocks.append({"id": block["id"], "img": encoded})
            else:
                blocks.append({"id": block["id"], "img": pixels})
        out.append(blocks)
    return out


@pytest.mark.parametrize("kind", ["array", "bytes"])
@pytest.mark.parametrize("whole", [False, True])
def test_large_rows_are_reduced_a_batch_at_a_time_so_a_batch_holds_no_partition(
    whole: bool, kind: str
) -> None:
    """A batch of images is its own array, or a copy where it spans two partitions (one
    here), never a view that keeps its whole partition in the trainer; the chunks end
    where the batches end; the order is unchanged."""
    runs = _images(16 << 10, kind)  # ROW_BY_ROW_BYTES
    exchange = Exchange(seed=3, partitions=2)  # partitions of about 80 rows: 11 batches
    owners: list[int] = []
    copies = 0  # batches concatenated from two chunks

    def collate(batch: dict[str, np.ndarray]) -> list[int]:
        nonlocal copies
        first = [image[0] for image in batch["img"]]
        assert np.array_equal(first, batch["id"].astype(np.uint8))  # the columns aligned
        owner = _owner(batch["img"])
        owners.append(owner.shape[0])
        copies += owner is batch["img"]
        return batch["id"].tolist()

    first = sum(exchange.split(i, blocks)[0][0] for i, blocks in enumerate(runs))
    # A rank's share after a resume: it starts mid-partition, and 3 rows of partition 0
    # are left over for the batch that spans the boundary.
    start = 7 + (first - 3) % 7
    producer = _producer(
        runs, exchange, rows=lambda total: (start, 150), batch_size=7, whole=whole, collate=collate
    )
    got = [i for b in EpochIterator(producer, epoch=0) for i in b]
    assert got == _epoch(exchange, runs).tolist()[start:150]
    assert len(owners) == -(-(150 - start) // 7) and max(owners) == 7  # each owns its rows
    assert copies == 1  # only the batch across the partitions' boundary is concatenated


def test_a_partitions_objects_go_before_its_batches_are_handed_over() -> None:
    """Small rows: a partition is reduced whole, and the objects its pieces came from are
    freed before its batches are converted and handed over (not held by every batch)."""
    runs = _runs([40, 25, 35])
    exchange = Exchange(seed=3, partitions=5)
    alive: list[weakref.ref[np.ndarray]] = []

    class Copies(_Store):
        """Objects fetched as fresh arrays (as from the object store), each watched."""

        def get(self, refs: list[Any], timeout: float) -> Any:
            out = [{k: v.copy() for k, v in obj.items()} for obj in super().get(refs, timeout)]
            alive.extend(weakref.ref(column) for obj in out for column in obj.values())
            return out

    held: list[int] = []

    def collate(batch: dict[str, np.ndarray]) -> list[int]:
        held.append(sum(ref() is not None for ref in alive))
        return batch["id"].tolist()

    producer = _producer(runs, exchange, calls=Copies({}), collate=collate)
    got = [i for b in EpochIterator(producer, epoch=0) for i in b]
    assert got == _epoch(exchange, runs).tolist()
    assert alive and held == [0] * len(held), held


class _MapActors:
    """``Calls`` of two actors that map runs (``(work, MapRun)``) into ``objects``.

    A reply is the head and the references to its objects, as ``SplitCalls.get``
    gives them; a warm-up (``"warm"``) is answered at once, unless ``never_warm``.
    """

    def __init__(self, exchange: Exchange, runs: list[Any], objects: dict[Any, Any]) -> None:
        self.exchange, self.runs, self.objects = exchange, runs, objects
        self.mapped: list[int] = []
        self.actors = ["a0", "a1"]
        self.never_warm = False  # the actors' warm-ups never answer (still starting)

    def submit(self, actor: Any, method: str, request: Any) -> Any:
        return request

    def get(self, ref: Any, timeout: float) -> Any:
        if ref == "warm":
            if self.never_warm:
                time.sleep(timeout)
                raise ResultTimeout
            return []
        _, task = ref
        self.mapped.append(task.run)
        blocks = self.runs[task.run]
        if task.whole:
            counts, self.objects[task.run] = self.exchange.group(task.run, blocks)
            return (counts, 0), [task.run]
        counts, pieces = self.exchange.split(task.run, blocks)
        self.objects.update(((task.run, part), piece) for part, piece in enumerate(pieces))
        return (counts, 0), [(task.run, part) for part in range(len(pieces))]

    def wait(self, refs: Any, timeout: float) -> list[Any]:
        return list(refs)[:1]

    def restart(self, worker_id: int, dead: Any) -> Any:
        raise AssertionError("no actor dies here")

    def __len__(self) -> int:
        return len(self.actors)


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("here", [0, 2, 4])
def test_runs_mapped_here_while_ray_starts_give_the_epoch_the_actors_give(
    here: int, whole: bool
) -> None:
    """The first ``here`` runs are mapped in this process (Ray "comes up" after them),
    the rest on the actors; the epoch is the one a map phase on the actors alone gives,
    and with every run mapped here the actors are never made."""
    from types import SimpleNamespace

    from raydl._internal.epochs.direct import MapRun, map_phase
    from raydl._internal.stream.dispatch import Actors, ActorStart, LateActors

    runs = _runs([40, 25, 35, 30])
    exchange = Exchange(seed=3, partitions=4)
    plan = SimpleNamespace(exchange=exchange, runs=lambda: [(f"f{i}",) for i in range(4)])
    objects: dict[Any, Any] = {}
    calls = _MapActors(exchange, runs, objects)
    mapped_here: list[int] = []
    made: list[bool] = []

    def local(task: MapRun) -> Any:
        assert task.whole  # a run mapped here is kept whole: slicing it costs nothing
        mapped_here.append(task.run)
        counts, grouped = exchange.group(task.run, runs[task.run])
        return (counts, 0), grouped

    def make() -> Actors:
        made.append(True)
        return Actors(calls, lambda task: ("work", task), ActorStart("fetch", "warm"))

    actors = LateActors(make, ray_up=lambda: len(mapped_here) >= here, calls=calls)
    partitions = map_phase(actors, plan, lambda: None, calls, whole=lambda: whole, local=local)  # type: ignore[arg-type]
    assert mapped_here == list(range(here)) and calls.mapped == list(range(here, 4))
    assert partitions.mapped_here == here and made == ([True] if here < 4 else [])
    assert partitions.whole is (whole and here < 4)
    producer = ExchangeProducer(
        map_phase=lambda between: partitions,
        rows=lambda total: (0, total),
        reduce=exchange.reduce,
        cut=lambda blocks: rebatch(blocks, 10, False),
        collate=lambda batch: batch["id"].tolist(),
        prefetch=2,
        start_next=None,
        description="test",
        name="raydl-test-exchange",
        calls=_Store(objects),
    )
    batches = list(EpochIterator(producer, epoch=0))
    assert [i for b in batches for i in b] == _epoch(exchange, runs).tolist()
    if here:
        assert f"{here} runs mapped in the training process" in str(producer.summary())


def test_runs_mapped_here_stop_at_their_byte_budget_and_the_rest_go_to_starting_actors() -> None:
    """The trainer keeps at most ``here_bytes`` (plus one run) of mapped runs: the rest goes
    to the actors even while they still start (their warm-ups never answer here)."""
    from types import SimpleNamespace

    from raydl._internal.epochs.direct import MapRun, loaded_bytes, map_phase
    from raydl._internal.stream.dispatch import Actors, ActorStart, LateActors

    runs = _runs([40, 40, 40, 40])
    exchange = Exchange(seed=3, partitions=4)
    plan = SimpleNamespace(exchange=exchange, runs=lambda: [(f"f{i}",) for i in range(4)])
    calls = _MapActors(exchange, runs, {})
    calls.never_warm = True

    def local(task: MapRun) -> Any:
        counts, grouped = exchange.group(task.run, runs[task.run])
        return (counts, loaded_bytes([grouped])), grouped

    actors = LateActors(
        Actors(calls, lambda task: ("work", task), ActorStart("fetch", "warm")), calls=calls
    )
    one_run = loaded_bytes([exchange.group(0, runs[0])[1]])
    partitions = map_phase(
        actors, plan, lambda: None, calls, whole=lambda: True, local=local,  # type: ignore[arg-type]
        here_bytes=lambda: one_run + 1,
    )  # fmt: skip
    assert partitions.mapped_here == 2 and calls.mapped == [2, 3]
    assert sum(partitions.counts) == 160 and partitions.whole


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


def test_the_fingerprint_reads_any_tensor_a_batch_may_hold_and_keeps_its_values() -> None:
    import torch

    from raydl._internal.stream.metrics import fingerprint_step

    g = torch.Generator().manual_seed(0)
    x = torch.rand(100, 3, 8, generator=g)
    batch = {"x": x, "id": torch.arange(100)}
    # The value earlier versions computed: a resumed run compares the fingerprint its state
    # carries with the one it goes on from, so the function must not change.
    first = fingerprint_step("", batch)
    step = fingerprint_step(first, (np.arange(30, dtype=np.float32).reshape(10, 3), 1))
    assert step == "90e5b3aa0522b97534eaadd8"
    assert first == fingerprint_step("", {"x": x.numpy()})  # a tensor counts as its array
    # Tensors numpy cannot view: by their sampled rows' bytes (they used to fail next()).
    for odd in (x.to(torch.bfloat16), x.clone().requires_grad_(), x.to(torch.complex64).conj()):
        assert fingerprint_step("", odd) == fingerprint_step("", odd)
        assert fingerprint_step("", odd) != fingerprint_step("", odd.flip(0))
    assert fingerprint_step("", x.clone().requires_grad_()) == fingerprint_step("", x)
    # A strided view counts by its values, as its contiguous copy does.
    assert fingerprint_step("", x.transpose(0, 1)) == fingerprint_step(
        "", x.transpose(0, 1).contiguous()
    )
    assert fingerprint_step("", x.numpy()[:, 1]) == fingerprint_step("", x[:, 1].contiguous())


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


def test_a_run_mapped_here_that_raises_names_its_files_and_the_training_process() -> None:
    import traceback

    from raydl._internal.epochs.direct import MapRun, load_here

    class Work:
        stages = ()

        def run(self, task: Any, *, own_context: bool = True) -> Any:
            raise ValueError("a bad row")

    with pytest.raises(ValueError, match="a bad row") as info:
        load_here(Work(), MapRun(3, ("a.parquet", "b.parquet"), whole=True))  # type: ignore[arg-type]
    text = "".join(traceback.format_exception(info.value))
    assert "a.parquet" in text and "in the training process" in text, text
