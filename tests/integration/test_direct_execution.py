"""Simple file plans on the loader's own actors (``direct_execution``; own module: its own Ray)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch

import raydl
from raydl import RayDataLoader
from raydl._internal.epochs.direct import direct_plan
from raydl._internal.epochs.plan import plan_epoch
from raydl._internal.epochs.resume import ray_shares
from raydl._internal.epochs.state import LoaderState

FILES = 120


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``FILES`` small files, file ``i`` holding the text of ``i``."""
    root = tmp_path_factory.mktemp("direct")
    for i in range(FILES):
        (root / f"{i:04d}.bin").write_bytes(str(i).encode())
    return root


def _parse(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    ids = np.array([int(b) for b in batch["bytes"]], dtype=np.int64)
    return {"id": ids, "pid": np.full(len(ids), os.getpid(), dtype=np.int64)}


def _dataset(folder: Path, **stage: Any) -> Any:
    return raydl.read_binary_files(str(folder)).map_batches(
        _parse, batch_size=16, batch_format="numpy", **stage
    )


def _dies_once_at_file_50(marker: Path) -> Any:
    """A stage whose process dies (``os._exit``) at file 50's batch, the first time only."""

    def die_once(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if b"50" in batch["bytes"].tolist() and not marker.exists():
            marker.touch()
            os._exit(1)
        return _parse(batch)

    return die_once


def reject_seven(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A stage that raises the user's own error at file 7."""
    if b"7" in batch["bytes"].tolist():
        raise KeyError("file 7 is corrupt")
    return _parse(batch)


def _epoch(loader: RayDataLoader) -> tuple[list[int], set[int]]:
    ids: list[int] = []
    pids: set[int] = set()
    for batch in loader:
        ids += batch["id"].tolist()
        pids |= set(batch["pid"].tolist())
    return ids, pids


def _summary(loader: RayDataLoader) -> str:
    return str(loader.stats()["epochs"][-1]["ray_data"])


@pytest.mark.timeout(120)
def test_a_file_read_and_its_functions_run_on_the_loaders_own_actors(folder: Path) -> None:
    # Every run on the actors (here tiny epochs would load whole while the actors start).
    loader = RayDataLoader(
        _dataset(folder), batch_size=10, shuffle=True, shuffle_mode="files", start_in_process=False
    )
    for _ in loader:  # a break first: the whole epochs after it are unaffected
        break
    epochs = [_epoch(loader) for _ in range(3)]
    for ids, _ in epochs:
        assert sorted(ids) == list(range(FILES))  # every file exactly once
    assert len({tuple(ids) for ids, _ in epochs}) == 3  # a new order each epoch
    pids = [p for _, p in epochs]
    assert pids[0] == pids[1] == pids[2] and 1 <= len(pids[0]) <= 2  # the same 2-CPU pool
    assert os.getpid() not in pids[0]
    assert "on 2 raydl actors" in _summary(loader)
    loader.close()  # its actors go
    assert loader._source._direct_pool is None
    # And the next iteration starts a new pool.
    assert sorted(_epoch(loader)[0]) == list(range(FILES))
    loader.close()


@pytest.mark.timeout(120)
def test_a_new_loaders_first_runs_load_in_this_process_and_give_the_same_batches(
    folder: Path,
) -> None:
    """While its actors start, a loader's first epoch loads its first runs in the trainer."""

    def loader(**options: Any) -> RayDataLoader:
        return RayDataLoader(
            _dataset(folder), batch_size=8, shuffle=True, shuffle_mode="files", seed=11,
            local_shuffle_buffer_size=24, **options,
        )  # fmt: skip

    first = loader()
    ids, pids = _epoch(first)
    assert sorted(ids) == list(range(FILES))
    assert os.getpid() in pids  # its first runs (here 120 tiny files: maybe all of them)
    assert "runs loaded in the training process while they started" in _summary(first)
    deadline = time.monotonic() + 60  # a loaded machine starts actors slowly
    while True:  # the same epoch again, until the actors started and run it all
        first.set_epoch(0)
        again, again_pids = _epoch(first)
        assert again == ids
        if os.getpid() not in again_pids or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert os.getpid() not in again_pids and "training process" not in _summary(first)
    first.close()
    off = loader(start_in_process=False)
    off_ids, off_pids = _epoch(off)
    assert off_ids == ids and os.getpid() not in off_pids
    off.close()


@pytest.mark.timeout(120)
def test_without_a_buffer_the_batches_are_ray_datas(folder: Path) -> None:
    def batches(direct: bool) -> list[list[int]]:
        loader = RayDataLoader(_dataset(folder), batch_size=7, direct_execution=direct)
        out = [b["id"].tolist() for b in loader]
        assert ("raydl actors" in _summary(loader)) is direct
        loader.close()
        return out

    assert batches(True) == batches(False)


@pytest.mark.timeout(120)
def test_the_order_is_a_pure_function_of_seed_and_epoch(folder: Path) -> None:
    def loader(seed: int) -> RayDataLoader:
        return RayDataLoader(
            _dataset(folder), batch_size=8, shuffle=True, shuffle_mode="files", seed=seed,
            local_shuffle_buffer_size=32,
        )  # fmt: skip

    first, again, other = loader(5), loader(5), loader(6)
    a = [_epoch(first)[0] for _ in range(2)]
    assert [_epoch(again)[0] for _ in range(2)] == a
    assert _epoch(other)[0] != a[0]
    again.set_epoch(1)
    assert _epoch(again)[0] == a[1]
    for each in (first, again, other):
        each.close()


@pytest.mark.timeout(120)
def test_a_resumed_epoch_delivers_exactly_the_rest(folder: Path) -> None:
    def loader() -> RayDataLoader:
        return RayDataLoader(
            _dataset(folder), batch_size=8, shuffle=True, shuffle_mode="files", seed=3
        )

    whole = _epoch(loader())[0]
    assert sorted(whole) == list(range(FILES))
    interrupted = loader()
    it = iter(interrupted)
    head = [i for _ in range(5) for i in next(it)["id"].tolist()]
    state = json.loads(json.dumps(interrupted.state_dict()))
    rest = [i for batch in it for i in batch["id"].tolist()]
    # At another world size the rest of a one-rank epoch is rebuilt on rank 0 by loading
    # the same runs again: the rest of the uninterrupted epoch, and of this one.
    plan, direct = interrupted._source._plans(state["epoch"], True)
    assert direct is not None
    shares = ray_shares(
        plan.dataset, LoaderState.from_dict(state), 2, batch_size=8, drop_last=False,
        buffer=plan.local_shuffle_buffer_size, buffer_seed=plan.local_shuffle_seed, direct=direct,
    )  # fmt: skip
    assert [i for share in shares for i in share.column("id").to_pylist()] == rest == whole[40:]
    interrupted.close()
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + _epoch(resumed)[0] == whole
    resumed.close()


@pytest.mark.timeout(120)
def test_a_stage_error_has_the_users_type_and_names_the_stage_and_files(folder: Path) -> None:
    ds = raydl.read_binary_files(str(folder)).map_batches(reject_seven, batch_size=4)
    loader = RayDataLoader(ds, batch_size=4)
    with pytest.raises(KeyError, match="file 7 is corrupt") as info:
        list(loader)
    message = str(info.value)
    assert "MapBatches(reject_seven)" in message and "0007.bin" in message  # its run
    loader.close()


@pytest.mark.timeout(120)
def test_a_killed_actor_is_replaced_and_its_runs_loaded_once(folder: Path, tmp_path: Path) -> None:
    marker = tmp_path / "killed"
    die_once = _dies_once_at_file_50(marker)
    ds = raydl.read_binary_files(str(folder)).map_batches(die_once, batch_size=4)
    # Every run on the actors: a run loaded in this process would take pytest down with it.
    loader = RayDataLoader(
        ds, batch_size=6, shuffle=True, shuffle_mode="files", start_in_process=False
    )
    ids, _ = _epoch(loader)
    assert marker.exists(), "the actor was never killed"
    assert sorted(ids) == list(range(FILES))
    loader.close()


@pytest.mark.timeout(60)
def test_only_simple_file_plans_run_on_raydls_actors(folder: Path, tmp_path: Path) -> None:
    class Stateful:
        def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return batch

    def planned(ds: Any, mode: str = "files") -> Any:
        plan = plan_epoch(
            ds, shuffle=True, shuffle_mode=mode, local_shuffle_buffer_size=8, seed=0, epoch=0,
            deterministic=True,
        )  # fmt: skip
        return direct_plan(plan.dataset)

    read = raydl.read_binary_files(str(folder))
    assert planned(read) is not None  # a read alone
    assert planned(_dataset(folder, num_cpus=0.5)).num_cpus == 0.5
    assert planned(_dataset(folder, concurrency=1)).concurrency == 1
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": np.arange(5)}), tmp_path / "a.parquet")
    assert planned(raydl.read_parquet(str(tmp_path / "a.parquet"))) is not None
    # What Ray Data runs: an all-to-all stage, a class, GPUs, a filter, Ray's own reads.
    assert planned(_dataset(folder), mode="global") is None
    assert planned(_dataset(folder), mode="blocks") is None
    assert planned(read.map_batches(Stateful, concurrency=1)) is None
    assert planned(read.map_batches(_parse, num_gpus=1, batch_size=4)) is None
    assert planned(_dataset(folder).filter(lambda row: row["id"] > 3)) is None
    assert planned(ray.data.read_binary_files(str(folder))) is None
    assert planned(ray.data.range(10)) is None


@pytest.mark.timeout(60)
def test_batches_are_tensors_and_collate_fn_gets_numpy(folder: Path) -> None:
    seen: list[type] = []

    def collate(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        seen.append(type(batch["id"]))
        return batch

    plain = RayDataLoader(_dataset(folder), batch_size=50)
    assert all(isinstance(b["id"], torch.Tensor) for b in plain)
    custom = RayDataLoader(_dataset(folder), batch_size=50, collate_fn=collate)
    assert [len(b["id"]) for b in custom] == [50, 50, 20]
    assert seen == [np.ndarray] * 3
    plain.close()
    custom.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved_direct", [True, False])
def test_a_resumed_epoch_runs_the_way_it_was_saved(folder: Path, saved_direct: bool) -> None:
    # With a local buffer the two executions give other orders: the state says which ran.
    def loader(direct: bool) -> RayDataLoader:
        return RayDataLoader(
            _dataset(folder), batch_size=8, shuffle=True, shuffle_mode="files", seed=4,
            local_shuffle_buffer_size=16, direct_execution=direct,
        )  # fmt: skip

    whole = _epoch(loader(saved_direct))[0]
    saved = loader(saved_direct)
    it = iter(saved)
    head = [i for _ in range(3) for i in next(it)["id"].tolist()]
    state = json.loads(json.dumps(saved.state_dict()))
    saved.close()
    assert state["direct_execution"] is saved_direct
    resumed = loader(not saved_direct)
    resumed.load_state_dict(state)
    assert head + _epoch(resumed)[0] == whole
    assert ("raydl actors" in _summary(resumed)) is saved_direct
    # The next epoch runs as this loader says.
    assert sorted(_epoch(resumed)[0]) == list(range(FILES))
    assert ("raydl actors" in _summary(resumed)) is not saved_direct
    resumed.close()


@pytest.mark.timeout(60)
def test_a_stage_without_a_batch_format_gets_rays_arrow_block(folder: Path) -> None:
    import pyarrow as pa

    def arrow_ids(table: pa.Table) -> pa.Table:
        assert isinstance(table, pa.Table), type(table)
        ids = [int(b) for b in table.column("bytes").to_pylist()]
        return pa.table({"id": ids})

    ds = raydl.read_binary_files(str(folder)).map_batches(arrow_ids, batch_format=None)
    loader = RayDataLoader(ds, batch_size=40)
    assert sorted(i for b in loader for i in b["id"].tolist()) == list(range(FILES))
    assert "raydl actors" in _summary(loader)
    loader.close()


@pytest.mark.timeout(60)
def test_an_epoch_whose_actors_were_stopped_by_close_says_so(folder: Path) -> None:
    # A small buffer: the epoch's thread is still sending runs when the actors stop.
    loader = RayDataLoader(
        _dataset(folder), batch_size=5, shuffle=True, shuffle_mode="files",
        local_shuffle_buffer_size=5,
    )  # fmt: skip
    older = iter(loader)
    next(older)
    newer = iter(loader)  # the loader's current epoch; the older one lives on, as in torch
    next(newer)
    loader.close()  # stops the loader's actors
    with pytest.raises(RuntimeError, match=r"loader.close\(\)"):
        for _ in older:
            pass


@pytest.mark.timeout(60)
def test_a_dead_actor_seen_by_two_epochs_is_replaced_once() -> None:
    from raydl._internal.epochs.direct import RunLoader
    from raydl._internal.workers.pool import WorkerPool
    from raydl._internal.workers.worker import WorkerSpec

    spec = WorkerSpec(
        num_workers=1, collate_fn=None, auto_collation=False, worker_init_fn=None, base_seed=0
    )
    pool = WorkerPool(RunLoader(), spec, restartable=True, options={"num_cpus": 0})
    dead = pool.actors[0]
    ray.kill(dead, no_restart=True)
    first = pool.restart(0, dead)
    second = pool.restart(0, dead)  # another epoch saw the same death
    assert first is second is pool.actors[0]
    ray.get(second.__ray_ready__.remote(), timeout=30)  # alive
    pool.kill()


# -- the global shuffle on raydl's actors (exchange.py) -----------------------------


def _global(folder: Path, ds: Any = None, **kwargs: Any) -> RayDataLoader:
    return RayDataLoader(
        ds if ds is not None else _dataset(folder), batch_size=8, shuffle=True, seed=11, **kwargs
    )


@pytest.mark.timeout(120)
def test_the_global_shuffle_runs_on_raydls_actors_a_new_uniform_order_each_epoch(
    folder: Path,
) -> None:
    loader = _global(folder)
    epochs = [_epoch(loader)[0] for _ in range(3)]
    assert "global shuffle" in _summary(loader) and "on 2 raydl actors" in _summary(loader)
    for ids in epochs:
        assert sorted(ids) == list(range(FILES))
    assert len({tuple(ids) for ids in epochs}) == 3
    # Not a file order plus a buffer: the first batch is drawn from the whole epoch.
    spread = [max(ids[:8]) - min(ids[:8]) for ids in epochs]
    assert min(spread) > FILES // 4, spread
    # Once an epoch told how large the map output is, the map phase replies with whole runs
    # (one object per run, not per run and partition): the order does not change with it.
    layouts = ["whole runs" in str(e["ray_data"]) for e in loader.stats()["epochs"]]
    assert layouts == [False, True, True], loader.stats()["epochs"]
    again = _global(folder)
    again.set_epoch(1)
    assert _epoch(again)[0] == epochs[1]  # a pure function of (seed, epoch)
    assert "whole runs" not in _summary(again)
    for each in (loader, again):
        each.close()


@pytest.mark.timeout(120)
def test_an_epoch_large_for_the_object_store_keeps_one_object_per_partition(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whole runs hold the epoch until its last partition: only for an output that was at most
    # a quarter of the store. Here every output is "large" (a store of 4 bytes, say).
    from raydl._internal.runtime import cluster

    monkeypatch.setattr(cluster, "object_store_bytes", lambda: 4)
    loader = _global(folder)
    for _ in range(2):
        assert sorted(_epoch(loader)[0]) == list(range(FILES))
    assert not any("whole runs" in str(e["ray_data"]) for e in loader.stats()["epochs"])
    loader.close()


@pytest.mark.timeout(120)
def test_a_resumed_global_epoch_delivers_exactly_the_rest(folder: Path) -> None:
    uninterrupted = _global(folder)
    whole = _epoch(uninterrupted)[0]
    fingerprint = uninterrupted.stats()["epochs"][0]["fingerprint"]
    uninterrupted.close()
    saved = _global(folder)
    it = iter(saved)
    head = [i for _ in range(5) for i in next(it)["id"].tolist()]
    state = json.loads(json.dumps(saved.state_dict()))
    assert state["direct_execution"] is True
    saved.close()
    resumed = _global(folder)
    resumed.load_state_dict(state)
    assert head + _epoch(resumed)[0] == whole
    # The fingerprint goes on from the saved one: the same as the uninterrupted epoch's.
    assert resumed.stats()["epochs"][0]["fingerprint"] == fingerprint
    plan, direct = resumed._source._plans(0, True)
    assert direct is not None and direct.exchange is not None
    # At another world size the rest is rebuilt in rank 0's process, through the same exchange.
    shares = ray_shares(
        plan.dataset, LoaderState.from_dict(state), 2, batch_size=8, drop_last=False,
        buffer=None, buffer_seed=None, direct=direct,
    )  # fmt: skip
    assert [i for share in shares for i in share.column("id").to_pylist()] == whole[40:]
    resumed.close()


@pytest.mark.timeout(120)
def test_a_map_phase_survives_a_killed_actor_and_names_a_failing_stage(
    folder: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "killed"
    die_once = _dies_once_at_file_50(marker)
    read = raydl.read_binary_files(str(folder))
    loader = _global(folder, read.map_batches(die_once, batch_size=4))
    assert sorted(_epoch(loader)[0]) == list(range(FILES))
    assert marker.exists(), "the actor was never killed"
    loader.close()

    failing = _global(folder, read.map_batches(reject_seven, batch_size=4))
    with pytest.raises(KeyError, match="file 7 is corrupt") as info:
        list(failing)
    assert "MapBatches(reject_seven)" in str(info.value) and "0007.bin" in str(info.value)
    failing.close()


def _widen(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each row becomes 12 MB (its id, 1.5 million times)."""
    ids = batch["id"]
    return {"id": ids, "x": np.repeat(ids.astype(np.float64)[:, None], 1_500_000, axis=1)}


@pytest.mark.timeout(120)
def test_a_run_larger_than_a_part_arrives_whole_through_its_streamed_parts(
    tmp_path: Path,
) -> None:
    """One run of 8 blocks of 12 MB: two parts (64 MiB, then the rest), joined in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raydl._internal.epochs.direct import PART_BYTES

    pq.write_table(pa.table({"id": np.arange(8)}), tmp_path / "rows.parquet", row_group_size=1)
    ds = raydl.read_parquet(str(tmp_path)).map_batches(_widen, batch_size=1, batch_format="numpy")
    assert direct_plan(ds) is not None and PART_BYTES < 8 * 12_000_000
    loader = RayDataLoader(ds, batch_size=3, start_in_process=False)  # every run on an actor
    for _ in range(2):
        batches = list(loader)
        assert [b["id"].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7]]
        for batch in batches:
            assert torch.equal(batch["x"], batch["id"].double()[:, None].expand(-1, 1_500_000))
    loader.close()


@pytest.mark.timeout(60)
def test_streamed_calls_join_the_parts_and_a_failed_part_is_the_reply() -> None:
    from raydl._internal.stream.dispatch import ResultTimeout, StreamedCalls, WorkerLost

    @ray.remote(num_cpus=0)
    class Parts:
        def fetch_parts(self, n: int, last: Any) -> Any:
            for i in range(n):
                time.sleep(0.03)  # some parts come after a get's slice ran out
                yield [i, i + 100]
            if last == "exit":
                os._exit(1)
            yield last

        def fetch(self, n: int, last: Any) -> Any:
            return [x for i in range(n) for x in (i, i + 100)]

    def reply(calls: StreamedCalls, ref: Any) -> Any:
        while True:
            try:
                return calls.get(ref, 0.01)
            except ResultTimeout:
                continue

    actor, calls = Parts.remote(), StreamedCalls("fetch_parts", whole="fetch")
    want = [0, 100, 1, 101, 2, 102]
    assert reply(calls, calls.submit(actor, "fetch_parts", 3, [])) == want
    assert reply(calls, calls.submit(actor, "fetch_parts", 3, ["last"])) == [*want, "last"]
    assert reply(calls, calls.submit(actor, "fetch_parts", 2, "failed")) == "failed"
    calls.stream = False  # a plain call of the whole method, one return
    assert reply(calls, calls.submit(actor, "fetch_parts", 3, [])) == want
    calls.stream = True
    ready = calls.wait([calls.submit(actor, "fetch_parts", 1, [])], timeout=10)
    assert len(ready) == 1
    with pytest.raises(WorkerLost):
        reply(calls, calls.submit(actor, "fetch_parts", 1, "exit"))
