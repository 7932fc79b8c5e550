"""Multi-rank tests: real torchrun processes (gloo on CPU) sharing one Ray cluster.

Each launch starts rank 0's embedded Ray, so these are slow; they are kept few
and each checks several properties at once. A launch may also serve several
tests (``split_runs``), each asserting on the records of its own loaders.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

HERE = Path(__file__).parent
REPO = HERE.parent.parent
SCRIPT = HERE / "_consume.py"
EXAMPLE = REPO / "examples" / "train_ddp.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _torchrun(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())


def _records(prefix: Path) -> dict[int, list[dict]]:
    return {rank: [json.loads(line) for line in open(f"{prefix}.rank{rank}")] for rank in (0, 1)}


def _orders(records: dict[int, list[dict]]) -> dict[int, list[list[int]]]:
    """Per rank, each epoch's ids (a record's summary holds timings, which differ per run)."""
    return {rank: [epoch["ids"] for epoch in epochs] for rank, epochs in records.items()}


@pytest.fixture(scope="module")
def unequal_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("unequal")
    subprocess.run([sys.executable, str(SCRIPT), "--make-data", str(root)], check=True)
    return root


TOTAL_ROWS = 2 * 1000 + 2 * 37
MODES = ("global", "files", "none")  # "none": shuffle=False
#: What each of the two launches of ``split_runs`` runs, one loader after another: Ray
#: Data's own read under the streaming split (2 epochs), then a direct plan in every mode
#: (3 epochs each). One pair of launches serves both tests below, each on its own records.
SPLIT_LOADERS = ",".join(["ray/blocks/2", *(f"raydl/{mode}/3" for mode in MODES)])


@pytest.fixture(scope="module")
def split_runs(
    unequal_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, dict[int, list[dict]]]]:
    """Two identical launches; per launch, the records of each loader by ``READER-MODE``."""
    runs = []
    for run in range(2):
        prefix = tmp_path_factory.mktemp("split") / f"run{run}"
        proc = _torchrun(
            str(SCRIPT), "--record", str(prefix), "--data", str(unequal_data),
            "--loaders", SPLIT_LOADERS, timeout=400,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        names = ["ray-blocks", *(f"raydl-{mode}" for mode in MODES)]
        runs.append({name: _records(Path(f"{prefix}-{name}")) for name in names})
    return runs


@pytest.mark.timeout(840)  # the launches of split_runs run in the first test that needs them
def test_ray_data_split_is_exact_equal_and_reproducible(
    split_runs: list[dict[str, dict[int, list[dict]]]],
) -> None:
    runs = [run["ray-blocks"] for run in split_runs]
    first = runs[0]
    for epoch in range(2):
        per_rank = [first[rank][epoch] for rank in (0, 1)]
        # equal batch counts, so the per-step all-reduce completed on both ranks
        assert per_rank[0]["batches"] == per_rank[1]["batches"]
        ids = per_rank[0]["ids"] + per_rank[1]["ids"]
        counts = Counter(ids)
        assert max(counts.values()) == 1, "a row was delivered twice"
        # equal=True drops at most world_size - 1 rows of the epoch
        assert TOTAL_ROWS - 1 <= len(ids) <= TOTAL_ROWS
        assert len(per_rank[0]["ids"]) == len(per_rank[1]["ids"])
    # a new order each epoch, the same sequence per rank on a rerun
    assert first[0][0]["ids"] != first[0][1]["ids"]
    assert _orders(runs[0]) == _orders(runs[1])


@pytest.mark.timeout(840)  # the launches of split_runs run in the first test that needs them
def test_direct_plans_run_on_raydls_actors_for_every_rank(
    split_runs: list[dict[str, dict[int, list[dict]]]],
) -> None:
    """Every mode of a direct plan on the fast path under 2 ranks.

    A raydl read and a filter (its output size unknown in advance), in each mode:
    the global shuffle (rank 0's map phase, every rank reducing its share) and the
    streaming ones (rank 0 loads the runs and deals rows to the ranks).
    """
    runs = [{mode: run[f"raydl-{mode}"] for mode in MODES} for run in split_runs]
    kept = [i for i in range(TOTAL_ROWS) if i % 10 != 7]
    for mode in MODES:
        first = runs[0][mode]
        for epoch in range(3):
            per_rank = [first[rank][epoch] for rank in (0, 1)]
            for rank in (0, 1):
                summary = per_rank[rank]["summary"]
                on_actors = "global shuffle" if mode == "global" else "rows dealt"
                assert on_actors in summary and f"rank {rank} of 2" in summary, (mode, summary)
            assert per_rank[0]["batches"] == per_rank[1]["batches"]  # the all-reduces completed
            assert len(per_rank[0]["ids"]) == len(per_rank[1]["ids"]), mode
            ids = per_rank[0]["ids"] + per_rank[1]["ids"]
            assert max(Counter(ids).values()) == 1, f"{mode}: a row was delivered twice"
            # at most world - 1 rows left out, whatever the filter left
            assert set(ids) <= set(kept) and len(kept) - 1 <= len(ids), mode
            if mode == "none":  # rows dealt in file order, no buffer: each rank's ascend
                assert all(per_rank[r]["ids"] == sorted(per_rank[r]["ids"]) for r in (0, 1))
        orders = {tuple(first[0][epoch]["ids"]) for epoch in range(3)}
        assert len(orders) == (1 if mode == "none" else 3), mode  # a new order per epoch
        assert _orders(runs[0][mode]) == _orders(runs[1][mode]), mode  # the same on a rerun
        # ... which stats()' fingerprints tell without the ids: equal on a rerun, new per epoch.
        prints = [[[e["fingerprint"] for e in run[mode][rank]] for rank in (0, 1)] for run in runs]
        assert prints[0] == prints[1], mode
        if mode != "none":
            assert len({p for rank in prints[0] for p in rank}) == 6, mode


@pytest.mark.timeout(300)
def test_ddp_example_with_distributed_sampler_matches_torch_shares(tmp_path: Path) -> None:
    prefix = tmp_path / "ddp"
    proc = _torchrun(
        str(EXAMPLE), "--epochs", "2", "--samples", "1000", "--record", str(prefix), timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = _records(prefix)
    from torch.utils.data import DistributedSampler

    for epoch in range(2):
        for rank in (0, 1):
            sampler = DistributedSampler(
                range(1000), num_replicas=2, rank=rank, shuffle=True, seed=0
            )
            sampler.set_epoch(epoch)
            assert records[rank][epoch]["ids"] == list(sampler), (epoch, rank)


@pytest.mark.timeout(300)
def test_dead_rank_makes_the_other_fail_clearly(unequal_data: Path, tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed mid-epoch; rank 0 must end with an error, not hang.

    Launched by hand (not torchrun, whose agent would SIGTERM rank 0 itself).
    """
    port = _free_port()
    prefix = tmp_path / "dead"
    procs = []
    for rank in (0, 1):
        env = _env() | {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(SCRIPT),
                    "--record",
                    str(prefix),
                    "--data",
                    str(unequal_data),
                    "--die-after",
                    "5",
                    "--timeout",
                    "60",
                    "--epochs",
                    "1",
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    start = time.monotonic()
    try:
        procs[0].wait(timeout=230)
    finally:
        for p in procs:
            p.kill()
    records = {
        r: Path(f"{prefix}.rank{r}").read_text()
        for r in (0, 1)
        if Path(f"{prefix}.rank{r}").exists()
    }
    assert procs[1].returncode == -9, records
    assert procs[0].returncode != 0
    lines = Path(f"{prefix}.rank0").read_text().splitlines()
    last = json.loads(lines[-1])
    assert "error" in last, lines
    assert time.monotonic() - start < 230


@pytest.mark.timeout(300)
def test_background_start_never_races_the_scripts_own_collectives(tmp_path: Path) -> None:
    """The loader is built, then DDP and 50 all-reduces run at once: no deadlock, one cluster."""
    record = tmp_path / "record"
    proc = _torchrun(str(HERE / "_early_collectives.py"), str(record), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    seen = {rank: json.loads(Path(f"{record}.rank{rank}").read_text()) for rank in (0, 1)}
    assert all(seen[rank]["started_in_background"] for rank in (0, 1))
    assert seen[0]["gcs_address"] == seen[1]["gcs_address"]  # rank 1 joined rank 0's cluster
    for epoch in range(2):
        ids = [seen[rank]["epochs"][epoch] for rank in (0, 1)]
        assert len(ids[0]) == len(ids[1]) == 48  # equal shares, every step paired
        assert sorted(ids[0] + ids[1]) == list(range(96))  # every sample once
    assert seen[0]["epochs"][0] != seen[0]["epochs"][1]  # a new order per epoch
