"""torch's DataLoader behaviours that a user switching to raydl meets, on Ray workers (issue 19).

Each test states what torch does and checks raydl does it with ``num_workers > 0``
(the in-process ``num_workers=0`` path is covered in ``tests/unit/test_torch_parity.py``).
"""

from __future__ import annotations

import collections
import os
import warnings
from collections.abc import Iterator
from typing import Any

import _by_value
import pytest
import torch
from ray import cloudpickle
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torch.utils.data.datapipes.iter import IterableWrapper

from raydl import RayDataLoader, WorkerDiedError


class BadAt(Dataset[int]):
    """Sample ``i`` is ``i``; the samples in ``bad`` raise ``ValueError``."""

    def __init__(self, n: int, bad: set[int]) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index in self.bad:
            raise ValueError(f"bad sample {index}")
        return index


class FlakyStream(IterableDataset[int]):
    """Yields 0..4, but the third ``next()`` raises; the iterator goes on afterwards."""

    def __iter__(self) -> Iterator[int]:
        return _Flaky()


class _Flaky:
    def __init__(self) -> None:
        self.calls = 0

    def __iter__(self) -> _Flaky:
        return self

    def __next__(self) -> int:
        self.calls += 1
        if self.calls == 3:
            raise ValueError("flaky item")
        if self.calls > 5:
            raise StopIteration
        return self.calls - 1


class SelfInit(Dataset[Any]):
    """torch's pattern ``worker_init_fn=dataset.worker_init_fn``: state set on the worker's copy."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.worker_id: int | None = None

    def worker_init_fn(self, worker_id: int) -> None:
        self.worker_id = worker_id

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        return self.worker_id, index


class WithNamedTuple(Dataset[Any]):
    Sample = collections.namedtuple("Sample", ["x", "name"])  # qualname "Sample", not by name

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> Any:
        return self.Sample(x=torch.tensor([index]), name=f"s{index}")


class WherePid(Dataset[Any]):
    def __init__(self) -> None:
        self.unpicklable = (i for i in range(3))  # a generator: only num_workers=0 can hold it

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> Any:
        return os.getpid(), get_worker_info() is None


class LongerThanSaid(IterableDataset[int]):
    def __len__(self) -> int:
        return 2

    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


def fail_init(worker_id: int) -> None:
    raise RuntimeError("Error in worker_init_fn")


def clone_collate(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.clone() for x in batch]


def _outcomes(loader: Any) -> list[Any]:
    """Each ``next()`` until the end: the batch as a list, or the error's message."""
    out: list[Any] = []
    it = iter(loader)
    while True:
        try:
            batch = next(it)
        except ValueError as err:
            out.append(str(err).splitlines()[-1])
            continue
        except StopIteration:
            return out
        out.append(batch.tolist() if isinstance(batch, torch.Tensor) else batch)


# ---------------------------------------------------------------- 1. errors per batch


@pytest.mark.timeout(90)
def test_a_failed_batch_is_raised_and_the_epoch_goes_on() -> None:
    loader = RayDataLoader(BadAt(10, {2, 3}), batch_size=2, num_workers=2, persistent_workers=True)
    assert _outcomes(loader) == [[0, 1], "ValueError: bad sample 2", [4, 5], [6, 7], [8, 9]]
    every = RayDataLoader(BadAt(9, set(range(9))), batch_size=2, num_workers=2)
    assert len(_outcomes(every)) == 5  # torch: one error per batch, then the end
    loader.close()


@pytest.mark.timeout(90)
def test_an_iterable_worker_goes_on_with_its_iterator_after_an_error() -> None:
    loader = RayDataLoader(FlakyStream(), batch_size=None, num_workers=1)
    assert _outcomes(loader) == [0, 1, "ValueError: flaky item", 3, 4]


@pytest.mark.timeout(90)
def test_a_worker_init_fn_error_is_raised_by_iter_and_delivers_nothing() -> None:
    """torchdata raises it from ``iter()`` (torch at the first ``next()``): no batch comes."""
    loader = RayDataLoader(BadAt(8, set()), batch_size=2, num_workers=1, worker_init_fn=fail_init)
    delivered = []
    with pytest.raises(RuntimeError, match="Error in worker_init_fn"):
        it = iter(loader)
        delivered.append(next(it))
    assert delivered == []


# ---------------------------------------------------------------- 2. one payload


@pytest.mark.timeout(90)
def test_a_bound_worker_init_fn_sets_state_on_the_workers_copy() -> None:
    data = SelfInit(8)
    loader = RayDataLoader(data, batch_size=2, num_workers=2, worker_init_fn=data.worker_init_fn)
    ids = [batch[0].tolist() for batch in loader]
    assert ids == [[0, 0], [1, 1], [0, 0], [1, 1]]  # round-robin, each worker's own id
    assert data.worker_id is None  # the trainer's copy is untouched, as in torch


@pytest.mark.timeout(90)
def test_script_globals_set_by_worker_init_fn_are_read_by_getitem() -> None:
    # Pickled by value, like a training script's __main__.
    cloudpickle.register_pickle_by_value(_by_value)
    try:
        loader = RayDataLoader(
            _by_value.ReadsState(),
            batch_size=None,
            num_workers=1,
            worker_init_fn=_by_value.init_state,
        )
        assert list(loader) == ["set by worker 0", "set by worker 0"]
    finally:
        cloudpickle.unregister_pickle_by_value(_by_value)


# ---------------------------------------------------------------- 3, 4, 5


@pytest.mark.timeout(90)
def test_a_namedtuple_of_a_class_body_comes_back_as_that_class() -> None:
    batch = next(iter(RayDataLoader(WithNamedTuple(), batch_size=2, num_workers=1)))
    assert isinstance(batch, WithNamedTuple.Sample)
    assert batch.x.tolist() == [[0], [1]]
    assert list(batch.name) == ["s0", "s1"]


@pytest.mark.timeout(60)
def test_num_workers_0_loads_in_the_trainers_process() -> None:
    rows = list(RayDataLoader(WherePid(), batch_size=None))
    assert rows == [[os.getpid(), True], [os.getpid(), True]]  # default_convert: tuple -> list


@pytest.mark.timeout(90)
def test_nested_tensors_pass_through_the_workers() -> None:
    data = [torch.nested.nested_tensor([torch.arange(float(i + 1))]) for i in range(4)]
    loader = RayDataLoader(data, batch_size=1, num_workers=2, collate_fn=clone_collate)
    out = [batch[0] for batch in loader]
    assert all(t.is_nested for t in out)
    assert [t.unbind()[0].tolist() for t in out] == [d.unbind()[0].tolist() for d in data]


# ---------------------------------------------------------------- 6. DataPipes


@pytest.mark.timeout(120)
def test_datapipe_sharding_and_shuffle_on_workers() -> None:
    sharded = RayDataLoader(IterableWrapper(range(10)).sharding_filter(), num_workers=2)
    assert sorted(int(b) for b in sharded) == list(range(10))  # each item once, not twice

    def epochs(shuffle: bool, seeds: list[int]) -> list[list[int]]:
        pipe = IterableWrapper(range(20)).shuffle().sharding_filter()
        loader = RayDataLoader(
            pipe, batch_size=None, shuffle=shuffle, num_workers=2, persistent_workers=True
        )
        out = []
        for seed in seeds:
            torch.manual_seed(seed)
            out.append([int(b) for b in loader])
        loader.close()
        return out

    plain = epochs(False, [0, 1])
    assert plain[0] == plain[1] and sorted(plain[0]) == list(range(20))  # shuffler off
    first, again, other = epochs(True, [123, 123, 321])  # torch: one seed per epoch
    assert sorted(first) == list(range(20)) and first == again != other


# ---------------------------------------------------------------- 7, internals


@pytest.mark.timeout(90)
def test_iterable_length_warning_with_workers() -> None:
    loader = RayDataLoader(LongerThanSaid(), batch_size=None, num_workers=1)
    assert len(loader) == 2
    it = iter(loader)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [next(it), next(it)] == [0, 1]
    with pytest.warns(UserWarning, match="but 3 samples have been fetched. For multiprocessing"):
        next(it)


@pytest.mark.timeout(30)
def test_more_workers_than_cluster_cpus_is_warned_at_construction() -> None:
    with pytest.warns(UserWarning, match=r"will create 3 .*CPUs of the Ray cluster.*excessive"):
        RayDataLoader(BadAt(4, set()), num_workers=3)  # the module's cluster has 2 CPUs


class SegfaultStream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        import ctypes

        yield ctypes.string_at(0)  # type: ignore[misc]  # reads address 0: SIGSEGV


@pytest.mark.timeout(90)
def test_a_worker_killed_by_a_signal_is_named_in_torchs_words() -> None:
    loader = RayDataLoader(SegfaultStream(), batch_size=None, num_workers=1)
    with pytest.raises(
        WorkerDiedError,
        match=r"^DataLoader worker \(pid \d+\) is killed by signal: Segmentation fault\. Ray worker 0",
    ):
        next(iter(loader))
