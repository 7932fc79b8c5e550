"""Per-batch conversion out of Ray's object store: the copy raydl made before, and none now.

A worker's reply (a 64x3x224x224 float32 batch by default, 38 MB) is put in the
object store once; each repetition ``ray.get``s it and turns it into tensors, the
way the fetch thread does:

* ``copy`` (before issue 16): the read-only array copied (``owned=False``, what Ray
  Data's blocks still get);
* ``owned`` (now): a tensor over the store's memory (``owned=True``);
* ``owned+pin_pool`` / ``copy+pin``: then staged into pinned memory, with a pool
  (``stream/pinned.py``) or torch's ``pin_memory()`` (CUDA only; skipped otherwise).

Interleaved repetitions, medians, ratios within one run (a noisy machine)::

    python benchmarks/zero_copy.py --quick
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--shape", type=int, nargs="+", default=[64, 3, 224, 224])
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args()
    reps = 10 if args.quick else args.reps

    import ray

    from raydl._internal.stream.pinned import PinnedPool
    from raydl._internal.workers.convert import numpy_to_tensors, tensors_to_numpy

    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level=logging.WARNING)
    batch = {"x": torch.rand(*args.shape), "y": torch.arange(args.shape[0])}
    ref = ray.put(tensors_to_numpy(batch))
    cuda = torch.cuda.is_available()
    pool = PinnedPool() if cuda else None

    def get(owned: bool) -> Any:
        return numpy_to_tensors(ray.get(ref), owned=owned)

    def get_only() -> Any:
        return ray.get(ref)

    cases: dict[str, Callable[[], Any]] = {
        "get_only": get_only,
        "copy": lambda: get(False),
        "owned": lambda: get(True),
    }
    if cuda and pool is not None:
        cases["copy+pin"] = lambda: {k: v.pin_memory() for k, v in get(False).items()}
        cases["owned+pin_pool"] = lambda: pool.stage(get(True)).batch
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():  # warm-up
        fn()
    for rep in range(reps):
        order = list(cases) if rep % 2 == 0 else list(cases)[::-1]
        for name in order:
            start = time.perf_counter()
            out = cases[name]()
            times[name].append(time.perf_counter() - start)
            del out
    ray.shutdown()
    median_ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    nbytes = int(np.prod(args.shape)) * 4
    result = {
        "shape": args.shape,
        "mb": round(nbytes / 2**20, 1),
        "reps": reps,
        "median_ms": {k: round(v, 3) for k, v in median_ms.items()},
        "copy_over_owned": round(median_ms["copy"] / median_ms["owned"], 1),
        "note": "per batch: ray.get of a ready object + conversion (+ pinning where CUDA is)",
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
