"""torchdata's ``Stateful`` protocol: a dataset's own state, captured per worker and restored.

The datasets here keep state that changes what they yield (a counter of items
loaded, a position in a stream), so a resume that re-created them fresh, or
restored the wrong worker's state, would deliver other values. Each test compares
a resumed loader with an uninterrupted one built the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

from raydl import NumWorkersMismatchError, RayDataLoader

N = 48


class Counting(Dataset[int]):
    """Item ``i`` is ``1000 * i`` plus how many items this copy had loaded: its own state."""

    def __init__(self) -> None:
        self.loaded = 0
        self.captures = 0  # state_dict() calls on this copy

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        self.loaded += 1
        return 1000 * index + self.loaded

    def state_dict(self) -> dict[str, int]:
        self.captures += 1
        return {"loaded": self.loaded, "captures": self.captures}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loaded = state["loaded"]


class Stream(IterableDataset[int]):
    """Each worker streams its own values; a loaded state resumes the next pass.

    It follows torchdata's convention: a pass that ends resets the position, so the
    state between passes describes the start of the next one.
    """

    def __init__(self) -> None:
        self.position = 0
        self.passes = 0  # passes ended: a state that lives across epochs
        self.resume_from: int | None = None

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        self.position, self.resume_from = self.resume_from or 0, None
        while self.position < 30:
            self.position += 1
            yield 10_000 * self.passes + 100 * worker + self.position
        self.position = 0
        self.passes += 1

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "passes": self.passes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_from, self.passes = state["position"], state["passes"]


class StatefulIterator:
    """An iterator object with its own state (the dataset itself keeps none)."""

    def __init__(self, worker: int) -> None:
        self.worker, self.next = worker, 0

    def __iter__(self) -> StatefulIterator:
        return self

    def __next__(self) -> int:
        if self.next >= 25:
            raise StopIteration
        self.next += 1
        return 100 * self.worker + self.next

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next = state["next"]


class IteratorStream(IterableDataset[int]):
    def __iter__(self) -> StatefulIterator:
        info = get_worker_info()
        return StatefulIterator(0 if info is None else info.id)


def _flat(batches: Any) -> list[int]:
    return [int(x) for batch in batches for x in batch]


def _json(state: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(json.dumps(state))
    return loaded


def _resumes_exactly(make: Callable[[], RayDataLoader], *, epoch: int, taken: int) -> None:
    """Saved after ``taken`` batches of ``epoch``: the rest of it, then the next epoch, as uninterrupted."""
    full = make()
    expected = [_flat(full) for _ in range(epoch + 2)]
    full.close()
    first = make()
    for _ in range(epoch):
        list(first)
    it = iter(first)
    before = _flat(next(it) for _ in range(taken))
    state = _json(first.state_dict())
    first.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert before + _flat(resumed) == expected[epoch]
    assert _flat(resumed) == expected[epoch + 1]
    resumed.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("every", [1, 3, None])
@pytest.mark.parametrize(
    ("num_workers", "persistent"),
    [(0, False), (2, False), (2, True)],
    ids=["0", "2", "2-persistent"],
)
@pytest.mark.parametrize("dataset", [Counting, Stream, IteratorStream])
def test_a_stateful_dataset_resumes_exactly(
    dataset: type, num_workers: int, persistent: bool, every: int | None
) -> None:
    def make() -> RayDataLoader:
        return RayDataLoader(
            dataset(),
            batch_size=4,
            num_workers=num_workers,
            persistent_workers=persistent,
            snapshot_every_n_steps=every,
        )

    _resumes_exactly(make, epoch=1 if persistent else 0, taken=5)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("dataset", [Counting, Stream])
def test_stateful_datasets_saved_between_epochs_go_on_as_uninterrupted(
    dataset: type, num_workers: int
) -> None:
    """The workers' datasets go on into the next epoch from their states (not their iterators')."""

    def make() -> RayDataLoader:
        persistent = num_workers > 0  # else each epoch's workers start from the trainer's copy
        return RayDataLoader(
            dataset(), batch_size=4, num_workers=num_workers, persistent_workers=persistent
        )

    full = make()
    expected = [_flat(full) for _ in range(2)]
    full.close()
    first = make()
    list(first)
    state = _json(first.state_dict())
    first.close()
    assert state["epoch_started"] is False and state["worker_snapshot"] is not None
    resumed = make()
    resumed.load_state_dict(state)
    assert _flat(resumed) == expected[1]
    resumed.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("every", "captures"), [(1, 1 + 6), (4, 1 + 3)])
def test_the_workers_state_is_captured_once_per_n_steps_per_worker(
    every: int, captures: int
) -> None:
    """12 batches on 2 workers (6 each): one capture at the epoch's start, then per schedule."""
    loader = RayDataLoader(Counting(), batch_size=4, num_workers=2, snapshot_every_n_steps=every)
    it = iter(loader)
    for _ in range(12):
        next(it)
    state = loader.state_dict()
    loader.close()
    snapshot = state["worker_snapshot"]
    assert snapshot["step"] == 12
    assert [s["dataset"]["captures"] for s in snapshot["states"]] == [captures, captures]


@pytest.mark.timeout(120)
def test_a_stateful_state_refuses_another_num_workers() -> None:
    loader = RayDataLoader(Counting(), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.close()
    other = RayDataLoader(Counting(), batch_size=4, num_workers=3)
    other.load_state_dict(state)
    with pytest.raises(
        NumWorkersMismatchError,
        match=r"saved with num_workers=2, but this loader has num_workers=3\. The dataset is "
        r"Stateful",
    ):
        iter(other)  # an AssertionError too, as torchdata's
    other.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("every", "error", "message"),
    [
        (-1, ValueError, r"snapshot_every_n_steps should be non-negative, got -1"),
        ("2", TypeError, r"snapshot_every_n_steps should be an int or None, got '2'"),
    ],
)
def test_a_bad_snapshot_every_n_steps_is_refused(every: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        RayDataLoader(Counting(), snapshot_every_n_steps=every)


class EpochSampler(Sampler[int]):
    """A custom sampler with its own state: each pass's order comes from its own counter."""

    def __init__(self) -> None:
        self.passes = 0

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        order = np.random.RandomState(self.passes).permutation(N).tolist()
        self.passes += 1
        return iter(order)

    def state_dict(self) -> dict[str, int]:
        return {"passes": self.passes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.passes = state["passes"]


class Plain(Dataset[int]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.timeout(120)
@pytest.mark.parametrize("taken", [5, None], ids=["mid-epoch", "between-epochs"])
def test_a_stateful_sampler_resumes_its_own_order(taken: int | None) -> None:
    def make() -> RayDataLoader:
        return RayDataLoader(Plain(), batch_size=4, sampler=EpochSampler(), num_workers=0)

    if taken is None:
        full = make()
        expected = [_flat(full) for _ in range(3)]
        first = make()
        list(first)
        state = _json(first.state_dict())
        resumed = make()
        resumed.load_state_dict(state)
        assert [_flat(resumed) for _ in range(2)] == expected[1:]
    else:
        _resumes_exactly(make, epoch=1, taken=taken)
