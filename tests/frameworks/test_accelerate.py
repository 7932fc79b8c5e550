"""Accelerate: ``accelerator.prepare(model, optimizer, loader)`` under torchrun (2 ranks, gloo).

Accelerate prepares only ``torch.utils.data.DataLoader`` instances; a
``RayDataLoader`` comes back unchanged and shards itself. Accelerate's
``save_state``/``load_state`` saves prepared torch loaders only; a
``RayDataLoader`` is checkpointed as a custom object
(``accelerator.register_for_checkpointing(loader)``), which Accelerate writes
from the main process only: every rank loads rank 0's loader state.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _launch import assert_one_epoch, free_port, require, sampler_epoch_of

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

TRAINER = Path(__file__).parent / "_accelerate_train.py"
N, BATCH = 64, 4  # 8 batches per rank and epoch


def _torchrun(env: dict[str, str], record: Path, *args: str) -> list[dict[str, Any]]:
    require("accelerate")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        str(TRAINER), "--record", str(record), *args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(Path(f"{record}.rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.timeout(280)
def test_prepare_shards_and_save_state_resumes_mid_epoch(
    cluster_env: dict[str, str], tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    first = _torchrun(
        cluster_env, tmp_path / "run", "--num-workers", "1", "--epochs", "2",
        "--save-at", "1", "3", "--state-dir", str(state_dir),
    )  # fmt: skip
    for rank, record in enumerate(first):
        assert record["world_size"] == 2 and record["rank"] == rank
        assert record["prepared_is_loader"], record["prepared_type"]  # passed through
        assert (record["sampler_type"], record["sampler_rank"]) == ("DistributedSampler", rank)
        assert record["len"] == N // 2 // BATCH and record["start_epoch"] == 0
        # Accelerate's skip_first_batches builds a torch DataLoader: it would leave Ray
        assert record["skip_first_batches_type"] == "DataLoader"
    orders = []
    for epoch in ("0", "1"):
        per_rank = [record["epochs"][epoch] for record in first]
        assert_one_epoch(per_rank, N)  # equal steps per rank, every sample once
        for rank in (0, 1):
            assert sampler_epoch_of(per_rank[rank], N, rank) == int(epoch), (epoch, rank)
        orders.append(per_rank[0])
    assert orders[0] != orders[1], "the same order in both epochs"

    # the loader's state is a custom object of the checkpoint (rank 0's, loaded by every rank)
    assert (state_dir / "custom_checkpoint_0.pkl").exists()
    resumed = _torchrun(
        cluster_env, tmp_path / "resumed", "--num-workers", "1", "--epochs", "2",
        "--resume", str(state_dir),
    )  # fmt: skip
    for rank in (0, 1):
        assert resumed[rank]["start_epoch"] == 1
        assert list(resumed[rank]["epochs"]) == ["1"]
        # the rest of epoch 1 for this rank, in the uninterrupted run's order
        assert resumed[rank]["epochs"]["1"] == first[rank]["epochs"]["1"][3 * BATCH :]
