"""RayDataLoader over ray.data.Dataset sources (own module: its own Ray cluster)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch

from raydl import PerEpoch, RayDataLoader

N = 40


def _ids(loader: Any) -> list[int]:
    return [int(i) for batch in loader for i in batch["id"].tolist()]


@pytest.mark.timeout(90)
def test_batches_are_dicts_of_tensors_in_order() -> None:
    ds = ray.data.range(N).map_batches(lambda b: {"id": b["id"], "x": b["id"] * 2.0})
    loader = RayDataLoader(ds, batch_size=7)
    batches = list(loader)
    assert [len(b["id"]) for b in batches] == [7] * 5 + [5]
    for batch in batches:
        assert set(batch) == {"id", "x"}
        assert all(isinstance(v, torch.Tensor) for v in batch.values())
        assert torch.equal(batch["x"], batch["id"].double() * 2.0)
    assert _ids(batches) == list(range(N))
    batches[0]["id"][0] = -1  # writable, like torch's batches


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("batch_size", "drop_last", "expected"), [(7, False, 6), (7, True, 5), (1, False, N)]
)
def test_len_is_exact_for_range(batch_size: int, drop_last: bool, expected: int) -> None:
    loader = RayDataLoader(ray.data.range(N), batch_size=batch_size, drop_last=drop_last)
    assert len(loader) == expected


@pytest.mark.timeout(60)
def test_len_after_filter_raises_type_error_and_iteration_works() -> None:
    ds = ray.data.range(N).filter(lambda row: row["id"] % 2 == 0)
    loader = RayDataLoader(ds, batch_size=4)
    with pytest.raises(TypeError, match=r"^len\(\) of a RayDataLoader over a ray.data.Dataset"):
        len(loader)
    assert _ids(loader) == list(range(0, N, 2))


@pytest.mark.timeout(60)
def test_drop_last() -> None:
    loader = RayDataLoader(ray.data.range(N), batch_size=6, drop_last=True)
    batches = list(loader)
    assert [len(b["id"]) for b in batches] == [6] * 6
    assert _ids(batches) == list(range(36))


@pytest.mark.timeout(120)
def test_global_shuffle_is_a_permutation_per_epoch_and_seeded() -> None:
    loader = RayDataLoader(ray.data.range(N), batch_size=8, shuffle=True, seed=3)
    first, second = _ids(loader), _ids(loader)
    assert sorted(first) == list(range(N))
    assert sorted(second) == list(range(N))
    assert first != list(range(N))
    assert first != second
    again = RayDataLoader(ray.data.range(N), batch_size=8, shuffle=True, seed=3)
    assert _ids(again) == first
    other = RayDataLoader(ray.data.range(N), batch_size=8, shuffle=True, seed=4)
    assert _ids(other) != first


@pytest.mark.timeout(60)
def test_generator_seeds_the_shuffle() -> None:
    def make() -> RayDataLoader:
        return RayDataLoader(
            ray.data.range(N),
            batch_size=8,
            shuffle=True,
            generator=torch.Generator().manual_seed(9),
        )

    assert _ids(make()) == _ids(make())


@pytest.mark.timeout(60)
def test_set_epoch_selects_the_order() -> None:
    loader = RayDataLoader(ray.data.range(N), batch_size=8, shuffle=True, seed=1)
    epoch0 = _ids(loader)
    loader.set_epoch(0)
    assert _ids(loader) == epoch0


@pytest.mark.timeout(90)
def test_blocks_shuffle_mode() -> None:
    ds = ray.data.range(N, override_num_blocks=8)
    loader = RayDataLoader(
        ds, batch_size=5, shuffle=True, seed=2, shuffle_mode="blocks", local_shuffle_buffer_size=10
    )
    first, second = _ids(loader), _ids(loader)
    assert sorted(first) == sorted(second) == list(range(N))
    assert first != list(range(N))
    assert first != second
    again = RayDataLoader(
        ds, batch_size=5, shuffle=True, seed=2, shuffle_mode="blocks", local_shuffle_buffer_size=10
    )
    assert _ids(again) == first


# Seven Ray Data executions of Ray's own reader (2-9 s each on 2 CPUs): 38 s alone, 80 s
# in a loaded CI run.
@pytest.mark.timeout(240)
def test_files_shuffle_mode_reorders_the_files_each_epoch(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for part in range(6):
        ids = np.arange(part * 10, part * 10 + 10)
        pq.write_table(pa.table({"id": ids}), tmp_path / f"part-{part}.parquet")
    ds = ray.data.read_parquet(str(tmp_path), override_num_blocks=6)

    def files_loader(seed: int) -> RayDataLoader:
        return RayDataLoader(
            ds, batch_size=5, shuffle=True, seed=seed, shuffle_mode="files",
            local_shuffle_buffer_size=30,
        )  # fmt: skip

    def file_order(loader: RayDataLoader, epoch: int) -> list[int]:
        plan = loader._source._epoch_plan(epoch)  # the epoch's plan, read without the local buffer
        assert not plan.all_to_all  # streams: no barrier before the first batch
        ids = [int(i) for b in plan.dataset.iter_batches(batch_size=None) for i in b["id"]]
        assert sorted(ids) == list(range(60))
        return [i // 10 for i in ids[::10]]

    loader = files_loader(2)
    orders = [file_order(loader, epoch) for epoch in range(3)]
    assert all(sorted(order) == list(range(6)) for order in orders)
    assert len({tuple(order) for order in orders}) > 1  # a new order each epoch
    assert any(order != sorted(order) for order in orders)
    assert file_order(files_loader(2), 1) == orders[1]  # a pure function of (seed, epoch)
    first, second = _ids(loader), _ids(loader)
    assert sorted(first) == sorted(second) == list(range(60))
    assert first != second
    assert _ids(files_loader(2)) == first


@pytest.mark.timeout(30)
def test_files_shuffle_mode_needs_a_read() -> None:
    loader = RayDataLoader(
        ray.data.from_items([{"id": i} for i in range(8)]),
        batch_size=4,
        shuffle=True,
        shuffle_mode="files",
    )
    with pytest.raises(ValueError, match=r"FromItems.* is not a read"):
        list(loader)


def _collate_numpy(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    assert isinstance(batch, dict)
    assert all(isinstance(v, np.ndarray) for v in batch.values())
    return {"ids": batch["id"].tolist(), "kind": type(batch["id"]).__name__}


@pytest.mark.timeout(60)
def test_collate_fn_receives_dict_of_numpy() -> None:
    loader = RayDataLoader(ray.data.range(10), batch_size=4, collate_fn=_collate_numpy)
    batches = list(loader)
    assert [b["ids"] for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert {b["kind"] for b in batches} == {"ndarray"}


def _add_features(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        "id": batch["id"],
        "square": batch["id"] ** 2,
        "name": np.array([f"row{i}" for i in batch["id"]]),
    }


@pytest.mark.timeout(90)
def test_map_batches_stage_with_num_cpus() -> None:
    ds = ray.data.range(N).map_batches(_add_features, num_cpus=1, batch_size=10)
    loader = RayDataLoader(ds, batch_size=10)
    batches = list(loader)
    assert _ids(batches) == list(range(N))
    for batch in batches:
        assert torch.equal(batch["square"], batch["id"] ** 2)
        assert isinstance(batch["name"], np.ndarray)  # strings stay numpy
        assert batch["name"].tolist() == [f"row{i}" for i in batch["id"].tolist()]


@pytest.mark.timeout(60)
def test_user_dataset_is_not_modified() -> None:
    ds = ray.data.range(N)
    loader = RayDataLoader(ds, batch_size=8, shuffle=True, seed=0)
    list(loader)
    assert [row["id"] for row in ds.take(5)] == [0, 1, 2, 3, 4]


@pytest.mark.timeout(60)
def test_early_exit_then_full_epoch() -> None:
    loader = RayDataLoader(ray.data.range(N), batch_size=4)
    next(iter(loader))
    assert _ids(loader) == list(range(N))


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": None}, "DataLoader with ray.data.Dataset: batch_size=None"),
        (
            {"sampler": [0, 1]},
            "DataLoader with ray.data.Dataset: expected unspecified sampler option",
        ),
        (
            {"batch_sampler": [[0]]},
            "DataLoader with ray.data.Dataset: expected unspecified batch_sampler",
        ),
    ],
)
def test_unsupported_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        RayDataLoader(ray.data.range(4), **kwargs)


def _keep_by_epoch(batch: dict[str, np.ndarray], epoch: int) -> dict[str, np.ndarray]:
    """A per-epoch draw: keep the ids whose (id + epoch) is divisible by 3."""
    keep = (batch["id"] + epoch) % 3 == 0
    return {"id": batch["id"][keep]}


def _per_epoch() -> PerEpoch:
    base = ray.data.range(N * 3, override_num_blocks=6)
    return PerEpoch(lambda epoch: base.map_batches(_keep_by_epoch, fn_kwargs={"epoch": epoch}))


@pytest.mark.timeout(120)
def test_per_epoch_pipeline_is_rebuilt_for_each_epoch() -> None:
    loader = RayDataLoader(_per_epoch(), batch_size=8, shuffle=True, seed=3)
    for epoch in range(3):
        ids = _ids(loader)
        expected = [i for i in range(N * 3) if (i + epoch) % 3 == 0]
        assert sorted(ids) == expected, epoch  # exactly once, that epoch's draw
    loader.set_epoch(1)
    assert sorted(_ids(loader)) == [i for i in range(N * 3) if (i + 1) % 3 == 0]


@pytest.mark.timeout(30)
def test_per_epoch_rejects_what_is_not_a_pipeline() -> None:
    with pytest.raises(TypeError, match=r"PerEpoch needs a function epoch -> ray.data.Dataset"):
        PerEpoch(3)  # type: ignore[arg-type]
    loader = RayDataLoader(PerEpoch(lambda epoch: [epoch]), batch_size=2)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match=r"PerEpoch's build\(0\) should return a ray.data.Dataset"):
        list(loader)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["global", "blocks"])
def test_overlapped_epochs_deliver_the_same_batches(mode: str) -> None:
    def run(overlap: bool) -> tuple[list[list[int]], list[int | None]]:
        loader = RayDataLoader(
            _per_epoch(),
            batch_size=8,
            shuffle=True,
            shuffle_mode=mode,
            seed=5,
            overlap_epochs=overlap,
        )
        epochs, started_early = [], []
        for _ in range(3):
            epochs.append(_ids(loader))
            started_early.append(loader._source.early_epoch)
        loader.close()
        assert loader._source.early_epoch is None  # close() stops the early epoch
        return epochs, started_early

    overlapped, started = run(True)
    plain, none_started = run(False)
    assert overlapped == plain
    assert started == [1, 2, 3]  # each epoch started the next one while it ran
    assert none_started == [None, None, None]


@pytest.mark.timeout(120)
def test_a_slow_trainer_gets_the_next_epoch_started_long_before_the_current_one_ends() -> None:
    # No all-to-all stage: the next epoch starts once the current execution has run
    # every task, not when the trainer reaches its last batches; an epoch that was
    # itself started early (epochs 1 and 2) starts its successor the same way.
    loader = RayDataLoader(ray.data.range(400, override_num_blocks=4), batch_size=8)
    for epoch in range(3):
        started_at = None
        batches = 0
        for batches, _ in enumerate(loader, start=1):
            if started_at is None and loader._source.early_epoch == epoch + 1:
                started_at = batches
            time.sleep(0.03)  # a training step
        assert batches == 50
        assert started_at is not None and started_at < 40, (epoch, started_at)
    loader.close()


@pytest.mark.timeout(120)
def test_set_epoch_discards_an_early_epoch_that_is_not_next() -> None:
    loader = RayDataLoader(_per_epoch(), batch_size=8, shuffle=True, seed=9)
    list(loader)
    assert loader._source.early_epoch == 1
    loader.set_epoch(4)
    assert loader._source.early_epoch is None
    expected = RayDataLoader(_per_epoch(), batch_size=8, shuffle=True, seed=9, overlap_epochs=False)
    expected.set_epoch(4)
    assert _ids(loader) == _ids(expected)


def _tally(batch: dict[str, np.ndarray], log: str) -> dict[str, np.ndarray]:
    with open(log, "a") as f:
        f.write("x\n")
    return batch


@pytest.mark.timeout(120)
def test_stats_carry_ray_data_stage_summary_progress_and_log(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    log = str(tmp_path / "calls")
    ds = ray.data.range(N, override_num_blocks=4).map_batches(_tally, fn_kwargs={"log": log})
    loader = RayDataLoader(ds, batch_size=8, progress_bar=True, log_stats=True)
    with caplog.at_level("INFO", logger="raydl"):
        assert len(_ids(loader)) == N
    calls = Path(log).read_text().count("x")
    epoch = loader.stats()["epochs"][0]
    assert "MapBatches(_tally)" in epoch["ray_data"]  # Ray Data's per-stage summary
    assert Path(log).read_text().count("x") == calls  # reading the summary re-ran nothing
    assert epoch["batches"] == 5 and epoch["samples"] == N
    assert any(
        r.getMessage().startswith("epoch 0: 5 batches, 40 samples in ") for r in caplog.records
    )
    assert loader.gather_stats() == [loader.stats()]
    with pytest.raises(TypeError, match="progress_bar option should be a bool, got 'yes'"):
        RayDataLoader(ds, batch_size=8, progress_bar="yes")  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_epoch_plans_bound_task_retries_and_keep_the_users_stages() -> None:
    """Ray Data retries a dead worker's task forever; raydl's epoch plans at most STAGE_RETRIES."""
    from raydl._internal.epochs.plan import STAGE_RETRIES, bound_retries

    ds = (
        ray.data.range(N)
        .map_batches(lambda b: b)
        .map_batches(lambda b: b, max_retries=7)
        .map_batches(_Identity, compute=ray.data.ActorPoolStrategy(size=1))
    )

    def retry_args(dataset: Any) -> list[dict[str, Any]]:
        ops = dataset._logical_plan.dag.post_order_iter()
        return [dict(op.ray_remote_args) for op in ops if hasattr(op, "ray_remote_args")]

    before = retry_args(ds)
    bounded = retry_args(bound_retries(ds, STAGE_RETRIES))
    assert retry_args(ds) == before  # the user's operators are shared, not changed
    read, plain, own, actors = bounded
    assert read["max_retries"] == STAGE_RETRIES and plain["max_retries"] == STAGE_RETRIES
    assert own["max_retries"] == 7  # a stage that says how often to retry keeps it
    assert actors["max_task_retries"] == STAGE_RETRIES and "max_retries" not in actors
    assert _ids(RayDataLoader(bound_retries(ds, STAGE_RETRIES), batch_size=8)) == list(range(N))


class _Identity:
    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        return batch


@pytest.mark.timeout(60)
def test_an_epochs_executor_refreshes_its_resource_limits_promptly() -> None:
    """The hook on Ray Data's executor is in place (a Ray upgrade that renames it fails here)."""
    from raydl._internal.ray_compat.iteration import LIMITS_REFRESH_S, RayIteration

    iteration = RayIteration(ray.data.range(N, override_num_blocks=2))
    batches = iteration.iterator.iter_batches(batch_size=None)
    assert sum(len(b["id"]) for b in batches) == N
    manager = iteration._executor._resource_manager
    assert manager.GLOBAL_LIMITS_UPDATE_INTERVAL_S == LIMITS_REFRESH_S
    assert type(manager).GLOBAL_LIMITS_UPDATE_INTERVAL_S == 1  # Ray's default, left alone
