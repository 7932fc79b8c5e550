"""Epoch time and time to first batch with 1 vs 2 torchrun ranks, and the cost of preserve_order.

Each configuration is a fresh ``torchrun`` launch over the same parquet data (a read ->
map_batches pipeline, global shuffle); rank 0 reports per-epoch wall time and time to
first batch. Run::

    python benchmarks/bench_ranks.py --rows 400000 --epochs 3 --out /tmp/bench_ranks
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


def _worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch.distributed as dist

    import raydl

    dist.init_process_group("gloo")
    raydl.init()
    import ray.data

    ds = ray.data.read_parquet(args.data).map_batches(
        lambda b: {"x": np.stack([b[f"f{i}"] for i in range(8)], 1), "id": b["id"]},
        batch_format="numpy",
    )
    loader = raydl.RayDataLoader(
        ds, batch_size=1024, shuffle=True, seed=0, deterministic=args.deterministic == "1"
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
    if dist.get_rank() == 0:
        Path(args.report).write_text(json.dumps(results))
    loader.close()
    dist.barrier()
    dist.destroy_process_group()


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
    summary = {}
    for ranks, deterministic in [(1, "1"), (2, "1"), (2, "0")]:
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
        ]
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        subprocess.run(cmd, check=True, env=env, capture_output=True)
        epochs = json.loads(report.read_text())
        name = f"{ranks}rank{'s' if ranks > 1 else ''}_preserve_order={deterministic == '1'}"
        summary[name] = epochs
        warm = epochs[1:] or epochs
        print(
            f"{name}: epoch0 {epochs[0]['elapsed_s']:.2f}s (ttfb {epochs[0]['ttfb_s']:.2f}s); "
            f"warm epochs {sum(e['elapsed_s'] for e in warm) / len(warm):.2f}s "
            f"(ttfb {sum(e['ttfb_s'] for e in warm) / len(warm):.2f}s), "
            f"rows/rank {epochs[0]['rows_rank']}"
        )
    (out / "results.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
