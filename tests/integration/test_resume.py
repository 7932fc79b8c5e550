"""state_dict / load_state_dict: exact resume in one process (own module: its own Ray).

The SIGKILL tests with real trainer processes and several ranks live in
tests/multirank/test_resume_kill.py.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import ray
import torch
from torch.utils.data import Dataset, IterableDataset

from raydl import PerEpoch, RayDataLoader, StateMismatchError, World

N = 50


class Squares(Dataset[int]):
    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(N))


def _flat(batches: Any) -> list[int]:
    out: list[int] = []
    for batch in batches:
        out.extend((batch["id"] if isinstance(batch, dict) else batch).tolist())
    return out


def _take(iterator: Any, k: int) -> list[Any]:
    return [next(iterator) for _ in range(k)]


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(json.dumps(state))  # JSON-able
    return loaded


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent", [False, True])
def test_map_style_resume_is_exact(persistent: bool) -> None:
    def make() -> RayDataLoader:
        return RayDataLoader(
            Squares(),
            batch_size=4,
            shuffle=True,
            num_workers=2,
            generator=torch.Generator().manual_seed(1),
            persistent_workers=persistent,
        )

    full = make()
    epochs = [_flat(full) for _ in range(3)]
    first = make()
    list(first)  # epoch 0
    it = iter(first)
    before = _flat(_take(it, 5))
    state = _roundtrip(first.state_dict())
    assert state["epoch"] == 1 and state["batches_consumed"] == 5
    resumed = make()
    resumed.load_state_dict(state)
    assert before + _flat(resumed) == epochs[1]  # the rest of epoch 1, in order
    assert _flat(resumed) == epochs[2]  # the next epoch as if never interrupted


@pytest.mark.timeout(120)
def test_iterable_resume_is_exact() -> None:
    loader = RayDataLoader(Stream(), batch_size=6, num_workers=2)
    it = iter(loader)
    before = _flat(_take(it, 3))
    resumed = RayDataLoader(Stream(), batch_size=6, num_workers=2)
    resumed.load_state_dict(_roundtrip(loader.state_dict()))
    expected = _flat(RayDataLoader(Stream(), batch_size=6, num_workers=2))
    assert before + _flat(resumed) == expected


def _keep_by_epoch(batch: dict[str, np.ndarray], epoch: int) -> dict[str, np.ndarray]:
    keep = (batch["id"] * 7 + epoch) % 4 != 0
    return {"id": batch["id"][keep]}


def _pipeline() -> PerEpoch:
    base = ray.data.range(400, override_num_blocks=8)
    return PerEpoch(lambda epoch: base.map_batches(_keep_by_epoch, fn_kwargs={"epoch": epoch}))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["global", "blocks"])
def test_ray_data_resume_is_exact(mode: str) -> None:
    def make() -> RayDataLoader:
        return RayDataLoader(_pipeline(), batch_size=16, shuffle=True, shuffle_mode=mode, seed=4)

    full = make()
    epochs = [_flat(full) for _ in range(2)]
    interrupted = make()
    it = iter(interrupted)
    before = _flat(_take(it, 7))
    state = _roundtrip(interrupted.state_dict())
    interrupted.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert before + _flat(resumed) == epochs[0]
    assert _flat(resumed) == epochs[1]
    assert resumed.stats()["epochs"][0]["batches"] == len(epochs[0]) // 16 + 1 - 7


@pytest.mark.timeout(60)
def test_state_between_epochs_starts_the_next_epoch() -> None:
    loader = RayDataLoader(Squares(), batch_size=5, shuffle=True, generator=torch.Generator())
    list(loader)
    state = loader.state_dict()
    assert (state["epoch"], state["batches_consumed"], state["progress"]) == (1, 0, None)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 99}, r"state version 99 is not supported"),
        ({"dataset_len": 7}, r"saved with dataset length 7, but this loader has dataset length 50"),
        ({"seed": 5}, r"saved with seed 5, but this loader has seed 0"),
        ({"batch_size": 8}, r"saved with batch size 8, but this loader has batch size 4"),
        ({"kind": "ray"}, r"saved with dataset kind 'ray', but this loader has dataset kind 'map'"),
    ],
)
def test_mismatched_state_names_both_values(change: dict[str, Any], message: str) -> None:
    loader = RayDataLoader(Squares(), batch_size=4)
    it = iter(loader)
    next(it)
    state = {**loader.state_dict(), **change}
    with pytest.raises(StateMismatchError, match=message):
        RayDataLoader(Squares(), batch_size=4).load_state_dict(state)


@pytest.mark.timeout(60)
def test_iterable_state_cannot_change_world_size() -> None:
    loader = RayDataLoader(Stream(), batch_size=4)
    next(iter(loader))
    state = {**loader.state_dict(), "world_size": 2, "progress": [[2, 1]]}
    with pytest.raises(StateMismatchError, match=r"saved with world size 2, but this loader has"):
        RayDataLoader(Stream(), batch_size=4).load_state_dict(state)


@pytest.mark.timeout(60)
def test_version_1_state_still_loads() -> None:
    loader = RayDataLoader(Squares(), batch_size=4, generator=torch.Generator().manual_seed(3))
    it = iter(loader)
    before = _flat(_take(it, 2))
    state = loader.state_dict()
    old = {k: state[k] for k in state if k not in {"batch_size", "drop_last", "progress", "order"}}
    resumed = RayDataLoader(Squares(), batch_size=4, generator=torch.Generator().manual_seed(3))
    resumed.load_state_dict({**old, "version": 1})
    assert before + _flat(resumed) == list(range(N))


def _ranks(world_size: int, **kwargs: Any) -> list[RayDataLoader]:
    """One loader per rank of a hand-built world, in this process (map-style needs no collective)."""
    address = ray.get_runtime_context().gcs_address
    return [
        RayDataLoader(
            Squares(),
            batch_size=4,
            shuffle=True,
            seed=11,
            ray_address=address,
            world=World(rank, world_size),
            **kwargs,
        )
        for rank in range(world_size)
    ]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("old", "new"), [(2, 1), (1, 2), (2, 3), (3, 2)])
def test_map_style_elastic_resume_delivers_the_rest_exactly_once(old: int, new: int) -> None:
    if old == 1:
        before_loaders = [
            RayDataLoader(
                Squares(), batch_size=4, shuffle=True, seed=11, generator=torch.Generator()
            )
        ]
    else:
        before_loaders = _ranks(old)
    iterators = [iter(loader) for loader in before_loaders]
    consumed = [x for it in iterators for x in _flat(_take(it, 3))]
    states = [_roundtrip(loader.state_dict()) for loader in before_loaders]
    assert all(s["progress"] == [[old, 3]] for s in states)
    after_loaders = (
        [RayDataLoader(Squares(), batch_size=4, shuffle=True, seed=11, generator=torch.Generator())]
        if new == 1
        else _ranks(new)
    )
    rest = []
    for loader in after_loaders:
        loader.load_state_dict(states[0])  # every rank loads rank 0's state
        rest.append([b.tolist() for b in loader])
    assert len({len(batches) for batches in rest}) == 1  # equal batch counts
    delivered = consumed + [x for batches in rest for batch in batches for x in batch]
    padding = len(delivered) - N
    assert set(delivered) == set(range(N))  # nothing missing
    assert 0 <= padding < max(old, new)  # repeats only where counts forced padding
    # the epoch after uses the new sharding: a DistributedSampler (or RandomSampler) epoch
    nxt = [x for loader in after_loaders for x in _flat(loader)]
    assert set(nxt) == set(range(N))
