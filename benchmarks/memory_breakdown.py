"""Where a contender's peak memory is, process by process: shared and private pages.

    python benchmarks/bench_vs_torch.py --workloads images --contenders torch --out /tmp/bm
    python benchmarks/memory_breakdown.py torch images /tmp/bm/data
    python benchmarks/memory_breakdown.py raydl images /tmp/bm/data [--epochs 4]

Runs ``--epochs`` epochs of one contender of ``bench_vs_torch.py`` on data it
generated (a ``--data-dir`` with its ``manifest.json``), in this process, and
samples the process tree's PSS every 50 batches as the benchmark does
(``vs_torch.measurement.tree_pss``). At the highest sample it reads each
process's ``/proc/PID/smaps_rollup``; the table shows those figures in MB:
``pss`` is what the benchmark's peak adds up, ``private dirty`` what the process
wrote that no other holds (what it would cost on its own), ``shared dirty`` what it
shares after writing it (a forked child's inherited pages). Linux only.
docs/design/embedded-runtime.md, "The floor", reads such a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Ray's workers unpickle the benchmark's stages by reference: they must find vs_torch too.
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")])
)

#: The ``smaps_rollup`` fields shown, and their column names.
FIELDS = {
    "Rss": "rss",
    "Pss": "pss",
    "Shared_Clean": "shared clean",
    "Shared_Dirty": "shared dirty",
    "Private_Clean": "private clean",
    "Private_Dirty": "private dirty",
}


def rollup(pid: int) -> dict[str, int] | None:
    """``pid``'s :data:`FIELDS` in KiB, or ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        parts = line.split()
        name = parts[0].rstrip(":")
        if name in FIELDS:
            out[name] = int(parts[1])
    return out


def main() -> None:
    """Run the epochs, then print the table at the peak."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("contender", help="torch, raydl, ... (bench_vs_torch.py's names)")
    parser.add_argument("workload", help="images, tabular, mapstyle, ...")
    parser.add_argument("data_dir", help="a folder bench_vs_torch.py generated")
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()

    import psutil
    from vs_torch import config
    from vs_torch.contenders import contender
    from vs_torch.measurement import process_kind, tree_pss
    from vs_torch.workloads import WORKLOADS

    sizes = json.loads((Path(args.data_dir) / "manifest.json").read_text())["sizes"]
    cfg = config.WorkerConfig(data_dir=args.data_dir, sizes=config.Sizes(**sizes))
    loader = contender(args.contender).loader(WORKLOADS[args.workload].load(cfg))
    me = psutil.Process()
    peak, at_peak = 0, {}
    try:
        for epoch in range(args.epochs):
            for i, _ in enumerate(loader.epoch(epoch)):
                if i % 50:
                    continue
                total = tree_pss()
                if total > peak:
                    peak = total
                    at_peak = {
                        f"{process_kind(proc, me)} {proc.pid}": rollup(proc.pid)
                        for proc in [me, *me.children(recursive=True)]
                    }
    finally:
        loader.close()
    print(f"{args.contender}, {args.workload}: peak {peak >> 20} MB PSS (the process tree)")
    print("| process | " + " | ".join(FIELDS.values()) + " |")
    print("|---|" + "---:|" * len(FIELDS))
    rows = [(name, fields) for name, fields in at_peak.items() if fields]
    for name, fields in sorted(rows, key=lambda row: -row[1].get("Pss", 0)):
        cells = " | ".join(str(fields.get(field, 0) >> 10) for field in FIELDS)
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
