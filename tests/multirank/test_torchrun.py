"""Multi-rank tests: real torchrun processes (gloo on CPU) sharing one Ray cluster.

Each launch starts rank 0's embedded Ray, so these are slow; they are kept few
and each checks several properties at once. A launch may also serve several
tests (``split_runs``), each asserting on the records of its own loaders.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

HERE = Path(__file__).parent
REPO = HERE.parent.parent
SCRIPT = HERE / "_consume.py"
EXIT_ORDER = HERE / "_exit_order.py"
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
#: (3 epochs each). One pair of launches serves the tests below, each on its own records.
SPLIT_LOADERS = ",".join(["ray/blocks/2", *(f"raydl/{mode}/3" for mode in MODES)])
SPLIT_NAMES = ["ray-blocks", *(f"raydl-{mode}" for mode in MODES)]
SPLIT_EPOCHS = {"ray-blocks": 2, **{f"raydl-{mode}": 3 for mode in MODES}}
#: Loaders the torchrun launch of ``split_runs`` ends with: a direct plan whose stage raises
#: on one row of one file (``_consume.POISON``), streaming and globally shuffled.
POISON_MODES = ("files", "global")
POISON_LOADERS = ",".join([*(f"poison/{mode}/1" for mode in POISON_MODES), "planfail/files/1"])


@dataclass(frozen=True)
class SplitRuns:
    """The two launches of ``split_runs``: per launch, each loader's records by ``READER-MODE``.

    The first, under torchrun, starts with ``_early_collectives.py``'s scenario (its
    loader's background start is the launch's Ray start): ``early`` is what each rank
    saw. The second is launched by hand and ends with a loader under which rank 1
    SIGKILLs itself (``dead_*``).
    """

    runs: list[dict[str, dict[int, list[dict]]]]
    early: dict[int, dict]
    poisoned: dict[str, dict[int, list[dict]]]  # the torchrun launch's POISON_LOADERS, by mode
    plan_failed: dict[int, list[dict]]  # its last loader, whose PerEpoch builder fails
    dead_returncodes: list[int | None]
    dead_lines: list[str]  # rank 0's record of the loader rank 1 died under
    dead_output: str


def _by_hand(args: list[str], log: Path, wait_s: float) -> tuple[list[int | None], str]:
    """The two ranks of ``_consume.py ARGS`` as processes of their own, not under torchrun.

    torchrun's agent would SIGTERM rank 0 itself once rank 1 died. Returns both
    return codes (``None``: still running after ``wait_s``, then killed) and the
    end of rank 0's stderr (written to ``log``: a pipe nobody reads could fill up).
    """
    port = _free_port()
    procs = []
    with open(log, "w") as err:
        for rank in (0, 1):
            env = _env() | {
                "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            }  # fmt: skip
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(SCRIPT), *args],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=err if rank == 0 else subprocess.DEVNULL,
                )
            )
    deadline = time.monotonic() + wait_s
    try:
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return codes, log.read_text()[-4000:]


@pytest.fixture(scope="module")
def split_runs(unequal_data: Path, tmp_path_factory: pytest.TempPathFactory) -> SplitRuns:
    """Two identical runs of ``SPLIT_LOADERS``: one under torchrun, one by hand (see SplitRuns)."""
    folder = tmp_path_factory.mktemp("split")
    common = ["--data", str(unequal_data)]
    early = folder / "early"
    proc = _torchrun(
        str(SCRIPT), "--early-collectives", str(early), "--record", str(folder / "run0"),
        *common, "--loaders", f"{SPLIT_LOADERS},{POISON_LOADERS}", timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    seen = {rank: json.loads(Path(f"{early}.rank{rank}").read_text()) for rank in (0, 1)}
    poisoned = {mode: _records(folder / f"run0-poison-{mode}") for mode in POISON_MODES}
    plan_failed = _records(folder / "run0-planfail-files")
    dies = [
        "--loaders",
        f"{SPLIT_LOADERS},ray/blocks/1/dies",
        "--die-after",
        "5",
        "--timeout",
        "60",
    ]
    codes, output = _by_hand(
        ["--record", str(folder / "run1"), *common, *dies], folder / "run1.stderr", wait_s=400
    )
    runs = []
    for run in range(2):
        records = {name: _records(Path(f"{folder}/run{run}-{name}")) for name in SPLIT_NAMES}
        for name, per_rank in records.items():  # every epoch of every loader, on both ranks
            for rank, epochs in per_rank.items():
                assert [e.get("epoch") for e in epochs] == list(range(SPLIT_EPOCHS[name])), (
                    run, name, rank, epochs[-1], output,
                )  # fmt: skip
        runs.append(records)
    dead = Path(f"{folder}/run1-ray-blocks-dies.rank0")
    lines = dead.read_text().splitlines() if dead.exists() else []
    return SplitRuns(runs, seen, poisoned, plan_failed, codes, lines, output)


@pytest.mark.timeout(840)  # the launches of split_runs run in the first test that needs them
def test_ray_data_split_is_exact_equal_and_reproducible(split_runs: SplitRuns) -> None:
    runs = [run["ray-blocks"] for run in split_runs.runs]
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
def test_direct_plans_run_on_raydls_actors_for_every_rank(split_runs: SplitRuns) -> None:
    """Every mode of a direct plan on the fast path under 2 ranks.

    A raydl read and a filter (its output size unknown in advance), in each mode:
    the global shuffle (rank 0's map phase, every rank reducing its share) and the
    streaming ones (rank 0 loads the runs and deals rows to the ranks).
    """
    runs = [{mode: run[f"raydl-{mode}"] for mode in MODES} for run in split_runs.runs]
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
        if mode == "global":  # after epoch 0 told the map output's size: whole runs
            layouts = ["whole runs" in first[0][epoch]["summary"] for epoch in range(3)]
            assert layouts == [False, True, True], [e["summary"] for e in first[0]]
        orders = {tuple(first[0][epoch]["ids"]) for epoch in range(3)}
        assert len(orders) == (1 if mode == "none" else 3), mode  # a new order per epoch
        assert _orders(runs[0][mode]) == _orders(runs[1][mode]), mode  # the same on a rerun
        # ... which stats()' fingerprints tell without the ids: equal on a rerun, new per epoch.
        prints = [[[e["fingerprint"] for e in run[mode][rank]] for rank in (0, 1)] for run in runs]
        assert prints[0] == prints[1], mode
        if mode != "none":
            assert len({p for rank in prints[0] for p in rank}) == 6, mode


@pytest.mark.timeout(300)
def test_raydl_readers_join_rank_0s_cluster_without_raydl_init(
    unequal_data: Path, tmp_path: Path
) -> None:
    """Each rank's first Ray call is ``raydl.read_parquet``, with no ``raydl.init()`` before it.

    Under torchrun the reader joins rank 0's cluster, so the loader after it runs on the
    shared path. A reader that started an embedded instance of its own on each rank would
    make rank 1's first ``iter()`` fail ("rank 1 is connected to the Ray cluster at ...,
    but rank 0 runs the job's cluster at ...").
    """
    prefix = tmp_path / "readers"
    proc = _torchrun(
        str(SCRIPT), "--no-init", "--record", str(prefix), "--data", str(unequal_data),
        "--loaders", "raydl/files/1", timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (first,), (second,) = (_records(prefix)[rank] for rank in (0, 1))
    for rank, record in enumerate((first, second)):
        assert f"rank {rank} of 2" in record["summary"], record  # rows dealt by rank 0's pool
    ids = first["ids"] + second["ids"]
    kept = [i for i in range(TOTAL_ROWS) if i % 10 != 7]  # _consume's filter drops the sevens
    assert len(first["ids"]) == len(second["ids"])
    assert len(set(ids)) == len(ids) and set(ids) <= set(kept) and len(ids) >= len(kept) - 1


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


@pytest.mark.timeout(840)  # the launches of split_runs run in the first test that needs them
def test_dead_rank_makes_the_other_fail_clearly(split_runs: SplitRuns) -> None:
    """Rank 1 is SIGKILLed mid-epoch; rank 0 must end with an error, not hang.

    The last loader of ``split_runs``' second launch, which runs by hand (not under
    torchrun, whose agent would SIGTERM rank 0 itself).
    """
    codes, lines = split_runs.dead_returncodes, split_runs.dead_lines
    assert codes[1] == -9, (codes, split_runs.dead_output)
    assert lines, split_runs.dead_output
    assert codes[0] is not None, "rank 0 still ran 400 s after the launch: it hangs"
    assert codes[0] != 0, split_runs.dead_output
    last = json.loads(lines[-1])
    assert "error" in last, lines
    assert last["after_s"] < 230


@pytest.mark.timeout(840)  # the launches of split_runs run in the first test that needs them
def test_background_start_never_races_the_scripts_own_collectives(split_runs: SplitRuns) -> None:
    """The loader is built, then DDP and 50 all-reduces run at once: no deadlock, one cluster.

    The first thing ``split_runs``' torchrun launch does (``_early_collectives.py``).
    """
    seen = split_runs.early
    assert all(seen[rank]["started_in_background"] for rank in (0, 1))
    assert seen[0]["gcs_address"] == seen[1]["gcs_address"]  # rank 1 joined rank 0's cluster
    for epoch in range(2):
        ids = [seen[rank]["epochs"][epoch] for rank in (0, 1)]
        assert len(ids[0]) == len(ids[1]) == 48  # equal shares, every step paired
        assert sorted(ids[0] + ids[1]) == list(range(96))  # every sample once
    assert seen[0]["epochs"][0] != seen[0]["epochs"][1]  # a new order per epoch


@pytest.mark.timeout(840)  # the launches of split_runs run in the first test that needs them
def test_a_run_that_fails_on_rank_0_fails_every_rank_with_its_cause(split_runs: SplitRuns) -> None:
    """A stage raises on one file while rank 0 loads for every rank; the script catches it.

    Rank 0 raises the stage's error, naming the file; rank 1, which waits for rows that
    rank 0 will never deal (or a map phase it will never post), raises at once an error
    naming rank 0 and that cause, instead of waiting until its timeout (60 s here; by
    default none). Under torchrun the agent would end rank 1 when rank 0's process died,
    but this script catches the error and goes on, as one that skips a bad epoch does.
    """
    for mode, per_rank in split_runs.poisoned.items():
        errors = {rank: per_rank[rank][-1] for rank in (0, 1)}
        assert all("error" in errors[rank] for rank in (0, 1)), (mode, errors)
        first_line = {rank: errors[rank]["error"].splitlines()[0] for rank in (0, 1)}
        assert first_line[0].startswith("ValueError: Caught ValueError in MapBatches(poison)")
        assert "part-2.parquet" in first_line[0], first_line
        assert first_line[1].startswith(
            "RayDLError: rank 1: rank 0 failed to load epoch 0, whose rows this rank was to "
            "take: ValueError: Caught ValueError in MapBatches(poison)"
        ), (mode, first_line[1])
        assert "part-2.parquet" in first_line[1], first_line
        assert "poison row 1500" in errors[1]["error"], errors[1]  # the stage's own message
        assert errors[1]["after_s"] < 50, (mode, errors[1])  # not the loader's timeout


@pytest.mark.timeout(840)  # the launches of split_runs run in the first test that needs them
def test_a_plan_that_fails_on_rank_0_fails_every_rank_with_its_cause(split_runs: SplitRuns) -> None:
    """A ``PerEpoch`` builder raises while rank 0 plans the epoch (a path that does not exist).

    Rank 0 plans every epoch and broadcasts the plan; the other ranks wait in that
    broadcast. Rank 0 now broadcasts its failure before raising it, so rank 1 raises an
    error naming rank 0 and the cause, instead of waiting in the broadcast for gloo's
    timeout (30 minutes by default) or pairing it with the script's next collective.
    """
    errors = {rank: split_runs.plan_failed[rank][-1] for rank in (0, 1)}
    missing = "read_parquet: path '"
    assert errors[0]["error"].startswith(f"FileNotFoundError: {missing}"), errors[0]
    assert "missing/part-9.parquet' does not exist" in errors[0]["error"], errors[0]
    assert errors[1]["error"] == (
        "RayDLError: rank 1: rank 0 failed to plan epoch 0, which every rank runs: "
        + errors[0]["error"]
    ), errors
    assert errors[1]["after_s"] < 50, errors[1]  # not the loader's timeout


def _running(procs: list[list[int]]) -> list[list[int]]:
    """Those of ``procs`` (pid, start time) still running (not zombies)."""
    left = []
    for pid, start in procs:
        with contextlib.suppress(OSError):
            data = Path(f"/proc/{pid}/stat").read_bytes()
            fields = data[data.rindex(b")") + 2 :].split()
            if fields[0] not in {b"Z", b"X"} and int(fields[19]) == start:
                left.append([pid, start])
    return left


@pytest.mark.timeout(180)
def test_a_job_whose_rank_0_ends_first_exits_0_on_every_rank(tmp_path: Path) -> None:
    """Rank 0's script ends first; rank 1 stays on rank 0's Ray longer than Ray's 5 s.

    ``_exit_order.py``: rank 1 waits for rank 0's process to end (at most 10 s), then
    uses Ray 8 s later. Were rank 0's exit to stop its Ray instance at once, Ray would
    end rank 1's process with status 1 ("Failed to connect to GCS within 5 seconds"),
    every time. Rank 0's exit waits for rank 1 to leave its cluster instead.
    """
    prefix = tmp_path / "exit"
    proc = _torchrun(str(EXIT_ORDER), str(prefix), timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Failed to connect to GCS" not in proc.stderr, proc.stderr[-5000:]
    records = {rank: json.loads(Path(f"{prefix}.rank{rank}").read_text()) for rank in (0, 1)}
    for epoch in range(2):
        ids = records[0]["epochs"][epoch] + records[1]["epochs"][epoch]
        assert sorted(ids) == list(range(200)), epoch  # every sample once
    ends = {rank: json.loads(Path(f"{prefix}.rank{rank}.end").read_text()) for rank in (0, 1)}
    assert ends[1]["still_on_ray"]  # after rank 0's script had ended
    procs = ends[0]["procs"] + ends[1]["procs"]
    assert procs, ends  # rank 0's Ray processes (and its reaper) were seen
    # Gone once torchrun has returned, give or take the reaper's grace for stragglers.
    deadline = time.monotonic() + 60
    while _running(procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _running(procs), _running(procs)
