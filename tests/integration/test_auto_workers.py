"""``num_workers="auto"`` / ``prefetch_factor="auto"`` on real Ray actors (own module: its own Ray).

The rule itself is unit-tested without Ray (tests/unit/test_autotune.py); here: it
grows a real pool on a dataset whose ``__getitem__`` sleeps, stays within its
budget, and never changes which samples come in which order, nor a resume.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import ray
import torch
from _datasets import SlowWorkerData, TensorData
from torch.utils.data import BatchSampler, RandomSampler

from raydl import RayDataLoader


def _indices(batches: Any) -> list[list[int]]:
    return [b["index"].tolist() if isinstance(b, dict) else b[:, 0].int().tolist() for b in batches]


def _torch_order(n: int, epochs: int, seed: int, batch_size: int) -> list[list[list[int]]]:
    """torch's batches with persistent workers: the sampler's iterator, then one base-seed draw."""
    generator = torch.Generator().manual_seed(seed)
    sampler = BatchSampler(RandomSampler(range(n), generator=generator), batch_size, False)
    out = []
    for epoch in range(epochs):
        indices = iter(sampler)
        if epoch == 0:  # torch draws its workers' base seed once, at the first iter()
            torch.empty((), dtype=torch.int64).random_(generator=generator)
        out.append([list(b) for b in indices])
    return out


@pytest.mark.timeout(120)
def test_auto_grows_a_starved_pool_within_its_budget_and_keeps_torchs_order() -> None:
    # 4 ms of sleep per sample, 8 per batch: one worker delivers ~30 batches/s to a
    # trainer that takes them at once; sleeping workers share 2 CPUs without contention.
    dataset = SlowWorkerData(480, delay=0.004)
    loader = RayDataLoader(
        dataset,
        batch_size=8,
        shuffle=True,
        num_workers="auto",
        persistent_workers=True,
        generator=torch.Generator().manual_seed(7),
        cpu_budget=3,
    )
    epochs: list[list[Any]] = []
    while len(epochs) < 3 or (loader.stats()["autotune"]["workers"] == 1 and len(epochs) < 10):
        epochs.append(list(loader))  # more epochs only where actors start slowly (a busy machine)
    report = loader.stats()["autotune"]
    loader.close()

    assert report["budget"] == 3
    assert 1 < report["workers"] <= 3, report
    grows = [c for c in report["changes"] if c["reason"].startswith("starved: grow")]
    assert grows and all(c["workers"] <= 3 for c in report["changes"]), report["changes"]
    assert grows[0]["stall"] > 0.02
    # Every batch in torch's order, each sample exactly once per epoch, whoever loaded it.
    assert [_indices(e) for e in epochs] == _torch_order(
        len(dataset), len(epochs), seed=7, batch_size=8
    )
    workers = {w for e in epochs for b in e for w in b["worker"].tolist()}
    assert len(workers) > 1 and workers <= {0, 1, 2}
    # get_worker_info() counts the budget, whatever is in use.
    assert {n for e in epochs for b in e for n in b["num_workers"].tolist()} == {3}
    assert json.loads(json.dumps(report)) == report  # stats() stays JSON-able


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent", [True, False])
def test_resume_with_auto_gives_the_sequence_of_a_fixed_count(persistent: bool) -> None:
    dataset = SlowWorkerData(240, delay=0.003)

    def make(num_workers: int | str, prefetch: int | str | None = None) -> RayDataLoader:
        return RayDataLoader(
            dataset,
            batch_size=6,
            shuffle=True,
            num_workers=num_workers,
            prefetch_factor=prefetch,
            persistent_workers=persistent,
            generator=torch.Generator().manual_seed(3),
            cpu_budget=2,
        )

    fixed = make(2)
    whole = [_indices(fixed) for _ in range(2)]
    fixed.close()

    auto = make("auto", "auto")
    first = _indices(auto)
    it = iter(auto)
    head = _indices(next(it) for _ in range(13))  # mid-epoch, while the pool may be growing
    state = json.loads(json.dumps(auto.state_dict()))
    auto.close()
    assert [first, head] == [whole[0], whole[1][:13]]

    resumed = make("auto", "auto")
    resumed.load_state_dict(state)
    tail = _indices(resumed)
    resumed.close()
    assert head + tail == whole[1]
    assert resumed.stats()["epochs"][0]["batches"] == len(whole[1]) - 13


@pytest.mark.timeout(60)
def test_a_fed_trainer_keeps_one_worker() -> None:
    # A trainer slower than one worker: the rule never grows the pool.
    loader = RayDataLoader(TensorData(64), batch_size=4, num_workers="auto", cpu_budget=2)
    for _ in loader:
        import time

        time.sleep(0.03)
    report = loader.stats()["autotune"]
    loader.close()
    assert report["workers"] == 1
    assert not [c for c in report["changes"] if c["reason"].startswith("starved")], report


@pytest.mark.timeout(60)
def test_auto_for_a_ray_data_source_is_ignored_as_num_workers_is() -> None:
    loader = RayDataLoader(
        ray.data.range(20), batch_size=5, num_workers="auto", prefetch_factor="auto"
    )
    assert sorted(i for b in loader for i in b["id"].tolist()) == list(range(20))
    assert "autotune" not in loader.stats()
    loader.close()
