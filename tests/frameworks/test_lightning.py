"""Lightning 2.x: ``Trainer(strategy="ddp", accelerator="cpu", devices=2)`` over RayDataLoaders.

Lightning re-instantiates only ``torch.utils.data.DataLoader`` instances to add
its ``DistributedSampler``; a ``RayDataLoader`` is passed through as it is, and
shards itself (``DistributedSampler``, seed 0, one epoch per ``iter()``).
Lightning saves the train loader's ``state_dict()`` in its checkpoints (the fit
loop's ``combined_loader`` entry) and loads it on ``fit(ckpt_path=...)``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _launch import (
    assert_one_epoch,
    base_env,
    distributed_share,
    free_port,
    require,
    sampler_epoch_of,
)

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

TRAINER = Path(__file__).parent / "_lightning_train.py"
N, VAL, BATCH = 64, 32, 4  # 8 training batches per rank and epoch, 4 validation batches


def _fit(
    env: dict[str, str], record: Path, *args: str, timeout: float = 150
) -> list[dict[str, Any]]:
    """Run the trainer (Lightning starts rank 1 itself); each rank's record."""
    require("lightning")
    env = env | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, str(TRAINER), "--record", str(record), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(Path(f"{record}.rank{rank}.json").read_text()) for rank in (0, 1)]


def _loader_state(ckpt: Path) -> dict[str, Any]:
    loops = torch.load(ckpt, weights_only=False)["loops"]
    (state,) = loops["fit_loop"]["state_dict"]["combined_loader"]
    return state


@pytest.fixture(scope="module")
def ray_workers(cluster_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two epochs on 2 Ray actors per loader, with validation; a checkpoint every 11 steps."""
    root = tmp_path_factory.mktemp("lightning")
    _fit(
        cluster_env, root / "run", "--num-workers", "2", "--epochs", "2",
        "--ckpt-dir", str(root / "ckpt"), "--every-n-steps", "11",
    )  # fmt: skip
    return root


def _records(root: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((root / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.timeout(200)
def test_ddp_shards_every_epoch_and_validation(ray_workers: Path) -> None:
    ranks = _records(ray_workers, "run")
    for rank, record in enumerate(ranks):
        assert record["world_size"] == 2 and record["rank"] == rank
        # passed through, not re-instantiated: still raydl's loader, sharded by itself
        assert record["loader_type"] == "RayDataLoader"
        assert record["sampler_type"] == "DistributedSampler"
        assert (record["sampler_rank"], record["sampler_replicas"]) == (rank, 2)
        assert record["len_train"] == record["num_training_batches"] == N // 2 // BATCH
        assert record["len_val"] == VAL // 2 // BATCH
    orders = []
    for epoch in ("0", "1"):
        per_rank = [record["train"][epoch] for record in ranks]
        assert_one_epoch(per_rank, N)  # equal steps per rank, every sample once
        for rank in (0, 1):  # each rank its own DistributedSampler share
            assert sampler_epoch_of(per_rank[rank], N, rank) is not None, (epoch, rank)
        orders.append(per_rank[0])
    assert orders[0] != orders[1], "the same order in both epochs"
    for rank, record in enumerate(ranks):  # validation after each epoch: this rank's half, in order
        assert [run["epoch"] for run in record["val"]] == [0, 1]
        for run in record["val"]:
            assert run["ids"] == distributed_share(VAL, rank, 0, shuffle=False)


@pytest.mark.timeout(200)
def test_fit_ckpt_path_resumes_mid_epoch(ray_workers: Path, cluster_env: dict[str, str]) -> None:
    ckpt = ray_workers / "ckpt" / "epoch=1-step=11.ckpt"  # epoch 1, after 3 of its 8 steps
    state = _loader_state(ckpt)
    assert state["batches_consumed"] == 3 and state["world_size"] == 2
    resumed = _fit(
        cluster_env, ray_workers / "resumed", "--num-workers", "2", "--epochs", "2",
        "--resume", str(ckpt),
    )  # fmt: skip
    reference = _records(ray_workers, "run")
    for rank in (0, 1):
        # the rest of epoch 1, in the uninterrupted run's order; nothing of epoch 0 again
        assert list(resumed[rank]["train"]) == ["1"]
        assert resumed[rank]["train"]["1"] == reference[rank]["train"]["1"][3 * BATCH :]
        assert [run["epoch"] for run in resumed[rank]["val"]] == [1]


@pytest.fixture(scope="module")
def in_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """num_workers=0 (no Ray), limit_train_batches=5, no validation; a checkpoint every 3 steps."""
    root = tmp_path_factory.mktemp("lightning_limit")
    _fit(
        base_env(), root / "run", "--limit-train-batches", "5", "--no-val", "--epochs", "2",
        "--ckpt-dir", str(root / "ckpt"), "--every-n-steps", "3",
    )  # fmt: skip
    return root


@pytest.mark.timeout(200)
def test_limit_train_batches_in_process(in_process: Path) -> None:
    ranks = _records(in_process, "run")
    firsts = []
    for record in ranks:
        assert record["loader_type"] == "RayDataLoader"
        assert record["len_train"] == 8 and record["num_training_batches"] == 5
    for epoch in ("0", "1"):
        per_rank = [record["train"][epoch] for record in ranks]
        assert [len(ids) for ids in per_rank] == [5 * BATCH, 5 * BATCH]  # 5 steps on each rank
        assert not set(per_rank[0]) & set(per_rank[1]), "a sample on both ranks"
        for rank in (0, 1):  # the first 5 batches of this rank's share
            assert sampler_epoch_of(per_rank[rank], N, rank) is not None, (epoch, rank)
        firsts.append(per_rank[0])
    assert firsts[0] != firsts[1], "the same order in both epochs"


@pytest.mark.timeout(200)
def test_fit_ckpt_path_resumes_in_the_first_epoch_in_process(in_process: Path) -> None:
    ckpt = in_process / "ckpt" / "epoch=0-step=3.ckpt"
    assert _loader_state(ckpt)["batches_consumed"] == 3
    resumed = _fit(
        base_env(), in_process / "resumed", "--limit-train-batches", "5", "--no-val",
        "--epochs", "1", "--resume", str(ckpt),
    )  # fmt: skip
    reference = _records(in_process, "run")
    for rank in (0, 1):
        assert resumed[rank]["train"]["0"] == reference[rank]["train"]["0"][3 * BATCH :]
