"""torch's behaviours that raydl matches without Ray: num_workers=0 in this process, per-batch
errors, DataPipe shuffle settings, the IterableDataset length warning, argument checks."""

from __future__ import annotations

import collections
import multiprocessing
import re
import threading
import warnings
from typing import Any

import pytest
import ray
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.datapipes.iter import IterableWrapper

from raydl import RayDataLoader
from raydl._internal.stream.handoff import InlineHandoff, ItemError
from raydl._internal.torch_args import warn_excessive_workers

pytestmark = pytest.mark.timeout(60)


class Unpicklable(Dataset[int]):
    """Holds a generator and a lock: cannot be pickled, as torch's num_workers=0 never needs."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.gen = (i for i in range(n))
        self.lock = threading.Lock()
        self.threads: set[int] = set()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.threads.add(threading.get_ident())
        return i


class BadAt(Dataset[int]):
    def __init__(self, n: int, bad: set[int]) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i in self.bad:
            raise ValueError(f"bad sample {i}")
        return i


class Stream(IterableDataset[int]):
    def __init__(self, n: int, reported: int) -> None:
        self.n, self.reported = n, reported

    def __len__(self) -> int:
        return self.reported

    def __iter__(self) -> Any:
        return iter(range(self.n))


class Pair(Dataset[Any]):
    Item = collections.namedtuple("Item", ["x", "label"])  # qualname "Item": not picklable by name

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return self.Item(x=i, label=str(i))


def _run(loader: Any) -> list[Any]:
    out: list[Any] = []
    it = iter(loader)
    while True:
        try:
            out.append(next(it).tolist())
        except ValueError as err:
            out.append(str(err))
        except StopIteration:
            return out


def test_num_workers_0_loads_on_the_callers_thread_without_pickling() -> None:
    data = Unpicklable(5)
    assert [b.tolist() for b in RayDataLoader(data, batch_size=2)] == [[0, 1], [2, 3], [4]]
    assert data.threads == {threading.get_ident()}  # breakpoints in __getitem__ stop the trainer
    assert not ray.is_initialized()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.complex64])
def test_batches_of_any_tensor_dtype_load_as_torchs(dtype: torch.dtype) -> None:
    # The order's fingerprint (stats()) reads every batch: numpy has no bfloat16, and
    # next() used to fail on it ("Got unsupported ScalarType BFloat16").
    data = torch.utils.data.TensorDataset(torch.arange(10.0).reshape(5, 2).to(dtype))
    ours = [b[0] for b in RayDataLoader(data, batch_size=2)]
    theirs = [b[0] for b in DataLoader(data, batch_size=2)]
    assert len(ours) == len(theirs) == 3
    assert all(o.dtype == dtype and torch.equal(o, t) for o, t in zip(ours, theirs, strict=True))


def test_num_workers_0_keeps_torch_rng_stream() -> None:
    # torch draws a base seed for its workers even without any: same batches, same RNG after.
    def epoch(cls: Any) -> tuple[list[list[int]], float]:
        torch.manual_seed(7)
        batches = [b.tolist() for b in cls(list(range(10)), batch_size=3, shuffle=True)]
        return batches, torch.rand(1).item()

    assert epoch(RayDataLoader) == epoch(DataLoader)


def test_a_failed_batch_does_not_end_the_epoch_in_process() -> None:
    loader = RayDataLoader(BadAt(10, {2, 3}), batch_size=2)
    assert _run(loader) == [[0, 1], "bad sample 2", [4, 5], [6, 7], [8, 9]]
    assert _run(loader) == _run(DataLoader(BadAt(10, {2, 3}), batch_size=2))


def test_a_failed_batch_keeps_its_traceback_in_process() -> None:
    with pytest.raises(ValueError, match="bad sample 0") as info:
        next(iter(RayDataLoader(BadAt(2, {0}), batch_size=None)))
    assert "__getitem__" in {frame.name for frame in info.traceback}


def test_iter_of_a_failing_iterable_raises_at_iter_in_process() -> None:
    class Failing(IterableDataset[int]):
        def __iter__(self) -> Any:
            raise RuntimeError("Error in __iter__")

    with pytest.raises(RuntimeError, match="Error in __iter__"):
        iter(RayDataLoader(Failing()))


def test_namedtuple_of_a_class_body_stays_that_class_in_process() -> None:
    batch = next(iter(RayDataLoader(Pair(), batch_size=2)))
    assert isinstance(batch, Pair.Item)
    assert batch.x.tolist() == [0, 1]


def test_length_warning_after_len_as_torch() -> None:
    loader = RayDataLoader(Stream(5, reported=3), batch_size=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(loader) == [0, 1, 2, 3, 4]  # len() not called yet: no warning
    assert len(loader) == 3
    it = iter(loader)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [next(it) for _ in range(3)] == [0, 1, 2]
    with pytest.warns(UserWarning, match=r"was reported to be 3.*but 4 samples have been fetched"):
        next(it)


@pytest.mark.parametrize("shuffle", [None, False, True])
def test_datapipe_shuffle_follows_the_loader_as_torch(shuffle: bool | None) -> None:
    def epochs(cls: Any) -> list[list[int]]:
        pipe = IterableWrapper(range(20)).shuffle()
        torch.manual_seed(3)
        loader = cls(pipe, batch_size=None, shuffle=shuffle)
        return [list(loader), list(loader)]

    ours, theirs = epochs(RayDataLoader), epochs(DataLoader)
    assert ours == theirs
    if shuffle is False:
        assert ours[0] == list(range(20))
    else:
        assert ours[0] != list(range(20)) and sorted(ours[0]) == list(range(20))


def test_timeout_without_workers_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"^timeout option needs num_workers > 0, but got timeout=5"
    ):
        RayDataLoader(BadAt(2, set()), timeout=5)


def test_multiprocessing_context_name_becomes_torchs_context() -> None:
    loader = RayDataLoader(BadAt(2, set()), num_workers=1, multiprocessing_context="spawn")
    assert isinstance(loader.multiprocessing_context, multiprocessing.context.BaseContext)
    assert loader.multiprocessing_context.get_start_method() == "spawn"


def test_excessive_workers_warning_has_torchs_words() -> None:
    with pytest.warns(UserWarning, match=re.escape("excessive worker creation might get")):
        warn_excessive_workers(5, 4, "the Ray cluster")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_excessive_workers(4, 4, "the Ray cluster")


def test_inline_handoff_and_item_error() -> None:
    items = iter([1, ItemError(KeyError("k")), 3])
    handoff = InlineHandoff(lambda: next(items))
    assert handoff.take(0) == 1
    with pytest.raises(KeyError):
        handoff.take(0).reraise()
    assert handoff.take(0) == 3
    with pytest.raises(StopIteration):
        handoff.take(0)
    with pytest.raises(StopIteration):  # the end is final
        handoff.take(0)
