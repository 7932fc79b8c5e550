"""Wall time of the DDP tutorial's shape (``train.py``) under torchrun, torch vs raydl.

    python benchmarks/ddp_tutorial/run.py --repeat 3 [--num-workers 0 2]

Each run is a fresh ``torchrun --nproc_per_node=2`` (Ray started and stopped
inside it); the table gives the median wall time and raydl over torch, per
``num_workers`` (the tutorial's own loader has 0).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

TRAIN = Path(__file__).resolve().parent / "train.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wall(loader: str, num_workers: int) -> float:
    began = time.perf_counter()
    subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            "--master_addr=127.0.0.1", f"--master_port={_port()}",
            str(TRAIN), "--loader", loader, "--num-workers", str(num_workers),
        ],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--num-workers", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    print("num_workers  torch s  raydl s  raydl/torch")
    for workers in args.num_workers:
        times: dict[str, list[float]] = {"torch": [], "raydl": []}
        for _ in range(args.repeat):  # interleaved: load drifts on a shared machine
            for loader in times:
                times[loader].append(_wall(loader, workers))
        torch_s, raydl_s = (statistics.median(times[k]) for k in ("torch", "raydl"))
        print(f"{workers:>11}  {torch_s:7.2f}  {raydl_s:7.2f}  {raydl_s / torch_s:10.2f}x")


if __name__ == "__main__":
    main()
