"""Exact resume at every moment a checkpoint can be taken, in the set-ups users run.

Each test compares a resumed loader with an uninterrupted one built the same way:
the resumed epoch must deliver exactly the uninterrupted epoch's remaining batches,
in its order, and the next epoch must be the uninterrupted next epoch. A fresh
training process is stood in for by re-seeding torch's RNG (and the generator)
before the resumed loader is built, as a restarted script does.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from raydl import NumWorkersMismatchError, RayDataLoader, StateMismatchError

N = 60


class Items(Dataset[int]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        return index


class Sharded(IterableDataset[int]):
    """Each worker yields its own share of ``range(N)``, as torch's docs advise."""

    def __iter__(self) -> Any:
        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        return iter(range(worker, N, workers))


def _flat(batches: Any) -> list[int]:
    return [int(x) for batch in batches for x in batch]


def _json(state: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(json.dumps(state))
    return loaded


def _maker(
    persistent: bool, with_generator: bool, num_workers: int = 2
) -> Callable[[], RayDataLoader]:
    """Builds the loader a restarted script would build: torch and its generator seeded anew."""

    def make() -> RayDataLoader:
        torch.manual_seed(0)
        generator = torch.Generator().manual_seed(7) if with_generator else None
        return RayDataLoader(
            Items(),
            batch_size=5,
            shuffle=True,
            num_workers=num_workers,
            persistent_workers=persistent,
            generator=generator,
        )

    return make


def _resumed(
    make: Callable[[], RayDataLoader], state: dict[str, Any], epochs: int
) -> list[list[int]]:
    """The next ``epochs`` epochs of a new loader that loaded ``state``."""
    resumed = make()
    resumed.load_state_dict(state)
    try:
        return [_flat(resumed) for _ in range(epochs)]
    finally:
        resumed.close()


def _uninterrupted(make: Callable[[], RayDataLoader], epochs: int) -> list[list[int]]:
    loader = make()
    try:
        return [_flat(loader) for _ in range(epochs)]
    finally:
        loader.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("with_generator", [False, True], ids=["global-rng", "generator"])
@pytest.mark.parametrize("epoch", [0, 1])
def test_persistent_workers_resume_mid_epoch_exactly(epoch: int, with_generator: bool) -> None:
    """The README's set-up: shuffle, 2 workers, persistent workers; saved mid-epoch."""
    make = _maker(persistent=True, with_generator=with_generator)
    expected = _uninterrupted(make, epoch + 2)
    first = make()
    for _ in range(epoch):
        list(first)
    it = iter(first)
    before = _flat(next(it) for _ in range(4))
    state = _json(first.state_dict())
    first.close()
    resumed = make()
    resumed.load_state_dict(state)
    rest = _flat(resumed)
    after = _flat(resumed)
    resumed.close()
    assert before + rest == expected[epoch]
    assert sorted(before + rest) == list(range(N))  # each sample once
    assert after == expected[epoch + 1]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("persistent", [False, True])
def test_state_taken_right_after_a_load_is_the_loaded_state(persistent: bool) -> None:
    make = _maker(persistent=persistent, with_generator=False)
    expected = _uninterrupted(make, 2)
    first = make()
    it = iter(first)
    before = _flat(next(it) for _ in range(3))
    saved = _json(first.state_dict())
    first.close()
    middle = make()
    middle.load_state_dict(saved)
    again = _json(middle.state_dict())  # a checkpoint right after the resume, before iter()
    middle.close()
    assert again == saved
    resumed = make()
    resumed.load_state_dict(again)
    assert before + _flat(resumed) == expected[0]
    assert _flat(resumed) == expected[1]
    resumed.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("num_workers", "persistent"),
    [(0, False), (2, False), (2, True)],
    ids=["0", "2", "2-persistent"],
)
def test_state_at_batch_zero_resumes_that_epoch_in_its_order(
    num_workers: int, persistent: bool
) -> None:
    make = _maker(persistent=persistent, with_generator=False, num_workers=num_workers)
    expected = _uninterrupted(make, 3)
    first = make()
    list(first)  # epoch 0
    iter(first)  # epoch 1 started, nothing taken yet
    state = _json(first.state_dict())
    first.close()
    assert (state["epoch"], state["batches_consumed"], state["epoch_started"]) == (1, 0, True)
    assert _resumed(make, state, 2) == expected[1:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("with_generator", [False, True], ids=["global-rng", "generator"])
@pytest.mark.parametrize("persistent", [False, True])
def test_state_between_epochs_goes_on_with_the_next_epochs_order(
    persistent: bool, with_generator: bool
) -> None:
    make = _maker(persistent=persistent, with_generator=with_generator)
    expected = _uninterrupted(make, 3)
    assert expected[0] != expected[1]  # the test can tell the epochs apart
    first = make()
    list(first)  # epoch 0, whole
    state = _json(first.state_dict())
    first.close()
    assert (state["epoch"], state["batches_consumed"], state["epoch_started"]) == (1, 0, False)
    assert _resumed(make, state, 2) == expected[1:]


@pytest.mark.timeout(120)
def test_state_before_the_first_iter_resumes_epoch_zero() -> None:
    make = _maker(persistent=True, with_generator=False)
    expected = _uninterrupted(make, 1)
    fresh = make()
    state = _json(fresh.state_dict())
    fresh.close()
    assert (state["epoch"], state["epoch_started"]) == (0, False)
    resumed = make()
    torch.manual_seed(123)  # draws after the save but before the load do not change the order
    resumed.load_state_dict(state)
    assert _flat(resumed) == expected[0]
    resumed.close()


@pytest.mark.timeout(120)
def test_iterable_state_refuses_another_num_workers_mid_epoch() -> None:
    loader = RayDataLoader(Sharded(), batch_size=4, num_workers=3)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.close()
    assert state["num_workers"] == 3
    fewer = RayDataLoader(Sharded(), batch_size=4, num_workers=2)
    fewer.load_state_dict(state)  # refused by the next iter(), where torchdata refuses it
    with pytest.raises(
        NumWorkersMismatchError,
        match=r"saved mid-epoch with num_workers=3, but this loader has num_workers=2.*"
        r"build the loader with num_workers=3",
    ):
        iter(fewer)
    assert sorted(_flat(fewer)) == list(range(N))  # nothing of the state was applied
    fewer.close()


@pytest.mark.timeout(120)
def test_iterable_state_between_epochs_takes_another_num_workers() -> None:
    loader = RayDataLoader(Sharded(), batch_size=4, num_workers=3)
    list(loader)
    state = loader.state_dict()
    loader.close()
    fewer = RayDataLoader(Sharded(), batch_size=4, num_workers=2)
    fewer.load_state_dict(state)  # the next epoch starts afresh on 2 workers
    assert sorted(_flat(fewer)) == list(range(N))
    fewer.close()


@pytest.mark.timeout(120)
def test_iterable_resume_with_the_same_num_workers_is_exact() -> None:
    def make() -> RayDataLoader:
        return RayDataLoader(Sharded(), batch_size=4, num_workers=3)

    expected = _uninterrupted(make, 1)[0]
    loader = make()
    it = iter(loader)
    before = _flat(next(it) for _ in range(4))
    state = _json(loader.state_dict())
    loader.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert before + _flat(resumed) == expected
    resumed.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("version", [2, 3])
def test_older_state_versions_resume_exactly(version: int) -> None:
    make = _maker(persistent=False, with_generator=True)
    expected = _uninterrupted(make, 1)[0]
    first = make()
    it = iter(first)
    before = _flat(next(it) for _ in range(3))
    state = _json(first.state_dict())
    first.close()
    old = {k: v for k, v in state.items() if k not in {"epoch_started", "num_workers"}}
    resumed = make()
    resumed.load_state_dict({**old, "version": version})
    assert before + _flat(resumed) == expected
    resumed.close()


@pytest.mark.timeout(60)
def test_a_newer_state_version_is_refused_naming_the_versions_readable() -> None:
    loader = RayDataLoader(Items(), batch_size=5)
    state = {**loader.state_dict(), "version": 5}
    with pytest.raises(
        StateMismatchError, match=r"state version 5 is not supported: this raydl reads versions"
    ):
        loader.load_state_dict(state)


class Gated(Dataset[int]):
    """Item 0 waits until ``gate`` exists (at most a minute): a batch slower than the rest."""

    def __init__(self, gate: str) -> None:
        self.gate = gate

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> int:
        if index == 0:
            deadline = time.monotonic() + 60
            while not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.01)
        return index


def _gated_loader(gate: str) -> RayDataLoader:
    return RayDataLoader(
        Gated(gate), batch_size=2, num_workers=2, in_order=False, persistent_workers=True
    )


@pytest.mark.timeout(180)
def test_in_order_false_delivers_ready_batches_before_a_slow_one(tmp_path: Any) -> None:
    """torch's rule: the slow batch's worker gets no more requests until it catches up."""
    gate = str(tmp_path / "gate")
    loader = _gated_loader(gate)
    it = iter(loader)
    early = [int(next(it)[0]) // 2 for _ in range(8)]  # batch positions, while batch 0 waits
    pathlib.Path(gate).touch()
    late = [int(batch[0]) // 2 for batch in it]
    loader.close()
    # Batch 2 went to batch 0's worker before anyone knew it was slow; nothing else waits.
    assert sorted(early) == [1, 3, 4, 5, 6, 7, 8, 9]
    assert sorted(early + late) == list(range(20))


@pytest.mark.timeout(180)
def test_in_order_false_state_resumes_exactly_the_batches_not_delivered(tmp_path: Any) -> None:
    gate = str(tmp_path / "gate")
    loader = _gated_loader(gate)
    it = iter(loader)
    early = [int(x) for _ in range(6) for x in next(it)]
    state = _json(loader.state_dict())
    pathlib.Path(gate).touch()
    loader.close()
    assert state["batches_consumed"] == 6
    assert 0 not in early and state["delivered_ahead"] == sorted({x // 2 for x in early})
    resumed = _gated_loader(gate)
    resumed.load_state_dict(state)
    rest = _flat(resumed)
    resumed.close()
    assert sorted(early + rest) == list(range(40))  # each sample once


@pytest.mark.timeout(60)
def test_in_order_false_state_refuses_another_world_size() -> None:
    loader = RayDataLoader(Items(), batch_size=5, num_workers=1, in_order=False)
    it = iter(loader)
    next(it)
    state = {**loader.state_dict(), "delivered_ahead": [3], "world_size": 2, "progress": [[2, 1]]}
    loader.close()
    with pytest.raises(StateMismatchError, match=r"saved with world size 2, but this loader has"):
        RayDataLoader(Items(), batch_size=5).load_state_dict(state)


class Augmented(Dataset[int]):
    """Each item draws from the worker's global torch RNG, as random augmentation does."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> int:
        return 1000 * index + int(torch.randint(1000, ()).item())


@pytest.mark.timeout(180)
def test_persistent_workers_saved_between_epochs_go_on_drawing_where_they_were() -> None:
    """A persistent worker's RNGs run on across epochs: a resume restores them, not reseeds."""

    def make() -> RayDataLoader:
        torch.manual_seed(0)
        return RayDataLoader(Augmented(), batch_size=4, num_workers=2, persistent_workers=True)

    expected = _uninterrupted(make, 2)
    first = make()
    list(first)
    state = _json(first.state_dict())
    first.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert _flat(resumed) == expected[1]
    resumed.close()
