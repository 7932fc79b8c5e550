"""A training script's first seconds, for the background-start tests (``test_cold_start.py``).

Usage: ``python _startup_script.py MODE RECORD``; prints progress lines (``built``,
``iterating``, ``batch``) that the test waits for, and writes a JSON record.

Modes:
    gated: ``ray.init`` waits for a gate, so the test sees construction return
        while Ray is still starting; then one epoch.
    epochs: build, iterate ``--epochs`` epochs slowly (for Ctrl-C at any moment).
    dropped: build a loader over a raydl read, let its start finish (``warm``),
        drop it when told on stdin (``dropped``).
    gated_then_dropped: ``gated`` (its loader closed: ``closed``), then, when told on
        stdin, ``dropped`` in the same process.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import threading
import time

import torch


def _say(line: str) -> None:
    print(line, flush=True)


def gated(record: dict) -> None:
    import ray

    real_init, gate = ray.init, threading.Event()

    def gated_init(*args, **kwargs):  # type: ignore[no-untyped-def]
        gate.wait(120)
        return real_init(*args, **kwargs)

    ray.init = gated_init
    from raydl import RayDataLoader

    data = torch.arange(64, dtype=torch.float32)
    began = time.perf_counter()
    loader = RayDataLoader(data, batch_size=8, num_workers=1, persistent_workers=True)
    record["construction_s"] = time.perf_counter() - began
    record["initialized_after_construction"] = ray.is_initialized()
    record["start_running"] = loader._startup is not None and not loader._startup.done
    gate.set()
    record["batches"] = [b.tolist() for b in loader]
    record["initialized_after_iter"] = ray.is_initialized()
    loader.close()


def epochs(record: dict, count: int) -> None:
    from raydl import RayDataLoader

    data = torch.arange(64, dtype=torch.float32)
    loader = RayDataLoader(data, batch_size=8, num_workers=1, persistent_workers=True)
    _say("built")
    for epoch in range(count):
        _say("iterating")
        for _ in loader:
            _say("batch")
            time.sleep(0.2)
        record[f"epoch_{epoch}"] = True


def gated_then_dropped(record: dict, folder: str) -> None:
    """``gated``, then (told on stdin, once the test saw its actor go) ``dropped``: one process
    and one Ray start for both."""
    gated(record)
    _say("closed")
    sys.stdin.readline()
    dropped(record, folder)


def dropped(record: dict, folder: str) -> None:
    import raydl

    ds = raydl.read_parquet(folder).map_batches(lambda b: b)
    loader = raydl.RayDataLoader(ds, batch_size=4, shuffle=False)
    startup = loader._startup
    assert startup is not None
    startup.wait()
    record["early_epoch"] = loader._source.early_epoch
    _say("warm")
    sys.stdin.readline()  # the test has seen the actors: drop the loader
    del loader, startup
    gc.collect()
    _say("dropped")
    sys.stdin.readline()  # the test looks at this process's actors, then ends it


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["gated", "epochs", "dropped", "gated_then_dropped"])
    parser.add_argument("record")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--folder", default="")
    args = parser.parse_args()
    record: dict = {}
    try:
        if args.mode == "gated":
            gated(record)
        elif args.mode == "gated_then_dropped":
            gated_then_dropped(record, args.folder)
        elif args.mode == "epochs":
            epochs(record, args.epochs)
        else:
            dropped(record, args.folder)
    finally:
        with open(args.record, "w") as f:
            json.dump(record, f)
    sys.exit(0)


if __name__ == "__main__":
    main()
