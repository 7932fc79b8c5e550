"""GPU check for a machine with CUDA: device prefetch rate and placement.

Compares RayDataLoader(device="cuda") against a plain pinned-tensor copy loop
(the physical host-to-device limit for the same batches), and the copy stage's own
step (pageable batches staged through the pinned pool, then copied) against it too;
times raydl and torch's DataLoader on the same dataset (4 workers each), to
the device (torch's batches moved as a torch script does, ``.to(device, non_blocking=True)``)
and on the host (pinned, then plain), so that what the copy itself costs shows; checks that every
batch arrives on the requested device with the right content. Then the same for the
other source kinds: a ``raydl.read_parquet`` plan with a ``map_batches`` stage on the
direct path (files order and the global shuffle, two epochs each) and a
``ray.data`` dataset, each row exactly once per epoch, on the device. Prints one JSON
line; exits 1 on a wrong batch. Without CUDA it says so and exits 0.

    python benchmarks/gpu_check.py --batches 200 --mb 8
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
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


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _warm_up(loader: Any, most_s: float = 60.0) -> None:
    """Epochs until the workers are up: for raydl, until an epoch loaded nothing in this process.

    While raydl's actors start, a map-style epoch's batches load in the trainer
    (``start_in_process``); timed epochs must not include that phase.
    """
    deadline = time.monotonic() + most_s
    while True:
        for _ in loader:
            pass
        stats = loader.stats()["epochs"][-1] if hasattr(loader, "stats") else {}
        if "training process" not in str(stats.get("ray_data")) or time.monotonic() > deadline:
            return


def _rate(
    loader: Any,
    device: torch.device | None,
    *,
    batch: int,
    batches: int,
    mb: float,
    pinned: bool = False,
) -> tuple[float, int]:
    """Median GB/s of three warm epochs; wrong batches (content, device, pinned where asked).

    Each batch goes to ``device`` as a torch user writes it (``.to(device, non_blocking=True)``,
    nothing to do where the loader put it there already).
    """
    wrong, rates = 0, []
    _warm_up(loader)
    for _ in range(3):
        _sync()
        start = time.perf_counter()
        firsts = []  # each batch's first value, read back once per epoch (no sync per batch)
        for x in loader:
            if device is not None:
                x = x.to(device, non_blocking=True)
            if x.device != (device or torch.device("cpu")) or (pinned and not x.is_pinned()):
                wrong += 1
            firsts.append(x[0, 0].clone())  # a view would keep the whole batch alive
        _sync()
        rates.append(batches * mb / 1024 / (time.perf_counter() - start))
        expected = torch.arange(0, batches * batch, batch, dtype=torch.float32)
        wrong += int((torch.stack(firsts).cpu() != expected).sum())
    if hasattr(loader, "close"):
        loader.close()
    return sorted(rates)[1], wrong


def loader_rates(
    data: Dataset[torch.Tensor], batch: int, device: torch.device | None, batches: int, mb: float
) -> tuple[dict[str, float], int]:
    """raydl and torch's DataLoader on the same dataset, 4 workers each: to the device, on the host."""
    from torch.utils.data import DataLoader

    from raydl import RayDataLoader

    common: dict[str, Any] = {
        "batch_size": batch,
        "num_workers": 4,
        "persistent_workers": True,
        "prefetch_factor": 4,
    }
    runs: dict[str, tuple[Any, torch.device | None]] = {
        "raydl_device": (
            lambda: RayDataLoader(data, pin_memory=True, device=device, **common),
            device,
        ),
        "torch_pinned_to_device": (lambda: DataLoader(data, pin_memory=True, **common), device),
        "raydl_host_pinned": (lambda: RayDataLoader(data, pin_memory=True, **common), None),
        "torch_host_pinned": (lambda: DataLoader(data, pin_memory=True, **common), None),
        "raydl_host": (lambda: RayDataLoader(data, **common), None),
        "torch_host": (lambda: DataLoader(data, **common), None),
    }
    rates, wrong = {}, 0
    for name, (make, target) in runs.items():
        if device is None and "pinned" in name:
            continue  # pinning needs CUDA
        pinned = name.endswith("host_pinned")
        gbps, bad = _rate(make(), target, batch=batch, batches=batches, mb=mb, pinned=pinned)
        rates[f"{name}_GBps"] = round(gbps, 2)
        wrong += bad
    return rates, wrong


def _double(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A ``map_batches`` stage: ``x`` doubled, so its content is checkable against ``id``."""
    return {"id": batch["id"], "x": batch["x"] * 2}


def _epochs_on_device(loader: Any, rows: int, device: torch.device) -> dict[str, Any]:
    """Two epochs; every batch's tensors on ``device``, ``x == 2 * id``, each id once."""
    wrong, rates = 0, []
    for epoch in range(2):
        seen: list[torch.Tensor] = []
        start = time.perf_counter()
        for batch in loader:
            ids, x = batch["id"], batch["x"]
            if ids.device != device or x.device != device or not bool((x == 2 * ids).all()):
                wrong += 1
            seen.append(ids)
        _sync()
        rates.append(rows / (time.perf_counter() - start))
        got = torch.cat(seen).cpu()
        if not torch.equal(got.sort().values, torch.arange(rows, dtype=got.dtype)):
            wrong += 1
        if epoch == 0:
            first = got
        elif torch.equal(got, first):
            wrong += 1  # a shuffled loader must give a new order per epoch
    loader.close()
    return {"wrong": wrong, "rows_per_s": [round(r) for r in rates]}


def check_sources(device: torch.device, rows: int = 200_000) -> dict[str, Any]:
    """Plans of the other source kinds with ``device=``: rows once per epoch, on the device."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray.data

    import raydl
    from raydl import RayDataLoader

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        per_file = rows // 8
        for f in range(8):
            ids = np.arange(f * per_file, (f + 1) * per_file, dtype=np.int64)
            table = pa.table({"id": ids, "x": ids.astype(np.float64)})
            pq.write_table(table, Path(tmp) / f"part-{f}.parquet")
        for mode in ("files", "global"):
            plan = raydl.read_parquet(tmp).map_batches(_double)
            loader = RayDataLoader(
                plan,
                batch_size=1024,
                shuffle=True,
                shuffle_mode=mode,
                seed=0,
                pin_memory=device.type == "cuda",
                device=device,
            )
            out[f"parquet_{mode}"] = _epochs_on_device(loader, rows, device)
        dataset = ray.data.read_parquet(tmp).map_batches(_double, batch_format="numpy")
        loader = RayDataLoader(
            dataset,
            batch_size=1024,
            shuffle=True,
            seed=0,
            pin_memory=device.type == "cuda",
            device=device,
        )
        out["ray_data"] = _epochs_on_device(loader, rows, device)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--mb", type=float, default=8.0, help="MB per batch")
    parser.add_argument(
        "--sources-on-cpu",
        action="store_true",
        help="only the source-kinds part, on the CPU (checks this script without a GPU)",
    )
    parser.add_argument("--no-sources", action="store_true", help="skip the source-kinds part")
    args = parser.parse_args()
    if args.sources_on_cpu:
        sources = check_sources(torch.device("cpu"), rows=20_000)
        print(json.dumps({"cuda": False, "sources": sources}))
        sys.exit(1 if any(result["wrong"] for result in sources.values()) else 0)
    if not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "note": "no CUDA here; nothing to check"}))
        return

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

    # The loaders: raydl and torch, to the device and on the host.
    rates, wrong = loader_rates(data, batch, device, args.batches, args.mb)
    sources = {} if args.no_sources else check_sources(device)
    wrong += sum(result["wrong"] for result in sources.values())
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
                **rates,
                "raydl_device_over_plain_copy": round(rates["raydl_device_GBps"] / plain_gbps, 3),
                "raydl_device_over_torch": round(
                    rates["raydl_device_GBps"] / rates["torch_pinned_to_device_GBps"], 3
                ),
                "sources": sources,
                "wrong_batches": wrong,
            }
        )
    )
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
