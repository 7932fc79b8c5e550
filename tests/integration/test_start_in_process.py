"""A map-style epoch's first batches load in the trainer while the pool's actors start.

Each such batch is loaded as the worker torch would have used (its copy of the
dataset, its RNG states, ``get_worker_info()``), and the actors go on from those
states (docs/design/run-paths.md, "The first batches, loaded by the trainer"): a dataset
drawing random augmentations gives torch's batches either way.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from _datasets import FilledBlocks, RandomDraws
from torch.utils.data import DataLoader

from raydl import RayDataLoader

FIELDS = ("index", "torch", "python", "numpy", "worker")


def _epochs(loader: Any, until_on_actors: bool, most: int, step_s: float) -> list[list[Any]]:
    """Epochs of ``loader`` (``most`` at most), until one loaded no batch in this process."""
    epochs = []
    for _ in range(most):
        batches = []
        for batch in loader:
            batches.append(batch)
            time.sleep(step_s)  # the training step
        epochs.append(batches)
        here = sum(int((b["pid"] == os.getpid()).all()) for b in batches)
        if until_on_actors and here == 0:
            break
    return epochs


def _until_on_actors_and_torchs(
    seed: int, args: dict[str, Any], **raydl_only: Any
) -> tuple[list[list[Any]], list[list[Any]], list[Any]]:
    """``RandomDraws`` epochs until the actors took over, torch's same epochs (2 workers), stats."""
    torch.manual_seed(seed)
    loader = RayDataLoader(RandomDraws(), **args, **raydl_only)
    try:
        ours = _epochs(loader, until_on_actors=True, most=40, step_s=0.02)
        summaries = [epoch.get("ray_data") for epoch in loader.stats()["epochs"]]
    finally:
        loader.close()
    torch.manual_seed(seed)
    # Spawned, not forked: torch workers forked from this process, which runs a Ray driver,
    # between raydl loaders crash Ray 2.60's raylet now and then (docs/design/failure-handling.md, Known
    # limits). torch seeds a spawned worker as a forked one: the same draws.
    torch_loader = DataLoader(RandomDraws(), **args, num_workers=2, multiprocessing_context="spawn")
    theirs = _epochs(torch_loader, False, len(ours), 0)
    return ours, theirs, summaries


@pytest.mark.timeout(240)
@pytest.mark.parametrize("persistent", [True, False])
def test_batches_loaded_here_then_on_the_actors_are_torchs_random_draws_too(
    persistent: bool,
) -> None:
    args = {"batch_size": 4, "shuffle": True, "persistent_workers": persistent}
    ours, theirs, summaries = _until_on_actors_and_torchs(11, args, num_workers=2)
    loaded_here = [sum(int((b["pid"] == os.getpid()).all()) for b in e) for e in ours]
    assert loaded_here[0] > 0, summaries  # the actors were still starting
    assert loaded_here[-1] == 0, summaries  # ... and then took over
    assert f"{loaded_here[0]} batches loaded in the training process" in str(summaries[0])
    for epoch, (mine, torchs) in enumerate(zip(ours, theirs, strict=True)):
        assert len(mine) == len(torchs) == 16
        for k, (a, b) in enumerate(zip(mine, torchs, strict=True)):
            for field in FIELDS:
                assert torch.equal(a[field], b[field]), (epoch, k, field, loaded_here)


@pytest.mark.timeout(120)
def test_with_the_option_off_every_batch_loads_on_the_actors() -> None:
    loader = RayDataLoader(RandomDraws(), batch_size=4, num_workers=2, start_in_process=False)
    try:
        pids = {int(b["pid"][0]) for b in loader}
    finally:
        loader.close()
    assert os.getpid() not in pids


@pytest.mark.timeout(240)
@pytest.mark.parametrize("persistent", [True, False])
def test_with_auto_the_first_batches_load_here_as_worker_0_in_torchs_order(
    persistent: bool,
) -> None:
    args = {"batch_size": 4, "shuffle": True, "persistent_workers": persistent}
    ours, theirs, summaries = _until_on_actors_and_torchs(5, args, num_workers="auto", cpu_budget=2)
    mine_here = [[bool((b["pid"] == os.getpid()).all()) for b in epoch] for epoch in ours]
    assert any(mine_here[0]) and not any(mine_here[-1]), summaries
    for epoch, torchs in zip(ours, theirs, strict=True):
        assert [b["index"].tolist() for b in epoch] == [b["index"].tolist() for b in torchs]
    # The trainer stood in for worker 0 alone: the one the rule starts with.
    batches_here = [b for e in ours for b in e if (b["pid"] == os.getpid()).all()]
    assert {w for b in batches_here for w in b["worker"].tolist()} == {0}


@pytest.mark.timeout(180)
def test_the_actors_take_over_from_a_trainer_that_loads_flat_out() -> None:
    """No training step, and items made by torch operators: the trainer loads batches itself
    as fast as it can until the actors answer. Not on one thread, it would run those ops on
    its intra-op threads, whose OpenMP spinning kept both cores of a 2-CPU machine busy, and
    the actors answered late: here after 21.7 s (5.8 s since), in a fresh process after
    20-23 s (3-4 s since). A liveness check: the thread count itself is pinned by
    tests/unit/test_emulated.py."""
    loader = RayDataLoader(FilledBlocks(), batch_size=8, num_workers=2, persistent_workers=True)
    here: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            here.append(sum(int((b["pid"] == os.getpid()).all()) for b in loader))
            if here[-1] == 0:
                break
    finally:
        loader.close()
    assert here[0] > 0, here  # the actors were still starting
    assert here[-1] == 0, f"the actors never took over: batches loaded here per epoch {here}"
