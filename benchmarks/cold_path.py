"""What each piece of raydl's cold path costs: process start to the first batch.

Each measurement runs in a fresh Python process (a cold start is only cold once),
``--repeat`` times; the table shows the median seconds of each step.

    python benchmarks/cold_path.py --repeat 3

Steps, in the order a training script meets them:

* ``import torch``, ``import ray.data``: interpreter imports (the training script
  pays the first one anyway).
* ``ray.init``: the embedded instance (GCS, raylet, the driver's connection), as
  raydl starts it (token authentication on, no dashboard).
* ``first actor``: one empty actor ready (a Ray worker process started).
* ``actor importing torch``: one more actor that imports torch in ``__init__``.
* ``2 actors importing torch``: two at once (the default map-style pool here).
* ``pickle dataset``: cloudpickle of a small map-style dataset.
* the loader rows: ``RayDataLoader(ds, num_workers=2)``, from construction to the
  first batch, with the loader built right after the imports (``iter at once``)
  or after the script spent ``--pause`` seconds elsewhere (``after a pause``,
  measured from ``iter()``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap

_STEPS = textwrap.dedent(
    """
    import json, time
    t0 = time.perf_counter()
    out = {}
    def lap(name):
        global t0
        now = time.perf_counter()
        out[name] = now - t0
        t0 = now
    import torch
    lap("import torch")
    import ray, ray.data
    lap("import ray.data")
    from raydl._internal.runtime import cluster
    cluster.ensure_ray()
    lap("ray.init (embedded, token auth)")

    @ray.remote
    class Empty:
        def ready(self):
            return None

    @ray.remote
    class WithTorch:
        def __init__(self):
            import torch  # noqa: F401
        def ready(self):
            return None

    ray.get(Empty.remote().ready.remote())
    lap("first actor (a worker process)")
    ray.get(WithTorch.remote().ready.remote())
    lap("one more actor importing torch")
    ray.get([WithTorch.remote().ready.remote() for _ in range(2)])
    lap("2 actors importing torch, at once")
    from ray import cloudpickle
    data = torch.arange(4096 * 16, dtype=torch.float32).reshape(4096, 16)
    ds = torch.utils.data.TensorDataset(data)
    cloudpickle.dumps(ds)
    lap("pickle a 256 KiB dataset")
    print("RESULT " + json.dumps(out))
    """
)

_LOADER = textwrap.dedent(
    """
    import json, sys, time
    start = time.perf_counter()
    import torch
    from raydl import RayDataLoader
    data = torch.arange(4096 * 16, dtype=torch.float32).reshape(4096, 16)
    ds = torch.utils.data.TensorDataset(data)
    built = time.perf_counter()
    loader = RayDataLoader(ds, batch_size=256, num_workers=2, persistent_workers=True)
    construction = time.perf_counter() - built
    pause = float(sys.argv[1])
    time.sleep(pause)
    at_iter = time.perf_counter()
    next(iter(loader))
    now = time.perf_counter()
    print("RESULT " + json.dumps({
        "construction": construction,
        "after_iter": now - at_iter,
        "process_to_first_batch": now - start - pause,
    }))
    """
)


def _run(code: str, *args: str) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    raise RuntimeError(f"measurement failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pause", type=float, default=3.0)
    parser.add_argument("--json", help="also write the medians here")
    args = parser.parse_args()
    steps = [_run(_STEPS) for _ in range(args.repeat)]
    at_once = [_run(_LOADER, "0") for _ in range(args.repeat)]
    paused = [_run(_LOADER, str(args.pause)) for _ in range(args.repeat)]
    rows: dict[str, float] = {name: statistics.median(s[name] for s in steps) for name in steps[0]}
    rows["loader: construction"] = statistics.median(r["construction"] for r in at_once)
    rows["loader: process start to first batch (iter at once)"] = statistics.median(
        r["process_to_first_batch"] for r in at_once
    )
    rows["loader: iter() to first batch (iter at once)"] = statistics.median(
        r["after_iter"] for r in at_once
    )
    rows[f"loader: iter() to first batch (after a {args.pause:g} s pause)"] = statistics.median(
        r["after_iter"] for r in paused
    )
    width = max(len(name) for name in rows)
    print(f"{'step':<{width}}  median s (of {args.repeat})")
    for name, seconds in rows.items():
        print(f"{name:<{width}}  {seconds:7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
