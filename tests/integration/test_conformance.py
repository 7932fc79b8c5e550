"""The same configuration through torch's DataLoader and RayDataLoader gives the same epochs.

torch runs as the reference with ``num_workers=0`` (forking a process that runs a
Ray driver is unsafe). Its output does not depend on ``num_workers`` for these
checks, with two exceptions that the reference emulates:

* ``IterableDataset``: each worker iterates its own shard and torch takes batches
  round-robin from the workers still running (see :func:`_iterable_reference`);
* ``persistent_workers=True``: torch draws the workers' base seed (one int64 from
  ``generator``, or from the global RNG) only when it creates the workers, i.e. in
  the first epoch; later epochs reuse the iterator (``_reset``) and draw only the
  sampler's permutation (see :func:`_map_reference`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from _datasets import (
    DictData,
    GetItemsData,
    IntData,
    NumpyData,
    StreamData,
    TensorData,
    TupleData,
    collate_ids,
)
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from raydl import RayDataLoader

N = 23  # prime: every batch size leaves a remainder


# ------------------------------------------------------------------ comparing batches


def canon(obj: Any) -> Any:
    """A hashable, comparable description of a batch: types, dtypes, shapes and values."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape), _freeze(obj.tolist()))
    if isinstance(obj, np.ndarray):
        return ("ndarray", str(obj.dtype), obj.shape, _freeze(obj.tolist()))
    if isinstance(obj, dict):
        return ("dict", tuple((k, canon(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(canon(v) for v in obj))
    return (type(obj).__name__, obj)


def structure(obj: Any) -> Any:
    """``canon`` without the values: what a batch looks like, not what it holds."""
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return (type(obj).__name__, str(obj.dtype), tuple(obj.shape))
    if isinstance(obj, dict):
        return ("dict", tuple((k, structure(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(structure(v) for v in obj))
    return type(obj).__name__


def leaves(obj: Any) -> list[Any]:
    """Every scalar in a batch, in order (each sample's values are unique to it)."""
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return list(np.asarray(obj).reshape(-1).tolist())
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in leaves(v)]
    return [obj]


def _freeze(value: Any) -> Any:
    return tuple(_freeze(v) for v in value) if isinstance(value, list) else value


# ------------------------------------------------------------------ cases


@dataclass(frozen=True)
class Case:
    """One configuration. ``make(seed)`` builds a fresh dataset and torch kwargs.

    Each loader gets its own dataset, samplers and generators, all seeded with ``seed``.
    """

    make: Callable[[int], tuple[Any, dict[str, Any]]]
    num_workers: int = 0
    persistent: bool = False
    in_order: bool = True
    random: bool = False  # the order is random: must change between epochs
    distributed: bool = False  # call sampler.set_epoch(epoch)
    prefetch_factor: int | None = None
    epochs: int = 2
    raydl_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return self.in_order


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _plain(data_cls: type, **kwargs: Any) -> Callable[[int], tuple[Any, dict[str, Any]]]:
    return lambda seed: (data_cls(N), dict(kwargs))


def _shuffled(data_cls: type, **kwargs: Any) -> Callable[[int], tuple[Any, dict[str, Any]]]:
    return lambda seed: (data_cls(N), {"shuffle": True, "generator": _gen(seed), **kwargs})


def _with_sampler(
    sampler: Callable[[Any, int], Any], data_cls: type = TensorData, **kwargs: Any
) -> Callable[[int], tuple[Any, dict[str, Any]]]:
    def make(seed: int) -> tuple[Any, dict[str, Any]]:
        data = data_cls(N)
        return data, {"sampler": sampler(data, seed), **kwargs}

    return make


def _with_batch_sampler(
    batch_sampler: Callable[[Any, int], Any],
) -> Callable[[int], tuple[Any, dict[str, Any]]]:
    def make(seed: int) -> tuple[Any, dict[str, Any]]:
        data = TensorData(N)
        return data, {"batch_sampler": batch_sampler(data, seed)}

    return make


def _stream(**kwargs: Any) -> Callable[[int], tuple[Any, dict[str, Any]]]:
    as_dict = kwargs.pop("as_dict", False)
    return lambda seed: (StreamData(N, as_dict=as_dict), dict(kwargs))


P = {"persistent": True}
MAP_CASES: dict[str, Case] = {
    # datasets x batch sizes, sequential
    "tensor-b1-w0": Case(_plain(TensorData, batch_size=1)),
    "tensor-b3-w2": Case(_plain(TensorData, batch_size=3), 2, **P),
    "tensor-b7-drop-w1": Case(_plain(TensorData, batch_size=7, drop_last=True), 1, **P),
    "tensor-bNone-w2": Case(_plain(TensorData, batch_size=None), 2, **P),
    "tuple-b3-w2": Case(_plain(TupleData, batch_size=3), 2, **P),
    "dict-b3-drop-w2": Case(_plain(DictData, batch_size=3, drop_last=True), 2, **P),
    "dict-bNone-w1": Case(_plain(DictData, batch_size=None), 1, **P),
    "numpy-b3-w1": Case(_plain(NumpyData, batch_size=3), 1, **P),
    "numpy-bNone-w0": Case(_plain(NumpyData, batch_size=None)),
    "int-b7-w2-prefetch1": Case(_plain(IntData, batch_size=7), 2, prefetch_factor=1, **P),
    "int-bNone-w0": Case(_plain(IntData, batch_size=None)),
    "getitems-b3-w2": Case(_plain(GetItemsData, batch_size=3), 2, **P),
    "getitems-bNone-w1": Case(_plain(GetItemsData, batch_size=None), 1, **P),
    "collate-b3-w2": Case(_plain(TensorData, batch_size=3, collate_fn=collate_ids), 2, **P),
    "collate-bNone-w1": Case(_plain(TensorData, batch_size=None, collate_fn=collate_ids), 1, **P),
    # samplers
    "sequential-sampler-b3-w1": Case(
        _with_sampler(lambda d, s: SequentialSampler(d), batch_size=3), 1, **P
    ),
    "random-sampler-b3-w2": Case(
        _with_sampler(lambda d, s: RandomSampler(d, generator=_gen(s)), batch_size=3),
        2,
        random=True,
        **P,
    ),
    "random-sampler-replacement-b4-w2-prefetch4": Case(
        _with_sampler(
            lambda d, s: RandomSampler(d, replacement=True, num_samples=15, generator=_gen(s)),
            batch_size=4,
        ),
        2,
        random=True,
        prefetch_factor=4,
        **P,
    ),
    "subset-sampler-b3-w2": Case(
        _with_sampler(
            lambda d, s: SubsetRandomSampler([1, 4, 6, 9, 12, 15, 19, 22], generator=_gen(s)),
            batch_size=3,
        ),
        2,
        random=True,
        **P,
    ),
    "weighted-sampler-b7-w2": Case(
        _with_sampler(
            lambda d, s: WeightedRandomSampler(
                [float(i + 1) for i in range(N)], num_samples=20, generator=_gen(s)
            ),
            batch_size=7,
        ),
        2,
        random=True,
        **P,
    ),
    "weighted-sampler-dict-bNone-w1": Case(
        _with_sampler(
            lambda d, s: WeightedRandomSampler([1.0] * N, num_samples=9, generator=_gen(s)),
            DictData,
            batch_size=None,
        ),
        1,
        random=True,
        **P,
    ),
    "distributed-r0-b3-w2": Case(
        _with_sampler(
            lambda d, s: DistributedSampler(d, num_replicas=2, rank=0, seed=s), batch_size=3
        ),
        2,
        random=True,
        distributed=True,
        **P,
    ),
    "distributed-r1-b3-drop-w1": Case(
        _with_sampler(
            lambda d, s: DistributedSampler(d, num_replicas=2, rank=1, seed=s),
            batch_size=3,
            drop_last=True,
        ),
        1,
        random=True,
        distributed=True,
        **P,
    ),
    "distributed-r1-noshuffle-bNone-w0": Case(
        _with_sampler(
            lambda d, s: DistributedSampler(d, num_replicas=2, rank=1, shuffle=False),
            batch_size=None,
        ),
        distributed=True,
    ),
    # batch samplers
    "batch-sampler-drop-w2": Case(
        _with_batch_sampler(lambda d, s: BatchSampler(SequentialSampler(d), 4, drop_last=True)),
        2,
        **P,
    ),
    "batch-sampler-random-w2": Case(
        _with_batch_sampler(
            lambda d, s: BatchSampler(RandomSampler(d, generator=_gen(s)), 5, drop_last=False)
        ),
        2,
        random=True,
        **P,
    ),
    "batch-sampler-list-w1": Case(
        _with_batch_sampler(lambda d, s: [[3, 1], [22], [0, 5, 7, 9], [2, 2]]), 1, **P
    ),
    # shuffle=True: the default RandomSampler shares the loader's generator
    "shuffle-b3-w0": Case(_shuffled(TensorData, batch_size=3), random=True),
    "shuffle-tuple-b7-drop-w2": Case(
        _shuffled(TupleData, batch_size=7, drop_last=True), 2, random=True
    ),
    "shuffle-int-bNone-w1": Case(_shuffled(IntData, batch_size=None), 1, random=True),
    "shuffle-global-rng-b3-w1": Case(
        lambda seed: (TensorData(N), {"batch_size": 3, "shuffle": True}), 1, random=True
    ),
    # persistent workers: torch draws the worker base seed in the first epoch only
    "shuffle-b3-w2-persistent": Case(_shuffled(TensorData, batch_size=3), 2, random=True, **P),
    "shuffle-global-rng-b1-w1-persistent": Case(
        lambda seed: (IntData(N), {"batch_size": 1, "shuffle": True}), 1, random=True, **P
    ),
    # in_order=False: same batches, any order
    "unordered-b3-w2": Case(_plain(TensorData, batch_size=3), 2, in_order=False, **P),
    "unordered-shuffle-dict-b3-w2": Case(
        _shuffled(DictData, batch_size=3), 2, in_order=False, random=True, **P
    ),
}

ITERABLE_CASES: dict[str, Case] = {
    "stream-b4-w0": Case(_stream(batch_size=4)),
    "stream-b3-w1": Case(_stream(batch_size=3), 1, **P),
    "stream-b3-w2": Case(_stream(batch_size=3), 2, **P),
    "stream-b7-drop-w2": Case(_stream(batch_size=7, drop_last=True), 2, **P),
    "stream-b3-drop-w1": Case(_stream(batch_size=3, drop_last=True), 1, **P),
    "stream-bNone-w2": Case(_stream(batch_size=None), 2, **P),
    "stream-dict-b2-w2": Case(_stream(batch_size=2, as_dict=True), 2, **P),
    "stream-b1-w2-fresh": Case(_stream(batch_size=1), 2),
}


# ------------------------------------------------------------------ references


def _map_reference(case: Case, seed: int) -> tuple[Any, list[list[Any]]]:
    """torch's epochs for a map-style case (see the module docstring for persistence)."""
    torch.manual_seed(seed)
    dataset, kwargs = case.make(seed)
    loader = DataLoader(dataset, **kwargs)
    length = _len(loader)
    epochs = []
    for epoch in range(case.epochs):
        if case.distributed:
            loader.sampler.set_epoch(epoch)
        generator = loader.generator
        saved = (None if generator is None else generator.get_state(), torch.get_rng_state())
        iterator = iter(loader)  # draws the base seed; the sampler draws on the first next()
        if case.persistent and case.num_workers > 0 and epoch > 0:
            if generator is not None:
                generator.set_state(saved[0])
            torch.set_rng_state(saved[1])
        epochs.append(list(iterator))
    return length, epochs


def _iterable_reference(case: Case, seed: int) -> tuple[Any, list[list[Any]]]:
    """torch's epochs for a sharded IterableDataset: per-worker batches, round-robin."""
    dataset, kwargs = case.make(seed)
    length = _len(DataLoader(dataset, **kwargs))
    workers = max(1, case.num_workers)
    if case.num_workers == 0:
        per_worker = [list(DataLoader(dataset, **kwargs))]
    else:
        per_worker = [
            list(DataLoader(StreamData(N, (w, workers), dataset.as_dict), **kwargs))
            for w in range(workers)
        ]
    order = []
    queues = [collections.deque(batches) for batches in per_worker]
    while any(queues):
        for q in queues:
            if q:
                order.append(q.popleft())
    return length, [order] * case.epochs


def _len(loader: Any) -> Any:
    try:
        return len(loader)
    except TypeError:
        return TypeError


#: The epochs of the cases that test_same_seed_same_order_across_loaders also runs, by
#: (case, seed): its first loader is test_map_style_matches_torch's (one loader less each).
_FIRST_RUNS: dict[tuple[str, int], tuple[Any, list[list[Any]]]] = {}
SAME_SEED_CASES = ["random-sampler-b3-w2", "weighted-sampler-b7-w2", "distributed-r0-b3-w2"]


def _raydl_epochs(case: Case, seed: int) -> tuple[Any, list[list[Any]]]:
    torch.manual_seed(seed)
    dataset, kwargs = case.make(seed)
    loader = RayDataLoader(
        dataset,
        **kwargs,
        num_workers=case.num_workers,
        persistent_workers=case.persistent,
        in_order=case.in_order,
        prefetch_factor=case.prefetch_factor,
        **case.raydl_kwargs,
    )
    try:
        length = _len(loader)
        epochs = []
        for epoch in range(case.epochs):
            if case.distributed:
                loader.sampler.set_epoch(epoch)
            epochs.append(list(loader))
        return length, epochs
    finally:
        loader.close()


def _check(
    case: Case, reference: tuple[Any, list[list[Any]]], ours: tuple[Any, list[list[Any]]]
) -> None:
    ref_len, ref_epochs = reference
    our_len, our_epochs = ours
    assert our_len == ref_len
    for epoch, (ref, got) in enumerate(zip(ref_epochs, our_epochs, strict=True)):
        assert len(got) == len(ref), f"epoch {epoch}: number of batches"
        if ref_len is not TypeError:
            assert len(got) == ref_len, f"epoch {epoch}: len(loader) vs batches"
        assert sorted(map(repr, map(structure, got))) == sorted(map(repr, map(structure, ref))), (
            f"epoch {epoch}: batch structures"
        )
        assert collections.Counter(map(repr, (x for b in got for x in leaves(b)))) == (
            collections.Counter(map(repr, (x for b in ref for x in leaves(b))))
        ), f"epoch {epoch}: sample multiset"
        if case.exact:
            assert [canon(b) for b in got] == [canon(b) for b in ref], f"epoch {epoch}: order"
    if case.random:
        first, second = ([x for b in e for x in leaves(b)] for e in our_epochs[:2])
        assert first != second, "shuffled epochs repeat the same order"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(MAP_CASES))
def test_map_style_matches_torch(name: str) -> None:
    case = MAP_CASES[name]
    ours = _raydl_epochs(case, seed=11)
    if name in SAME_SEED_CASES:
        _FIRST_RUNS[(name, 11)] = ours
    _check(case, _map_reference(case, seed=11), ours)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(ITERABLE_CASES))
def test_iterable_matches_torch(name: str) -> None:
    case = ITERABLE_CASES[name]
    _check(case, _iterable_reference(case, seed=0), _raydl_epochs(case, seed=0))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", SAME_SEED_CASES)
def test_same_seed_same_order_across_loaders(name: str) -> None:
    case = MAP_CASES[name]
    # The first loader: test_map_style_matches_torch's when it ran (in another loader, as here).
    first = (_FIRST_RUNS.pop((name, 11), None) or _raydl_epochs(case, seed=11))[1]
    second = _raydl_epochs(case, seed=11)[1]
    other = _raydl_epochs(case, seed=6)[1]
    assert [[canon(b) for b in e] for e in first] == [[canon(b) for b in e] for e in second]
    assert [[canon(b) for b in e] for e in first] != [[canon(b) for b in e] for e in other]
