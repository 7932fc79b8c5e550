"""Epoch time and time to first batch with 1 vs 2 torchrun ranks, and the cost of preserve_order.

Each configuration is a fresh ``torchrun`` launch over the same parquet data (a read ->
map_batches pipeline); every rank reports per-epoch wall time and time to first batch,
and the summary gives the aggregate rows/s (all ranks' rows over the slowest rank's
epoch), its ratio to 1 rank, and the warm time to first batch of each rank (the epoch
boundary). ``--reader ray`` (Ray's reader: Ray Data executions, ``streaming_split``
under 2 ranks, with and without preserve_order) or ``--reader raydl`` (raydl's reader: a
direct plan on raydl's actors for every rank); ``--shuffle-mode`` as the loader's. Run::

    python benchmarks/bench_ranks.py --rows 400000 --epochs 3 --out /tmp/bench_ranks
    python benchmarks/bench_ranks.py --reader raydl --shuffle-mode files --out /tmp/bench_ranks
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import raydl

    dist.init_process_group("gloo")
    raydl.init()
    import ray.data

    read = raydl.read_parquet if args.reader == "raydl" else ray.data.read_parquet
    ds = read(args.data).map_batches(_features, batch_format="numpy")
    loader = raydl.RayDataLoader(
        ds,
        batch_size=1024,
        shuffle=args.shuffle_mode != "none",
        shuffle_mode="files" if args.shuffle_mode == "none" else args.shuffle_mode,
        seed=0,
        deterministic=args.deterministic == "1",
    )
    results = []
    for epoch in range(args.epochs):
        start = time.perf_counter()
        first = None
        rows = 0
        for batch in loader:
            if first is None:
                first = time.perf_counter() - start
            rows += len(batch["id"])
        results.append(
            {
                "epoch": epoch,
                "elapsed_s": time.perf_counter() - start,
                "ttfb_s": first,
                "rows_rank": rows,
            }
        )
    Path(f"{args.report}.rank{dist.get_rank()}").write_text(json.dumps(results))
    loader.close()
    dist.barrier()
    dist.destroy_process_group()


def _features(b: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    return {"x": np.stack([b[f"f{i}"] for i in range(8)], 1), "id": b["id"]}


def _make_data(root: Path, rows: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    files = 8
    for f in range(files):
        n = rows // files
        cols = {f"f{i}": rng.standard_normal(n).astype(np.float32) for i in range(8)}
        cols["id"] = np.arange(f * n, (f + 1) * n)
        pq.write_table(pa.table(cols), root / f"part-{f}.parquet")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default="bench_out/ranks")
    parser.add_argument("--reader", choices=["ray", "raydl"], default="ray")
    parser.add_argument("--shuffle-mode", default="global", help="global, files, blocks or none")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    parser.add_argument("--deterministic", default="1", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return

    print("command:", " ".join([sys.executable, *sys.argv]))
    out = Path(args.out)
    data = out / "data"
    _make_data(data, args.rows)
    summary: dict[str, Any] = {}
    configs = [(1, "1"), (2, "1")] + ([(2, "0")] if args.reader == "ray" else [])
    one_rank = None
    for ranks, deterministic in configs:
        report = out / f"r{ranks}_d{deterministic}.json"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={ranks}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            __file__,
            "--worker",
            "--data",
            str(data),
            "--report",
            str(report),
            "--epochs",
            str(args.epochs),
            "--deterministic",
            deterministic,
            "--reader",
            args.reader,
            "--shuffle-mode",
            args.shuffle_mode,
        ]
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        subprocess.run(cmd, check=True, env=env, capture_output=True)
        per_rank = [json.loads(Path(f"{report}.rank{r}").read_text()) for r in range(ranks)]
        name = f"{ranks}rank{'s' if ranks > 1 else ''}_preserve_order={deterministic == '1'}"
        summary[name] = per_rank
        epochs = per_rank[0]
        warm = range(1, len(epochs)) if len(epochs) > 1 else range(len(epochs))
        # all ranks' rows of a warm epoch over the slowest rank's time, averaged over warm epochs
        rates = [
            sum(p[e]["rows_rank"] for p in per_rank) / max(p[e]["elapsed_s"] for p in per_rank)
            for e in warm
        ]
        rate = sum(rates) / len(rates)
        one_rank = rate if ranks == 1 else one_rank
        ratio = f" ({rate / one_rank:.2f}x 1 rank)" if ranks > 1 and one_rank else ""
        boundary = [max(p[e]["ttfb_s"] for e in warm) for p in per_rank]
        print(
            f"{name}: epoch0 {epochs[0]['elapsed_s']:.2f}s (ttfb {epochs[0]['ttfb_s']:.2f}s); "
            f"warm epochs {sum(epochs[e]['elapsed_s'] for e in warm) / len(warm):.2f}s, "
            f"aggregate {rate:,.0f} rows/s{ratio}; warm ttfb per rank (worst) "
            f"{', '.join(f'{b:.3f}s' for b in boundary)}; rows/rank {epochs[0]['rows_rank']}"
        )
    (out / "results.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
