"""GPU check for a machine with CUDA: device prefetch rate and placement.

Compares RayDataLoader(device="cuda") against a plain pinned-tensor copy loop
(the physical host-to-device limit for the same batches), and the copy stage's own
step (pageable batches staged through the pinned pool, then copied) against it too;
checks that every
batch arrives on the requested device with the right content. Prints one JSON
line; exits 1 on a wrong batch. Without CUDA it says so and exits 0.

    python benchmarks/gpu_check.py --batches 200 --mb 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch.utils.data import Dataset


class Blocks(Dataset[torch.Tensor]):
    """Sample i is a float32 block filled with i (content is checkable on the GPU)."""

    def __init__(self, n: int, floats: int) -> None:
        self.n = n
        self.floats = floats

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.floats,), float(i))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--mb", type=float, default=8.0, help="MB per batch")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "note": "no CUDA here; nothing to check"}))
        return

    from raydl import RayDataLoader

    batch = 8
    floats = int(args.mb * 2**20 / 4 / batch)
    data = Blocks(args.batches * batch, floats)
    device = torch.device("cuda", 0)

    # Baseline: pinned host batches copied in a loop (no loader at all).
    host = [
        torch.stack([data[i] for i in range(b * batch, (b + 1) * batch)]).pin_memory()
        for b in range(min(args.batches, 20))
    ]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for b in range(args.batches):
        host[b % len(host)].to(device, non_blocking=True)
    torch.cuda.synchronize()
    plain_gbps = args.batches * args.mb / 1024 / (time.perf_counter() - start)

    # The copier's own step: pageable host batches staged through the pinned pool
    # (stream/pinned.py) and copied on a side stream, reusing buffers once their event is done.
    from raydl._internal.stream.device import CudaCopier

    pageable = [h.clone() for h in host]  # not pinned, as a batch over the object store
    copier = CudaCopier(device)
    copier.start()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for b in range(args.batches):
        copier.ready(copier.copy(pageable[b % len(pageable)]))
    torch.cuda.synchronize()
    staged_gbps = args.batches * args.mb / 1024 / (time.perf_counter() - start)
    pool_buffers, pool_allocated = len(copier.pool), copier.pool.allocated

    loader = RayDataLoader(
        data,
        batch_size=batch,
        num_workers=4,
        persistent_workers=True,
        pin_memory=True,
        device=device,
        prefetch_factor=4,
    )
    wrong = 0
    for _ in loader:  # warm-up epoch: actors start, caches fill
        pass
    torch.cuda.synchronize()
    start = time.perf_counter()
    for b, x in enumerate(loader):
        if x.device != device or float(x[0, 0]) != float(b * batch):
            wrong += 1
    torch.cuda.synchronize()
    loader_gbps = args.batches * args.mb / 1024 / (time.perf_counter() - start)
    loader.close()
    print(
        json.dumps(
            {
                "cuda": True,
                "device": torch.cuda.get_device_name(0),
                "batches": args.batches,
                "mb_per_batch": args.mb,
                "plain_pinned_copy_GBps": round(plain_gbps, 2),
                "staged_pool_copy_GBps": round(staged_gbps, 2),
                "pool_buffers": pool_buffers,
                "pool_allocated": pool_allocated,
                "loader_prefetch_GBps": round(loader_gbps, 2),
                "ratio": round(loader_gbps / plain_gbps, 3),
                "wrong_batches": wrong,
            }
        )
    )
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
