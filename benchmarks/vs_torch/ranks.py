"""``--ranks``: the tabular contenders under ``torchrun``, one loader per rank, a DDP-like loop.

Run (from anywhere; ``1`` is the baseline each contender's N-rank figure is compared to)::

    python benchmarks/bench_vs_torch.py --quick --workloads tabular --ranks 1 2 --out /tmp/bench_ranks2

For every rank count N and every contender that can run per rank (``torch``, ``raydl``
with ``shuffle_mode="files"``, ``raydl_global`` with ``shuffle_mode="global"``) the parent
launches ``python -m torch.distributed.run --nproc_per_node=N --master_addr=127.0.0.1
--master_port=<free port> bench_vs_torch.py --rank-worker CONTENDER tabular``, in two
interleaved rounds (round 2 in reverse order). Each rank:

* joins a gloo process group; ``raydl``'s contenders call ``raydl.init`` (rank 0 starts
  the embedded Ray with ``NUM_CPUS``, the other ranks join it) and build the same
  ``RayDataLoader`` as the single-process run, which splits each epoch across the ranks;
  ``torch`` builds its ``DataLoader`` over ``ParquetStream`` sharded by rank as a
  ``DistributedSampler`` would (``workloads.tabular.stream_shard``), with
  ``NUM_CPUS // N`` workers per rank: every N shares one node's CPU budget;
* runs 1 + ``--epochs`` epochs over the same generated data as the single-process run; per
  batch it makes the DDP step, a ``dist.all_reduce`` of a 1-element tensor. That tensor is
  the rank's "I have a batch" flag (1 or 0), so its sum also says whether every rank still
  has data: all ranks stop at the first step where one is out. torch's shards can give the
  ranks unequal batch counts, and a rank that stopped stepping would leave the others
  blocked in ``all_reduce``; raydl's ranks get equal counts, and stop together;
* then runs ``PACED_EPOCHS`` more epochs with a simulated training step per batch (a sleep
  of ``PACE`` times the rank's median warm time per batch): their time to first batch is
  the one a training loop sees, which gives the loader an epoch's length to prepare the
  next (a loop that only iterates leaves a global shuffle's barrier in every epoch);
  ``--ddp-step none`` drops the ``all_reduce`` (to measure what the step costs);
* writes ``RECORD.rank<r>.json`` (per epoch: wall time from ``iter()`` to the last step,
  samples and batches consumed, time to first batch, whether its iterator ran out) and
  ``RECORD.rank<r>.npz`` (the ids it consumed, per epoch).

The parent then checks, per epoch, that no id arrived twice across ranks nor outside the
epoch's expected ids, and that at most N-1 ids are missing (raydl drops up to N-1 rows to
give every rank as many); for ``torch`` the missing ids are exactly the batches a rank
held beyond the shortest rank's count (each rank that ran out delivered its whole shard),
and each rank's available batch count is computed from the files' rows after the filter.

Reported per contender and N (medians over the warm epochs, i.e. all but the first, of
both rounds): the aggregate samples/s, all ranks' samples of an epoch over the slowest
rank's epoch time; the ratio to ``torch`` at the same N; the ratio to the contender's own
1-rank figure; the slowest rank's epoch time, time to first batch (cold: the rank's start
to its first batch, Ray start included; warm: ``iter()`` to first batch; the slowest rank);
the batches per rank and the DDP steps taken in the first warm epoch; the paced time to
first batch (the last paced epoch, slowest rank). Paced epochs are checked for exactly-once
delivery like the others and left out of every other figure.

Writes ``OUT/results_ranks.json``, ``OUT/results_ranks.png``, ``OUT/runs_ranks.json``,
``OUT/ranks/`` (the ranks' records) and ``OUT/logs/``; prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .config import NUM_CPUS, SCRIPT, WorkerConfig, worker_env
from .contenders import REGISTRY, tabular_workers
from .measurement import batch_ids
from .report import chart_ranks, machine, markdown_ranks, metadata
from .workloads import WORKLOADS, TabularData
from .workloads.tabular import stream_shard

#: The workloads ``--ranks`` runs.
RANK_WORKLOADS = ("tabular",)
#: The environment variable that carries ``--ddp-step`` to the ranks.
DDP_STEP_ENV = "RAYDL_BENCH_DDP_STEP"
#: Paced epochs after the timed ones: a training step of ``PACE`` times the rank's own
#: median warm time per batch (so the loop runs at 1 / PACE of what the loader gave).
PACE = 2.0
PACED_EPOCHS = 2
#: ``--ddp-step`` choices, as the report describes them.
DDP_STEPS = {
    "all_reduce": "a 1-element all_reduce per batch that carries a has-data flag; every rank "
    "stops at the first step where any rank is out of data (torch's per-rank batch counts can "
    "differ: 'batches/rank' shows consumed / available)",
    "none": "none (--ddp-step none): each rank iterates its own batches, no collective per "
    "batch; a diagnosis of what the DDP step costs, not a training loop",
}


def rank_contenders(workload: str) -> list[str]:
    """The contenders that run ``workload`` one loader per rank, in run order.

    Args:
        workload: The workload's name.

    Returns:
        The contenders' names.
    """
    return [n for n, c in REGISTRY.items() if c.multirank and c.runs(workload)]


# --- in a rank ------------------------------------------------------------------------


@dataclass
class RankEpoch:
    """One rank's measurements of one epoch."""

    epoch: int
    samples: int
    batches: int
    seconds: float
    ttfb_s: float
    exhausted: bool  # its iterator ran out (otherwise another rank's did first)
    step_s: float = 0.0  # the simulated training step per batch (0: a timed epoch)


def ddp_epoch(
    batches: Iterable[Any], epoch: int, *, step_s: float = 0.0
) -> tuple[RankEpoch, np.ndarray]:
    """Iterate one epoch the way a DDP training loop does: an ``all_reduce`` per step.

    The step's 1-element tensor holds 1 while this rank has a batch, 0 once it has none;
    its sum is below the world size as soon as one rank is out, and then every rank stops
    (the batch in hand is not trained on). Every rank therefore makes the same number of
    ``all_reduce`` calls, and none blocks. With ``RAYDL_BENCH_DDP_STEP=none`` in the
    environment (``--ddp-step none``) there is no ``all_reduce``: each rank stops when its
    own batches run out (a diagnosis of what the step itself costs, not a DDP loop).

    Args:
        batches: The rank's batches of the epoch.
        epoch: The epoch's number.
        step_s: Seconds of simulated training per batch (a sleep; 0: none).

    Returns:
        The epoch's measurements and the ids of the batches stepped on, in order.
    """
    world_size = dist.get_world_size()
    synced = os.environ.get(DDP_STEP_ENV, "all_reduce") != "none"
    start = time.perf_counter()
    ttfb = -1.0
    ids: list[torch.Tensor] = []
    flag = torch.zeros(1)
    iterator = iter(batches)
    while True:
        batch = next(iterator, None)
        if batch is not None and ttfb < 0:
            ttfb = time.perf_counter() - start
        flag.fill_(0.0 if batch is None else 1.0)
        if synced:
            dist.all_reduce(flag)  # the DDP step
        if batch is None or (synced and int(flag.item()) < world_size):
            break
        ids.append(batch_ids(batch))
        if step_s:
            time.sleep(step_s)
    seconds = time.perf_counter() - start
    got = torch.cat(ids).numpy() if ids else np.empty(0, dtype=np.int64)
    return RankEpoch(epoch, len(got), len(ids), seconds, ttfb, batch is None, step_s), got


def main_rank(name: str, workload: str, cfg: WorkerConfig, record: str) -> int:
    """One rank of a ``torchrun`` launch: 1 + ``cfg.epochs`` DDP-like epochs, then its record.

    Args:
        name: The contender (a ``REGISTRY`` key).
        workload: The workload (one of ``RANK_WORKLOADS``).
        cfg: The run's config.
        record: The records' path prefix (``.rank<r>.json`` and ``.rank<r>.npz`` are added).

    Returns:
        The exit code, 0.
    """
    process_start = time.perf_counter()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = WORKLOADS[workload].load(cfg)
    loader = REGISTRY[name].loader(data)  # raydl's: raydl.init on every rank first
    epochs: list[RankEpoch] = []
    ids: list[np.ndarray] = []
    ttfb_cold = -1.0
    try:
        paced_epochs = PACED_EPOCHS if cfg.epochs else 0  # paced by the timed epochs' pace
        for epoch in range(1 + cfg.epochs + paced_epochs):
            step_s = 0.0
            if epoch > cfg.epochs:  # paced: the time to first batch a training loop sees
                step_s = PACE * statistics.median(e.seconds / e.batches for e in epochs[1:])
            stats, got = ddp_epoch(loader.epoch(epoch), epoch, step_s=step_s)
            if epoch == 0:
                ttfb_cold = time.perf_counter() - process_start - stats.seconds + stats.ttfb_s
            epochs.append(stats)
            ids.append(got)
    finally:
        loader.close()
    np.savez(f"{record}.rank{rank}.npz", ids=np.concatenate(ids), sizes=[len(i) for i in ids])
    Path(f"{record}.rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "world_size": dist.get_world_size(),
                "ttfb_cold_s": ttfb_cold,
                "epochs": [asdict(e) for e in epochs],
            }
        )
    )
    dist.barrier()
    dist.destroy_process_group()
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()
    return 0


# --- in the parent --------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``--master_port``).

    Returns:
        The port.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(
    name: str,
    workload: str,
    cfg: WorkerConfig,
    ranks: int,
    record: Path,
    timeout_s: float,
    ddp_step: str = "all_reduce",
) -> dict[str, Any]:
    """Launch ``torchrun`` with ``ranks`` ranks of one contender and read their records.

    Args:
        name: The contender.
        workload: The workload.
        cfg: The ranks' config.
        ranks: ``--nproc_per_node``.
        record: The ranks' records' path prefix; torchrun's output goes to ``record.log``.
        timeout_s: How long the launch may run (then its process group is killed).
        ddp_step: ``all_reduce`` (a DDP loop) or ``none`` (``--ddp-step``).

    Returns:
        ``{"ranks": [each rank's record], "wall_s": ...}``, or ``{"error": ...}``.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(SCRIPT),
        "--rank-worker",
        name,
        workload,
        "--config",
        json.dumps(asdict(cfg)),
        "--record",
        str(record),
    ]
    # torchrun sets OMP_NUM_THREADS=1 for N > 1 (and warns); set it for N = 1 as well.
    env = dict(worker_env(), OMP_NUM_THREADS="1", **{DDP_STEP_ENV: ddp_step})
    log = record.with_suffix(".log")
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks: our own session
            proc.wait()
            return {"error": f"timed out after {timeout_s:.0f} s (see {log})"}
    wall_s = time.perf_counter() - start
    paths = [Path(f"{record}.rank{r}.json") for r in range(ranks)]
    if code != 0 or not all(p.exists() for p in paths):
        return {"error": f"exit code {code} (see {log})"}
    records = [json.loads(p.read_text()) for p in paths]
    for r, rec in enumerate(records):
        npz = Path(f"{record}.rank{r}.npz")
        with np.load(npz) as saved:
            rec["ids"] = np.split(saved["ids"], np.cumsum(saved["sizes"])[:-1])
        npz.unlink()  # a few MB per launch; the checks below are what is kept
    return {"ranks": records, "wall_s": wall_s}


class Expected:
    """The ids each epoch must deliver, per file, computed once per epoch."""

    def __init__(self, data: TabularData) -> None:
        """Hold the workload.

        Args:
            data: The loaded tabular workload.
        """
        self.data = data
        self._per_file: dict[int, list[np.ndarray]] = {}

    def ids(self, epoch: int, files: Sequence[int] | None = None) -> np.ndarray:
        """The expected ids of ``files`` (default all) in ``epoch``, sorted.

        Args:
            epoch: The epoch.
            files: Indices into the workload's files.

        Returns:
            The ids.
        """
        if epoch not in self._per_file:
            self._per_file[epoch] = [
                self.data.expected_ids(epoch, [i]) for i in range(len(self.data.files))
            ]
        per_file = self._per_file[epoch]
        chosen = range(len(per_file)) if files is None else files
        return np.sort(
            np.concatenate([np.empty(0, dtype=np.int64)] + [per_file[i] for i in chosen])
        )

    def torch_shard(self, epoch: int, rank: int, world_size: int) -> tuple[np.ndarray, int]:
        """The ids the ``torch`` contender's rank reads in ``epoch``, and its batch count.

        Args:
            epoch: The epoch.
            rank: The rank.
            world_size: The ranks.

        Returns:
            The rank's expected ids (sorted) and how many batches its workers yield
            (each worker's rows in ``TABULAR_BATCH`` batches, its last one short).
        """
        workers = tabular_workers(world_size)
        shards = [
            stream_shard(
                len(self.data.files),
                epoch,
                rank=rank,
                world_size=world_size,
                worker=w,
                workers=workers,
            )
            for w in range(workers)
        ]
        batches = sum(
            math.ceil(len(self.ids(epoch, list(s))) / self.data.batch_size) for s in shards
        )
        return self.ids(epoch, [int(i) for s in shards for i in s]), batches


def check_run(name: str, run: dict[str, Any], expected: Expected) -> dict[str, Any]:
    """Check one launch's deliveries and fold its ranks' epochs into aggregate figures.

    Args:
        name: The contender.
        run: What ``spawn_ranks`` returned (without an error).
        expected: The expected ids.

    Returns:
        Per epoch: aggregate samples/s, slowest rank's seconds and time to first batch,
        batches per rank (consumed; ``torch``: also available), missing and duplicated
        ids, and whether the epoch passed the exactly-once check; plus the cold ttfb.
    """
    ranks = run["ranks"]
    world_size = len(ranks)
    epochs = []
    for e in range(len(ranks[0]["epochs"])):
        per_rank = [r["epochs"][e] for r in ranks]
        got = np.concatenate([r["ids"][e] for r in ranks])
        want = expected.ids(e)
        unique = np.unique(got)
        duplicated = len(got) - len(unique)
        stray = int(np.count_nonzero(~np.isin(unique, want)))
        missing = len(want) - (len(unique) - stray)
        slowest = max(p["seconds"] for p in per_rank)
        epoch = {
            "epoch": e,
            "samples": len(got),
            "slowest_s": slowest,
            "samples_per_s": len(got) / slowest,
            "ttfb_s": max(p["ttfb_s"] for p in per_rank),
            "batches": [p["batches"] for p in per_rank],
            "missing": int(missing),
            "duplicated": int(duplicated),
            "stray": stray,
            "paced": any(p.get("step_s", 0.0) > 0 for p in per_rank),
        }
        ok = duplicated == 0 and stray == 0
        if name == "torch":
            shards = [expected.torch_shard(e, r, world_size) for r in range(world_size)]
            epoch["available_batches"] = [b for _, b in shards]
            # A rank that ran out delivered its whole shard; the others stopped early.
            ok = ok and all(
                np.array_equal(np.sort(ranks[r]["ids"][e]), shards[r][0])
                for r in range(world_size)
                if per_rank[r]["exhausted"]
            )
        else:
            ok = ok and missing <= world_size - 1
        epoch["exactly_once"] = bool(ok)
        if not ok:
            print(
                f"    {name} x{world_size} epoch {e}: {len(got)} ids, {duplicated} duplicated, "
                f"{stray} unexpected, {missing} missing of {len(want)}",
                file=sys.stderr,
            )
        epochs.append(epoch)
    return {
        "epochs": epochs,
        "ttfb_cold_s": max(r["ttfb_cold_s"] for r in ranks),
        "exactly_once": all(e["exactly_once"] for e in epochs),
    }


def summarise_ranks(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Fold the rounds of one contender at one rank count into the published figures.

    Args:
        runs: The rounds' checked runs (or ``{"error": ...}``).

    Returns:
        Medians over the warm epochs of every round, the first warm epoch's batch counts
        of round 1, the most ids missing in an epoch, and whether every epoch passed.
    """
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {
            "samples_per_s": None,
            "exactly_once": False,
            "error": "; ".join(r["error"] for r in runs),
        }
    timed = [[e for e in r["epochs"] if not e.get("paced")] for r in ok]
    warm = [e for t in timed for e in t[1:]] or [e for t in timed for e in t]
    first = timed[0][1 if len(timed[0]) > 1 else 0]
    paced = [[e for e in r["epochs"] if e.get("paced")] for r in ok]
    out: dict[str, Any] = {
        "samples_per_s": statistics.median(e["samples_per_s"] for e in warm),
        "slowest_epoch_s": statistics.median(e["slowest_s"] for e in warm),
        "samples_per_epoch": statistics.median(e["samples"] for e in warm),
        "ttfb_cold_s": statistics.median(r["ttfb_cold_s"] for r in ok),
        "ttfb_warm_s": statistics.median(e["ttfb_s"] for e in warm),
        # The last paced epoch of each round: it follows a paced one.
        "ttfb_paced_s": statistics.median(p[-1]["ttfb_s"] for p in paced) if all(paced) else None,
        "batches": first["batches"],
        "available_batches": first.get("available_batches"),
        "max_missing": max(e["missing"] for r in ok for e in r["epochs"]),
        "exactly_once": len(ok) == len(runs) and all(r["exactly_once"] for r in ok),
    }
    if len(ok) < len(runs):
        out["error"] = "; ".join(r["error"] for r in runs if "error" in r)
    return out


def main_ranks(
    args: argparse.Namespace,
    base: WorkerConfig,
    *,
    workloads: Sequence[str],
    out: Path,
    command: str,
    versions_info: dict[str, str],
    mode: str,
    start: float,
) -> int:
    """The ``--ranks`` run: two interleaved rounds of launches, the checks, the report.

    Args:
        args: The parsed command line (``ranks``, ``contenders``, ``quick``, ``epochs``).
        base: The ranks' config (the data are generated already).
        workloads: The workloads to run (a subset of ``RANK_WORKLOADS``).
        out: The output folder.
        command: The command line, for the metadata.
        versions_info: What ``report.versions()`` returned.
        mode: ``quick`` or ``full``, with the scale if not 1.
        start: ``time.perf_counter()`` when the run started.

    Returns:
        The exit code: 1 if a contender lost or duplicated samples or failed, else 0.
    """
    (out / "ranks").mkdir(parents=True, exist_ok=True)
    timeout_s = 300.0 if args.quick else 1800.0
    counts = list(dict.fromkeys(args.ranks))
    raw: list[dict[str, Any]] = []
    results: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for workload in workloads:
        names = [
            n for n in rank_contenders(workload) if not args.contenders or n in args.contenders
        ]
        data = WORKLOADS[workload].load(base)
        assert isinstance(data, TabularData), f"{workload} is not a RANK_WORKLOADS workload"
        expected = Expected(data)
        checked: dict[tuple[str, int], list[dict[str, Any]]] = {}
        pairs = [(name, n) for n in counts for name in names]
        for round_no, order in ((1, pairs), (2, pairs[::-1])):
            for name, n in order:
                record = out / "ranks" / f"{workload}-{name}-x{n}-round{round_no}"
                run = spawn_ranks(name, workload, base, n, record, timeout_s, args.ddp_step)
                if "error" not in run:
                    run = {**check_run(name, run, expected), "wall_s": run["wall_s"]}
                run.update(contender=name, workload=workload, ranks=n, round=round_no)
                raw.append(run)
                checked.setdefault((name, n), []).append(run)
                if "error" in run:
                    print(f"  {workload} {name:13s} x{n} round {round_no}: FAILED {run['error']}")
                    continue
                timed = [e for e in run["epochs"][1:] if not e["paced"]]
                rates = [e["samples_per_s"] for e in timed] or [0.0]
                print(
                    f"  {workload} {name:13s} x{n} round {round_no}: "
                    f"{statistics.median(rates):10,.0f} samples/s (all ranks), "
                    f"batches/rank {run['epochs'][-1]['batches']}, "
                    f"exactly once {run['exactly_once']}, {run['wall_s']:.0f} s"
                )
        results[workload] = {
            name: {str(n): summarise_ranks(checked[(name, n)]) for n in counts} for name in names
        }
    machine_info = machine()
    meta = metadata(
        machine_info=machine_info,
        versions_info=versions_info,
        mode=mode,
        command=command,
        sizes=base.sizes,
        epochs=base.epochs,
        mapstyle_reps=0,
        elapsed_s=time.perf_counter() - start,
    )
    meta["ranks"] = {
        "counts": counts,
        "launcher": "python -m torch.distributed.run --nproc_per_node=N (gloo)",
        "cpu_budget": f"{NUM_CPUS} CPUs per node, shared by its ranks",
        "ddp_step": DDP_STEPS[args.ddp_step],
        "paced": f"{PACED_EPOCHS} epochs after the timed ones with a training step of {PACE:g}x "
        "the rank's median warm time per batch; 'ttfb warm, paced' is the last one's",
        "samples_per_s": "all ranks' samples of a warm epoch / the slowest rank's epoch time",
    }
    (out / "results_ranks.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=2)
    )
    (out / "runs_ranks.json").write_text(json.dumps(raw, indent=2))
    chart_ranks(results, out / "results_ranks.png", f"ranks ({mode}, {meta['date']})")
    print()
    print(f"{meta['date']}, {machine_info['cpu']}, {NUM_CPUS} CPUs per node, {mode}")
    print(markdown_ranks(results))
    print(f"\nDDP step: {DDP_STEPS[args.ddp_step]}.")
    print(f"\nwrote {out / 'results_ranks.json'}, {out / 'results_ranks.png'}")
    failed = [
        f"{w}/{name}/x{n}"
        for w, by in results.items()
        for name, per_n in by.items()
        for n, m in per_n.items()
        if not m["exactly_once"]
    ]
    if failed:
        print(f"FAILED (lost/duplicated samples or crashed): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
