"""A training process for the driver-kill test: raydl's embedded Ray, both kinds of source.

``serve``: runs a task with a ``runtime_env`` (so that the raylet's runtime-env agent
starts), then iterates a map-style loader (Ray actors) and a Ray Data loader (Ray
Data tasks) side by side, prints ``READY <pid>`` after a few steps and goes on
until it is killed. ``finish``: one small epoch of each, then ``DONE`` and a
normal exit.
"""

from __future__ import annotations

import os
import sys
import time

import ray
from _faulty import PidData

import raydl


def main(mode: str) -> None:
    if os.environ.get("RAYDL_TEST_NO_REAPER"):  # to see what the test catches without the fix
        from raydl._internal.runtime import reaper

        reaper.start = lambda *args: None
    raydl.init(num_cpus=2)
    if mode == "serve":
        # A runtime_env: the raylet's real runtime-env agent starts (behind its stand-in).
        variable = ray.remote(num_cpus=0)(lambda: os.environ.get("RAYDL_PROBE"))
        options = {"runtime_env": {"env_vars": {"RAYDL_PROBE": "set"}}}
        assert ray.get(variable.options(**options).remote()) == "set"
    rows = 2000 if mode == "serve" else 100
    ds = ray.data.range(rows, override_num_blocks=10).map_batches(lambda b: b, batch_size=50)
    tabular = raydl.RayDataLoader(ds, batch_size=10)
    samples = raydl.RayDataLoader(PidData(rows // 10), batch_size=10, num_workers=2)
    steps = 0
    while True:
        for _ in zip(tabular, samples, strict=False):
            steps += 1
            if steps == 3:
                print(f"READY {os.getpid()}", flush=True)
            time.sleep(0.05 if mode == "serve" else 0)
        if mode == "finish":
            break
    tabular.close()
    samples.close()
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
