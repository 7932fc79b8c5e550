"""RayDataLoader over torch datasets: workers, errors, timeouts, early exit, worker deaths."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray
import torch
from _datasets import (
    DieOnceData,
    FailingData,
    PoisonData,
    SlowData,
    StreamData,
    TensorData,
    WorkerInfoData,
    failing_collate,
    record_worker_init,
)
from torch.utils.data import DataLoader, Sampler

import raydl
from raydl import RayDataLoader


def _ids(batches: list[torch.Tensor]) -> list[int]:
    return [int(i) for b in batches for i in b[:, 0].tolist()]


def _wait_until(predicate, timeout: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


# ------------------------------------------------------------------ workers


@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_workers", [1, 2])
def test_worker_init_fn_and_worker_info_run_in_ray_workers(num_workers: int) -> None:
    loader = RayDataLoader(
        WorkerInfoData(12),
        batch_size=2,
        num_workers=num_workers,
        worker_init_fn=record_worker_init,
        generator=torch.Generator().manual_seed(0),
    )
    rows = [
        {k: int(v[i]) for k, v in batch.items()}
        for batch in loader
        for i in range(len(batch["index"]))
    ]
    assert sorted(r["index"] for r in rows) == list(range(12))
    expected_workers = max(1, num_workers)
    assert all(r["pid"] != os.getpid() for r in rows)
    assert all(r["num_workers"] == expected_workers for r in rows)
    assert {r["worker"] for r in rows} == set(range(expected_workers))
    # worker_init_fn ran in the same process as the worker that loaded the sample
    assert all(r["init_pid"] == r["pid"] and r["init_worker"] == r["worker"] for r in rows)
    by_worker = {r["worker"]: r for r in rows}
    assert len({by_worker[w]["pid"] for w in by_worker}) == expected_workers
    # torch's seeds: base_seed + worker_id
    seeds = {r["worker"]: r["seed"] for r in rows}
    assert {seeds[w] - seeds[0] for w in seeds} == set(range(expected_workers))


# ------------------------------------------------------------------ errors


@pytest.mark.timeout(90)
@pytest.mark.parametrize("error", [ValueError, KeyError, IndexError])
def test_getitem_error_is_reraised_with_type_and_indices(error: type[Exception]) -> None:
    loader = RayDataLoader(
        FailingData(12, bad=7, error=error), batch_size=3, num_workers=1, persistent_workers=True
    )
    with pytest.raises(error) as info:
        list(loader)
    message = str(info.value)
    assert "sample 7 is corrupt" in message
    assert "[6, 7, 8]" in message
    loader.close()


@pytest.mark.timeout(90)
def test_collate_error_is_reraised_with_type_and_indices() -> None:
    # On a Ray worker (num_workers=0 loads in this process, where torch names no indices).
    loader = RayDataLoader(TensorData(6), batch_size=2, num_workers=1, collate_fn=failing_collate)
    with pytest.raises(KeyError, match="collate cannot handle this batch") as info:
        next(iter(loader))
    assert "[0, 1]" in str(info.value)
    loader.close()


@pytest.mark.timeout(90)
def test_loader_usable_after_an_error() -> None:
    loader = RayDataLoader(
        FailingData(6, bad=5), batch_size=2, num_workers=1, persistent_workers=True
    )
    with pytest.raises(ValueError):
        list(loader)
    iterator = iter(loader)
    assert _ids([next(iterator), next(iterator)]) == [0, 1, 2, 3]
    loader.close()


@pytest.mark.timeout(90)
def test_timeout_with_slow_getitem() -> None:
    loader = RayDataLoader(SlowData(4, delay=30), batch_size=1, num_workers=1, timeout=2)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^DataLoader timed out after 2 seconds$") as info:
        next(iter(loader))
    assert isinstance(info.value, raydl.LoaderTimeoutError)
    assert time.monotonic() - started < 20
    loader.close()


@pytest.mark.timeout(90)
def test_timeout_bounds_the_trainers_wait_not_a_batchs_load_time() -> None:
    # torch's timeout is how long next() waits. Batches that take longer than that to
    # load, while the trainer is busy with its step, arrive in time: no error.
    loader = RayDataLoader(SlowData(4, delay=1.2), batch_size=1, num_workers=1, timeout=1)
    it = iter(loader)
    time.sleep(6)  # the workers start and load the first prefetch_factor batches
    got = []
    for batch in it:
        got.append(int(batch[0, 0]))
        time.sleep(2.0)  # a step longer than a batch's load
    assert got == [0, 1, 2, 3]
    loader.close()


# ------------------------------------------------------------------ early exit


@pytest.mark.timeout(90)
def test_abandoned_iterator_then_full_epoch() -> None:
    loader = RayDataLoader(TensorData(10), batch_size=3, num_workers=2, persistent_workers=True)
    first = next(iter(loader))
    assert _ids([first]) == [0, 1, 2]
    assert _ids(list(loader)) == list(range(10))
    assert _ids(list(loader)) == list(range(10))
    loader.close()


@pytest.mark.timeout(90)
def test_abandoned_iterator_non_persistent() -> None:
    loader = RayDataLoader(TensorData(10), batch_size=3, num_workers=1)
    assert _ids([next(iter(loader))]) == [0, 1, 2]
    assert _ids(list(loader)) == list(range(10))
    assert loader._source._pool is None


@pytest.mark.timeout(120)
def test_break_releases_non_persistent_workers() -> None:
    options = {"num_cpus": 1}  # so the actors show up in available_resources
    loader = RayDataLoader(  # every batch from the actor, whose process this test follows
        WorkerInfoData(20),
        batch_size=2,
        num_workers=1,
        worker_options=options,
        start_in_process=False,
    )
    pids = set()
    for i, batch in enumerate(loader):
        pids.update(batch["pid"].tolist())
        if i == 0:
            assert _wait_until(lambda: ray.available_resources().get("CPU", 0) <= 1.0)
            break
    assert len(pids) == 1
    # the next epoch closes the abandoned one and starts fresh workers
    epoch = list(loader)
    assert sorted(i for b in epoch for i in b["index"].tolist()) == list(range(20))
    assert loader._source._pool is None
    assert _wait_until(lambda: ray.available_resources().get("CPU", 0) == 2.0)
    assert _wait_until(lambda: not any(psutil.pid_exists(p) for p in pids))


@pytest.mark.timeout(90)
def test_close_releases_workers() -> None:
    loader = RayDataLoader(
        WorkerInfoData(8),
        batch_size=2,
        num_workers=1,
        persistent_workers=True,
        worker_options={"num_cpus": 1},
        start_in_process=False,  # every batch from the actor, whose process this test follows
    )
    pids = {next(iter(loader))["pid"][0].item()}
    list(loader)
    assert loader._source._pool is not None  # persistent: kept between epochs
    loader.close()
    assert loader._source._pool is None
    assert _wait_until(lambda: ray.available_resources().get("CPU", 0) == 2.0)
    assert _wait_until(lambda: not any(psutil.pid_exists(p) for p in pids))


@pytest.mark.timeout(90)
def test_persistent_workers_keep_their_process() -> None:
    loader = RayDataLoader(  # every batch from the actor (none loaded in the trainer)
        WorkerInfoData(4),
        batch_size=2,
        num_workers=1,
        persistent_workers=True,
        start_in_process=False,
    )
    pids = [{p for b in loader for p in b["pid"].tolist()} for _ in range(2)]
    assert pids[0] == pids[1] and os.getpid() not in pids[0]
    loader.close()


@pytest.mark.timeout(90)
def test_two_iterators_at_once_like_torch() -> None:
    # torch gives independent iterators for non-persistent workers: zip(loader, loader) works.
    data = TensorData(6)
    expected = [
        (a.tolist(), b.tolist())
        for a, b in zip(DataLoader(data, batch_size=2), DataLoader(data, batch_size=2), strict=True)
    ]
    loader = RayDataLoader(data, batch_size=2)
    got = [(a.tolist(), b.tolist()) for a, b in zip(loader, loader, strict=False)]
    loader.close()
    assert got == expected


@pytest.mark.timeout(90)
def test_iterable_dataset_early_exit_then_full_epoch() -> None:
    loader = RayDataLoader(StreamData(10), batch_size=3, num_workers=2, persistent_workers=True)
    next(iter(loader))
    epoch = [int(x) for b in loader for x in b.tolist()]
    assert sorted(epoch) == list(range(10))
    loader.close()


class _CountingSampler(Sampler[int]):
    """``range(n)``, counting how many indices were drawn and on which threads."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.drawn = 0
        self.threads: set[str] = set()

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            self.drawn += 1
            self.threads.add(threading.current_thread().name)
            yield i


@pytest.mark.timeout(120)
def test_the_sampler_is_drawn_on_the_trainers_thread_as_far_ahead_as_torchs() -> None:
    # A sampler drawing from torch's global RNG must draw in the same order relative to
    # the training loop as under torch: on the trainer's thread, num_workers *
    # prefetch_factor batches ahead, one more batch per batch taken. Real torch worker
    # processes (spawned: this process runs a Ray driver).
    args: dict[str, Any] = {"batch_size": 2, "num_workers": 2, "prefetch_factor": 2}
    drawn: dict[str, list[int]] = {}
    for name, cls in (("torch", DataLoader), ("raydl", RayDataLoader)):
        sampler = _CountingSampler(40)
        extra = {"multiprocessing_context": "spawn"} if name == "torch" else {}
        loader = cls(torch.arange(40), sampler=sampler, **args, **extra)
        it = iter(loader)
        drawn[name] = [sampler.drawn]
        for _ in range(3):
            next(it)
            drawn[name].append(sampler.drawn)
        del it
        if name == "raydl":
            assert sampler.threads == {threading.current_thread().name}
            loader.close()
    assert drawn["raydl"] == drawn["torch"] == [8, 10, 12, 14]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("iterable", [False, True])
def test_a_batch_is_taken_without_a_ray_call_on_the_trainers_thread(
    iterable: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After a training step the next batch should be waiting in a queue: a Ray call
    # made right after a pause costs ~1 ms of wake-ups on a small VM. The workers'
    # results are collected by the epoch's fetch thread.
    callers: list[str] = []
    for name in ("get", "wait"):
        original = getattr(ray, name)

        def recording(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            callers.append(threading.current_thread().name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(ray, name, recording)
    data = StreamData(40) if iterable else TensorData(40)
    loader = RayDataLoader(data, batch_size=4, num_workers=2, persistent_workers=True)
    it = iter(loader)
    callers.clear()  # starting an iterable epoch waits for the workers, as torch's does
    assert sum(len(batch) for batch in it) == 40
    assert callers, "the fetch thread's ray.get calls should have been recorded"
    assert threading.current_thread().name not in callers
    loader.close()


@pytest.mark.timeout(90)
def test_an_iterable_epoch_resumed_past_its_end_is_simply_over() -> None:
    # The stream is shorter than when the state was saved: the resume discards what
    # there is and the epoch is over (StopIteration, as from an exhausted torch
    # iterator); the next epoch is whole.
    saved = RayDataLoader(StreamData(12), batch_size=2, num_workers=2)
    it = iter(saved)
    for _ in range(4):
        next(it)
    state = saved.state_dict()
    saved.close()
    short = RayDataLoader(StreamData(4), batch_size=2, num_workers=2)
    short.load_state_dict(state)
    assert list(short) == []
    assert sorted(int(x) for b in short for x in b.tolist()) == [0, 1, 2, 3]
    short.close()


# ------------------------------------------------------------------ torch's RNG protocol


@pytest.mark.timeout(120)
def test_persistent_workers_draw_rng_like_torch() -> None:
    # torch draws the workers' base seed from `generator` once, when it creates the
    # persistent workers; later epochs draw only the sampler's permutation. Real
    # torch worker processes (spawned, not forked: this process runs a Ray driver).
    data = torch.arange(16)
    torch_loader = DataLoader(
        data,
        batch_size=4,
        shuffle=True,
        num_workers=1,
        persistent_workers=True,
        multiprocessing_context="spawn",
        generator=torch.Generator().manual_seed(3),
    )
    expected = [[b.tolist() for b in torch_loader] for _ in range(3)]
    loader = RayDataLoader(
        data,
        batch_size=4,
        shuffle=True,
        num_workers=1,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(3),
    )
    got = [[b.tolist() for b in loader] for _ in range(3)]
    loader.close()
    assert got[0] == expected[0]
    assert got == expected


# ------------------------------------------------------------------ dying workers


@pytest.mark.timeout(120)
def test_poison_sample_raises_worker_died_error() -> None:
    # On the actor from the first batch: loaded in the trainer while the actor starts
    # (start_in_process), the poison would end this process, as with num_workers=0.
    loader = RayDataLoader(
        PoisonData(8, poison=5), batch_size=2, num_workers=1, start_in_process=False
    )
    started = time.monotonic()
    with pytest.raises(raydl.WorkerDiedError, match=r"\[4, 5\]"):
        list(loader)
    assert time.monotonic() - started < 100
    loader.close()


@pytest.mark.timeout(120)
def test_worker_killed_once_delivers_every_sample_once(tmp_path: Path) -> None:
    data = DieOnceData(20, victim=9, marker=tmp_path / "died")
    loader = RayDataLoader(
        data, batch_size=3, num_workers=2, persistent_workers=True, start_in_process=False
    )  # every batch on the actors (see above)
    epoch = list(loader)
    assert (tmp_path / "died").exists()  # the worker really died
    assert _ids(epoch) == list(range(20))  # in order, nothing lost, nothing twice
    assert _ids(list(loader)) == list(range(20))
    loader.close()


class _CountingData(WorkerInfoData):
    """Counts loads in the dataset object itself: a fresh copy starts from zero."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.loads = 0

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        self.loads += 1
        return {**super().__getitem__(index), "loads": self.loads}


@pytest.mark.timeout(120)
def test_non_persistent_workers_are_fresh_each_epoch_in_reused_processes() -> None:
    """Each epoch sees a new dataset copy, a new seed and worker_init_fn again, as a new
    torch worker process would, but raydl reuses the (resource-free) actor process."""
    loader = RayDataLoader(
        _CountingData(6), batch_size=6, num_workers=1, worker_init_fn=record_worker_init
    )
    epochs = [list(loader) for _ in range(2)]  # whole epochs: each ends and parks its pool
    first, second = epochs[0][0], epochs[1][0]
    assert first["pid"][0] == second["pid"][0]  # the same process, parked between epochs
    assert first["loads"].tolist() == second["loads"].tolist() == [1, 2, 3, 4, 5, 6]
    assert first["seed"][0] != second["seed"][0]  # a new base seed each epoch, as in torch
    assert second["init_pid"][0] == second["pid"][0]  # worker_init_fn ran in that process
    loader.close()
    assert loader._source._parked == []
