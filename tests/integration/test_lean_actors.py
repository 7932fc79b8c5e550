"""The direct path's actors run pyarrow and numpy work without importing torch or Ray Data.

Importing torch costs a process about 130 MB of private memory, Ray Data about 60 MB
and a CPU-second (pandas included); a direct-path actor needs neither (docs/design/direct-execution.md,
"Lean", "Actors without Ray Data"). The last-mile function reports, from inside the
actor, whether they are there; the batches still arrive as
tensors in the trainer, and an error in the actor still has the user's type and
the worker's traceback, as torch's ``ExceptionWrapper`` would give them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ray import cloudpickle

import raydl
from raydl import RayDataLoader

import _torch_free  # isort: skip
from _private_ray import private_ray  # isort: skip
from _datasets import ForkReport, PageFaults, TensorData, collate_and_report_shared  # isort: skip

FILES = 40


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``FILES`` small files, file ``i`` holding the text of ``i``."""
    root = tmp_path_factory.mktemp("lean")
    for i in range(FILES):
        (root / f"{i:04d}.bin").write_bytes(str(i).encode())
    return root


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """The shared fixture's cluster, its workers forked (``RAYDL_FORK_WORKERS=1``, the default
    on Linux, set here whatever the environment says): this module checks what forked actors
    import and share."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAYDL_FORK_WORKERS", "1")
        with private_ray(num_cpus=2):
            yield


@pytest.fixture(autouse=True, scope="module")
def _by_value() -> object:
    cloudpickle.register_pickle_by_value(_torch_free)
    yield
    cloudpickle.unregister_pickle_by_value(_torch_free)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["files", "global"])
def test_direct_actors_import_neither_torch_nor_ray_data(folder: Path, mode: str) -> None:
    ds = raydl.read_binary_files(str(folder)).map_batches(
        _torch_free.parse_and_report, batch_size=8, batch_format="numpy"
    )
    # Every run on the actors: one loaded in the trainer would report the trainer's torch.
    loader = RayDataLoader(
        ds, batch_size=10, shuffle=True, shuffle_mode=mode, start_in_process=False
    )
    try:
        batches = list(loader)
        assert "raydl actors" in str(loader.stats()["epochs"][-1]["ray_data"])
    finally:
        loader.close()
    ids = torch.cat([b["id"] for b in batches])
    assert sorted(ids.tolist()) == list(range(FILES))
    assert isinstance(batches[0]["torch_loaded"], torch.Tensor)  # tensors in the trainer
    assert not torch.cat([b["torch_loaded"] for b in batches]).any()
    assert not torch.cat([b["ray_data_loaded"] for b in batches]).any()


@pytest.mark.timeout(120)
def test_an_error_in_a_torch_free_actor_keeps_its_type_and_traceback(folder: Path) -> None:
    ds = raydl.read_binary_files(str(folder)).map_batches(
        _torch_free.fails_on_seven, batch_size=8, batch_format="numpy"
    )
    loader = RayDataLoader(ds, batch_size=10, shuffle=False)
    try:
        with pytest.raises(KeyError, match=r"(?s)Caught KeyError in .*file seven") as caught:
            list(loader)
    finally:
        loader.close()
    assert "fails_on_seven" in str(caught.value)  # the worker's traceback, readable
    assert not str(caught.value).startswith("'")  # torch's rule: a KeyError's text as it is


@pytest.mark.timeout(120)
def test_actors_keep_freed_memory_unless_told_not_to() -> None:
    """20 rounds of 4.8 MB each: kept, they fault in less than one round's 1,200 pages."""
    if not sys.platform.startswith("linux"):
        pytest.skip("mallopt: glibc on Linux")
    # glibc's defaults, its initial mmap threshold pinned: left dynamic, the first free of
    # a 600 KB mapping raises it, and a worker that did so before its rounds (seen once,
    # 0 faults) serves them from the heap as a kept one does.
    env_vars = {"RAYDL_KEEP_FREED_MEMORY": "0", "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
    off = {"runtime_env": {"env_vars": env_vars}}
    faults = {}
    for name, options in (("kept", None), ("default", off)):
        loader = RayDataLoader(  # counted in the actor: none loaded in the trainer
            PageFaults(),
            batch_size=None,
            num_workers=1,
            worker_options=options,
            start_in_process=False,
        )
        faults[name] = [int(f) for f in loader]
        loader.close()
    assert all(f < 1_200 for f in faults["kept"]), faults
    assert all(f > 10 * 1_200 for f in faults["default"]), faults


@pytest.mark.timeout(120)
def test_default_collate_stacks_into_plain_memory_in_the_actors() -> None:
    """torch's workers collate into shared memory (their queue's transport); raydl's do not."""
    from torch.utils.data import DataLoader

    args = {"batch_size": 4, "num_workers": 1, "collate_fn": collate_and_report_shared}
    # Spawned: a torch worker forked from a Ray driver's process can crash the raylet.
    torch_batches = list(DataLoader(TensorData(8), **args, multiprocessing_context="spawn"))
    assert [bool(b["shared"]) for b in torch_batches] == [True, True]
    loader = RayDataLoader(TensorData(8), **args, start_in_process=False)  # the actor's collate
    batches = list(loader)
    loader.close()
    assert [bool(b["shared"]) for b in batches] == [False, False]
    for ours, theirs in zip(batches, torch_batches, strict=True):
        assert torch.equal(ours["x"], theirs["x"])


@pytest.mark.timeout(60)
def test_only_a_plan_ray_data_runs_has_an_embedded_instances_workers_import_it(
    folder: Path,
) -> None:
    """What an instance a loader starts has its workers import as they start: nothing for a
    plan raydl's actors run, Ray Data for one Ray Data runs (its tasks unpickle its objects)."""
    import ray.data

    direct = raydl.read_binary_files(str(folder)).map_batches(_torch_free.parse_and_report)
    cases = [
        (direct, {}, ()),
        (direct, {"direct_execution": False}, ("ray.data",)),
        (ray.data.range(8), {}, ("ray.data",)),
    ]
    for dataset, options, preloaded in cases:
        loader = RayDataLoader(dataset, batch_size=4, **options)
        try:
            assert loader._source.worker_modules == preloaded, options
        finally:
            loader.close()


@pytest.mark.timeout(120)
def test_actors_are_forked_from_the_server_unless_they_need_their_own_environment() -> None:
    """The embedded instance's actors share the fork server's torch and their environment
    server's Ray (docs/design/embedded-runtime.md, "Forked workers") and run its threads as a fresh
    process's; an actor with a ``runtime_env`` starts as Ray starts it, sharing nothing."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the fork server runs on Linux")
    seen = {}
    own_env = {"runtime_env": {"env_vars": {"RAYDL_PROBE": "1"}}}
    for name, options in (("forked", None), ("own_env", own_env)):
        loader = RayDataLoader(
            ForkReport(),
            batch_size=None,
            num_workers=2,
            worker_options=options,
            start_in_process=False,  # every sample from an actor
        )
        seen[name] = list(loader)
        loader.close()
    assert {s["torch_shared"] for s in seen["forked"]} == {True}, seen["forked"]
    assert {s["torch_shared"] for s in seen["own_env"]} == {False}, seen["own_env"]
    # Ray too, imported once for the job by its environment server (docs/design/embedded-runtime.md, "Ray,
    # once per job"), under the job's own environment: a worker forked with a Ray imported
    # under another would have died in Ray core's check of its job.
    assert {s["ray_shared"] for s in seen["forked"]} == {True}, seen["forked"]
    assert {s["ray_shared"] for s in seen["own_env"]} == {False}, seen["own_env"]
    # One intra-op thread either way, as Ray gives an actor that asks for no CPUs (the
    # server imported torch before Ray could say so: with OpenMP's default, a thread per
    # core, two forked actors decoding JPEGs ran at a quarter of their speed on 2 cores).
    threads = {name: {int(s["torch_threads"]) for s in samples} for name, samples in seen.items()}
    assert threads == {"forked": {1}, "own_env": {1}}, threads
