"""A rank script for the edge-input test: tiny and empty sources under two ranks.

Launched by torchrun from ``test_edge_inputs.py``; writes one JSON object per
rank to ``<record>.rank<r>``: for each case the ids this rank got, its batch
count and ``len(loader)``, or the error it raised.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import ray
import torch.distributed as dist
from _faulty import SizedData

import raydl


def _run(loader: raydl.RayDataLoader, key: str) -> dict[str, Any]:
    try:
        length: int | str = len(loader)
    except TypeError as err:
        length = f"TypeError: {err}"
    try:
        batches = [batch[key] if isinstance(batch, dict) else batch for batch in loader]
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}", "len": length}
    ids = [int(i) for batch in batches for i in batch.flatten().tolist()]
    return {"ids": ids, "batches": len(batches), "len": length}


def main(record: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    raydl.init(num_cpus=2)
    cases = {
        "ray_one_row": (ray.data.range(1), {"batch_size": 4}),
        "ray_big_batch": (ray.data.range(10), {"batch_size": 64}),
        "map_one_row": (SizedData(1), {"batch_size": 4, "num_workers": 1}),
    }
    results = {}
    for name, (source, kwargs) in cases.items():
        loader = raydl.RayDataLoader(source, timeout=60, **kwargs)
        results[name] = _run(loader, "id")
        loader.close()
    with open(f"{record}.rank{rank}", "w") as out:
        json.dump(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
