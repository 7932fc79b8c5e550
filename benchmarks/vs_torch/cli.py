"""The command line: the parent process's rounds of subprocesses, and a ``--worker``'s run.

The parent generates the data, then runs every contender in a fresh interpreter
(``bench_vs_torch.py --worker CONTENDER WORKLOAD --config JSON``), which prints one
``RESULT_PREFIX`` line of JSON. Round 1 runs the contenders in registry order, round 2
in reverse; round 2 adds the stall epochs, at demands relative to round 1's ``limit``.

With ``--ranks N ...`` the parent instead launches ``torchrun`` per contender and rank
count, and every rank runs ``bench_vs_torch.py --rank-worker`` (see ``ranks``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from .config import (
    BENCH_DIR,
    FULL,
    NUM_CPUS,
    QUICK,
    RESULT_PREFIX,
    SCRIPT,
    WorkerConfig,
    worker_env,
)
from .contenders import SWEPT, SWEPT_WORKLOADS, contenders_for
from .measurement import run_worker, summarise
from .ranks import RANK_WORKLOADS, main_rank, main_ranks
from .report import chart, machine, markdown, metadata, versions, write_json
from .workloads import calibrate_mapstyle, default_workloads, generate

__all__ = ["BENCH_DIR", "SCRIPT", "main", "main_parent", "main_worker", "parse_args"]


def spawn_worker(
    name: str, workload: str, cfg: WorkerConfig, log: Path, timeout_s: float
) -> dict[str, Any]:
    """Run one contender in a fresh interpreter and read its JSON result line.

    Args:
        name: The contender.
        workload: The workload.
        cfg: The worker's config.
        log: Where the worker's stderr goes.
        timeout_s: How long the worker may run.

    Returns:
        The worker's measurements plus ``wall_s``, or ``{"error": ...}``.
    """
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--worker",
        name,
        workload,
        "--config",
        json.dumps(asdict(cfg)),
    ]
    env = worker_env()
    start = time.perf_counter()
    with log.open("w") as err:
        try:
            proc = subprocess.run(
                cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s:.0f} s (see {log})"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit code {proc.returncode} (see {log})"}
    result: dict[str, Any] = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["wall_s"] = time.perf_counter() - start
    return result


def run_rounds(
    workload: str,
    names: Sequence[str],
    base: WorkerConfig,
    *,
    quick: bool,
    out: Path,
    timeout_s: float,
    runs: list[dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """Both rounds of one workload; each run's raw measurements are appended to ``runs``.

    Args:
        workload: The workload.
        names: Its contenders, in round 1's order.
        base: The workers' config, without stall steps.
        quick: Quick mode (stall epochs at 0.5x only; otherwise 0.5x and 1.0x).
        out: The output folder (logs go to ``out/logs``).
        timeout_s: How long one worker may run.
        runs: Every run so far; this workload's are appended.

    Returns:
        Contender -> its published metrics.
    """
    by_name: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    limit_rate: float | None = None
    for round_no, order in ((1, list(names)), (2, list(names)[::-1])):
        for name in order:
            stall_steps: list[tuple[str, float]] = []
            if round_no == 2 and limit_rate:
                demands = (0.5,) if quick else (0.5, 1.0)
                stall_steps = [(f"{d:.1f}x", 1.0 / (d * limit_rate)) for d in demands]
            cfg = replace(base, stall_steps=stall_steps)
            log = out / "logs" / f"{workload}-{name}-round{round_no}.log"
            result = spawn_worker(name, workload, cfg, log, timeout_s)
            result.update(round=round_no, contender=name, workload=workload)
            runs.append(result)
            by_name[name].append(result)
            if "error" in result:
                print(f"  {workload:15s} {name:13s} round {round_no}: FAILED {result['error']}")
                continue
            rate = statistics.median(result["epoch_samples_per_s"])
            print(
                f"  {workload:15s} {name:13s} round {round_no}: {rate:12,.0f} samples/s, "
                f"cold ttfb {result['ttfb_cold_s']:.2f} s, exactly once "
                f"{result['exactly_once']}, {result['wall_s']:.0f} s"
            )
            if name == "limit" and round_no == 1:
                limit_rate = rate
    return {n: summarise(r) for n, r in by_name.items()}


def main_parent(args: argparse.Namespace) -> int:
    """Generate the data, run every workload's rounds, write and print the results.

    Args:
        args: The parsed command line.

    Returns:
        The exit code: 1 if a contender lost or duplicated samples or failed, 2 without
        matplotlib, else 0.
    """
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    mode = "quick" if args.quick else "full"
    sizes = QUICK if args.quick else FULL
    if args.scale != 1.0:
        sizes = sizes.scaled(args.scale)
        mode += f" (scale {args.scale})"
    try:
        import matplotlib  # noqa: F401  # the chart is drawn last: fail before the runs
    except ImportError:
        print(
            "bench_vs_torch.py draws results.png with matplotlib, which is not installed: "
            "python -m pip install -e '.[bench]'",
            file=sys.stderr,
        )
        return 2
    if args.ranks:
        workloads = args.workloads or list(RANK_WORKLOADS)
        unsupported = sorted(set(workloads) - set(RANK_WORKLOADS))
        if unsupported or min(args.ranks) < 1:
            print(
                f"--ranks runs the workloads {', '.join(RANK_WORKLOADS)} with at least 1 rank, "
                f"got --workloads {' '.join(workloads)} --ranks "
                f"{' '.join(map(str, args.ranks))}: drop the others",
                file=sys.stderr,
            )
            return 2
    else:
        workloads = args.workloads or default_workloads(args.quick, args.latency)
    info = versions()
    print(f"command: {command}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    data_dir = Path(args.data_dir) if args.data_dir else out / "data"
    start = time.perf_counter()
    generate(data_dir, sizes, workloads)
    print(f"data: generated in {time.perf_counter() - start:.1f} s under {data_dir}")
    if args.ranks:
        base = WorkerConfig(data_dir=str(data_dir), sizes=sizes, epochs=args.epochs)
        return main_ranks(
            args,
            base,
            workloads=workloads,
            out=out,
            command=command,
            versions_info=info,
            mode=mode,
            start=start,
        )
    reps = calibrate_mapstyle() if "mapstyle" in workloads else 0
    base = WorkerConfig(
        data_dir=str(data_dir),
        sizes=sizes,
        epochs=args.epochs,
        mapstyle_reps=reps,
        latency_ms=sizes.latency_ms,
        mem_interval_s=0.5,
    )
    timeout_s = 300.0 if args.quick else 1800.0
    runs: list[dict[str, Any]] = []
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for workload in workloads:
        names = [n for n in contenders_for(workload) if not args.contenders or n in args.contenders]
        names += variants(workload, args.sweep_workers, args.pause_before_iter)
        results[workload] = run_rounds(
            workload, names, base, quick=args.quick, out=out, timeout_s=timeout_s, runs=runs
        )
    machine_info = machine()
    meta = metadata(
        machine_info=machine_info,
        versions_info=info,
        mode=mode,
        command=command,
        sizes=sizes,
        epochs=args.epochs,
        mapstyle_reps=reps,
        elapsed_s=time.perf_counter() - start,
    )
    write_json(out, meta, results, runs)
    chart(results, out / "results.png", f"raydl vs torch ({mode}, {meta['date']})")
    print()
    print(f"{meta['date']}, {machine_info['cpu']}, {NUM_CPUS} CPUs per contender, {mode}")
    print(markdown(results))
    print(f"\nwrote {out / 'results.json'}, {out / 'results.png'} in {meta['elapsed_s']} s")
    failed = [
        f"{w}/{n}" for w, by in results.items() for n, m in by.items() if not m["exactly_once"]
    ]
    if failed:
        print(f"FAILED (lost/duplicated samples or crashed): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def variants(workload: str, sweep: Sequence[int] | None, pause_s: float | None) -> list[str]:
    """The extra contenders of a workload: a ``num_workers`` sweep and a paused cold start.

    Args:
        workload: The workload.
        sweep: ``--sweep-workers``: the ``num_workers`` values (map-style and image workloads).
        pause_s: ``--pause-before-iter``: seconds between building the loader and ``iter()``.

    Returns:
        Contender names such as ``torch_w4``, ``raydl_w4``, ``raydl_pause3``.
    """
    names = []
    if sweep and workload in SWEPT_WORKLOADS:
        names += [f"{loader}_w{n}" for n in sweep for loader in SWEPT]
    if pause_s:
        names += [f"{loader}_pause{pause_s:g}" for loader in SWEPT]
    return names


def main_worker(args: argparse.Namespace) -> int:
    """Run one contender on one workload and print its result line.

    Args:
        args: The parsed command line (``--worker`` and ``--config`` set).

    Returns:
        The exit code, 0.
    """
    name, workload = args.worker
    cfg = WorkerConfig.from_json(json.loads(args.config))
    result = run_worker(name, workload, cfg)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()
    return 0


def parse_args(
    argv: Sequence[str] | None = None, description: str | None = None
) -> argparse.Namespace:
    """Parse the command line.

    Args:
        argv: The arguments (default ``sys.argv[1:]``).
        description: The ``--help`` text's description.

    Returns:
        The parsed arguments.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes, about 5 minutes")
    parser.add_argument("--out", default="bench_out", help="output folder")
    parser.add_argument("--data-dir", help="where to generate the data (default OUT/data)")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per process")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply sizes (development)")
    parser.add_argument("--latency", action="store_true", help="quick mode: add images_latency")
    parser.add_argument("--workloads", nargs="+", help="run only these workloads")
    parser.add_argument("--contenders", nargs="+", help="run only these contenders")
    parser.add_argument(
        "--sweep-workers",
        nargs="+",
        type=int,
        metavar="N",
        help="also run torch and raydl at each num_workers N (map-style and image workloads); "
        "the table then shows each loader's best setting",
    )
    parser.add_argument(
        "--pause-before-iter",
        type=int,
        metavar="S",
        help="also run torch and raydl with S seconds between building the loader and iter() "
        "(a cold start: ttfb from iter() and from process start)",
    )
    parser.add_argument(
        "--ranks",
        nargs="+",
        type=int,
        metavar="N",
        help="run the tabular workload under torchrun with N ranks each (e.g. 1 2)",
    )
    parser.add_argument(
        "--ddp-step",
        choices=("all_reduce", "none"),
        default="all_reduce",
        help="with --ranks: the per-batch step, a DDP-like all_reduce (default) or none "
        "(to see what the step itself costs)",
    )
    parser.add_argument(
        "--rank-worker", nargs=2, metavar=("CONTENDER", "WORKLOAD"), help=argparse.SUPPRESS
    )
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument(
        "--worker", nargs=2, metavar=("CONTENDER", "WORKLOAD"), help=argparse.SUPPRESS
    )
    parser.add_argument("--config", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, description: str | None = None) -> int:
    """The benchmark's entry point: the parent run, or a ``--worker`` subprocess.

    Args:
        argv: The arguments (default ``sys.argv[1:]``).
        description: The ``--help`` text's description.

    Returns:
        The exit code.
    """
    args = parse_args(argv, description)
    if args.worker:
        return main_worker(args)
    if args.rank_worker:
        name, workload = args.rank_worker
        return main_rank(
            name, workload, WorkerConfig.from_json(json.loads(args.config)), args.record
        )
    return main_parent(args)
