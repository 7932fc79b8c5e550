"""A training script's first seconds, for the background-start tests (``test_cold_start.py``).

Usage: ``python _startup_script.py MODE RECORD``; prints progress lines (``built``,
``iterating``, ``batch``) that the test waits for, and writes a JSON record.

Modes:
    gated: ``ray.init`` waits for a gate, so the test sees construction return
        while Ray is still starting, and the first batch come while it is held (it
        loads in this process); then epochs until the actor took over, and whether
        the script's seeded ``random`` stream came through all that untouched.
    epochs: build, iterate ``--epochs`` epochs slowly (for Ctrl-C at any moment).
    dropped: build a loader over a raydl read, let its start finish (``warm``),
        drop it when told on stdin (``dropped``).
    gated_then_dropped: ``gated`` (its loader closed: ``closed``), then, when told on
        stdin, ``dropped`` in the same process.
    read_epochs: a raydl read, which starts Ray on raydl's own thread, then a loader's
        epochs as in ``epochs``.
    read_interrupted_in_an_import: a raydl read, then a Ctrl-C that leaves CPython's import
        lock held (as one that hits an import may), while Ray's start goes on.
    ends_while_ray_starts: ``ray.init`` held for 3 s; a short epoch ends in this process
        meanwhile and the script exits while Ray is still starting (its loader not
        closed). It says whether a start was under way when ``ray.shutdown()`` stopped
        the instance (``Ray stops its instance, a start under way: True|False``; no line
        if Ray had no instance to stop) and at its last exit handler, after Ray's.
    gated_read: ``ray.init`` held as in ``gated``; a raydl read returns before Ray is up,
        a ``ds.count()`` of the script waits for raydl's start, and the first epochs of
        two loaders (files order, global shuffle) load in this process meanwhile; then
        epochs with Ray up, and the same epochs from loaders built once Ray was up.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import threading
import time

import psutil
import torch


def _say(line: str) -> None:
    print(line, flush=True)


def _hold_ray_init() -> threading.Event:
    """Make ``ray.init`` wait until the returned gate is set (Ray's start held back)."""
    import ray

    real_init, gate = ray.init, threading.Event()

    def gated_init(*args, **kwargs):  # type: ignore[no-untyped-def]
        gate.wait(120)
        return real_init(*args, **kwargs)

    ray.init = gated_init
    return gate


def gated(record: dict) -> None:
    import random

    import ray

    random.seed(5)  # the script's own stream: neither Ray's start nor raydl draws from it
    expected = [random.random() for _ in range(3)]
    random.seed(5)

    gate = _hold_ray_init()
    from raydl import RayDataLoader

    data = torch.arange(64, dtype=torch.float32)
    began = time.perf_counter()
    loader = RayDataLoader(data, batch_size=8, num_workers=1, persistent_workers=True)
    record["construction_s"] = time.perf_counter() - began
    record["initialized_after_construction"] = ray.is_initialized()
    record["start_running"] = loader._startup is not None and not loader._startup.done
    epoch = iter(loader)
    batches = [next(epoch).tolist()]  # loaded here (start_in_process): Ray is not needed yet
    record["ray_held_at_first_batch"] = not gate.is_set() and not ray.is_initialized()
    gate.set()
    record["batches"] = batches + [b.tolist() for b in epoch]
    for _ in range(600):  # until an epoch that loaded nothing here: the actor took over
        summary = loader.stats()["epochs"][-1]["ray_data"]
        if summary is None:
            break
        time.sleep(0.1)
        list(loader)
    record["on_the_actor_at_last"] = summary is None
    record["initialized_at_last"] = ray.is_initialized()
    loader.close()
    record["scripts_random_stream_kept"] = [random.random() for _ in range(3)] == expected


def ends_while_ray_starts(record: dict) -> None:
    import atexit

    def last() -> None:  # registered before `import ray`: runs after Ray's handler
        from raydl._internal.runtime import cluster

        _say(f"start under way at exit: {cluster._lock.locked()}")

    atexit.register(last)
    gate = _hold_ray_init()
    from ray._private import node

    from raydl._internal.runtime import cluster

    stop_all = node.Node.kill_all_processes

    def noting_stop(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        _say(f"Ray stops its instance, a start under way: {cluster._lock.locked()}")
        return stop_all(self, *args, **kwargs)

    node.Node.kill_all_processes = noting_stop  # what ray.shutdown() calls to stop it
    opens = threading.Timer(3.0, gate.set)
    opens.daemon = True  # the interpreter's exit does not wait for it
    opens.start()
    from raydl import RayDataLoader

    loader = RayDataLoader(torch.arange(16.0), batch_size=4, num_workers=2)
    record["batches"] = [b.tolist() for b in loader]  # loaded here while Ray is held
    record["ray_held_at_the_end"] = not gate.is_set()
    # not closed, as many scripts end: the start must not go on to make actors


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


def read_epochs(record: dict, folder: str, count: int) -> None:
    """A raydl read (Ray starts on raydl's thread), then a loader's epochs, as ``epochs``."""
    import raydl

    ds = raydl.read_parquet(folder).map_batches(_double)
    _say("read")
    loader = raydl.RayDataLoader(ds, batch_size=4, shuffle=True)
    for epoch in range(count):
        for _ in loader:
            _say("batch")
            time.sleep(0.2)
        record[f"epoch_{epoch}"] = True


def _has_child(name: str) -> bool:
    """Whether a process named ``name`` descends from this one (children may come and go)."""
    for child in psutil.Process().children(recursive=True):
        try:
            if child.name() == name:
                return True
        except psutil.Error:  # gone meanwhile
            continue
    return False


def read_interrupted_in_an_import(record: dict, folder: str, caught: bool) -> None:
    """A raydl read, then a Ctrl-C as one that hits an import leaves CPython's import lock:
    held by this thread for good, so the start's ``ray.init`` waits forever at its next import.
    ``caught``: the script catches the interrupt and exits with status 3."""
    import _imp

    import raydl

    raydl.read_parquet(folder)
    began = time.monotonic()  # the start of Ray under way (its next import will wait), then:
    while not _has_child("gcs_server"):
        assert time.monotonic() - began < 30, "Ray's start did not begin"
        time.sleep(0.02)
    _imp.acquire_lock()  # never released, as by an interrupt inside importlib's _get_module_lock
    _say("locked")
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        if not caught:
            raise
        record["caught"] = True
    sys.exit(3)


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


def _double(batch: dict) -> dict:
    return {"id": batch["id"], "twice": batch["id"] * 2}


def gated_read(record: dict, folder: str) -> None:
    import ray

    gate = _hold_ray_init()
    import raydl
    from raydl._internal.runtime import cluster

    began = time.perf_counter()
    ds = raydl.read_parquet(folder).map_batches(_double)
    record["read_s"] = time.perf_counter() - began
    record["initialized_after_read"] = ray.is_initialized()

    def loader(mode: str) -> raydl.RayDataLoader:
        torch.manual_seed(3)
        return raydl.RayDataLoader(ds, batch_size=4, shuffle=True, shuffle_mode=mode)

    def epochs(each: raydl.RayDataLoader, count: int) -> list[list[list[int]]]:
        return [[b["id"].tolist() for b in each] for _ in range(count)]

    modes = ("files", "global")
    first = {mode: loader(mode) for mode in modes}
    held = {mode: epochs(first[mode], 2) for mode in modes}
    record["initialized_after_held_epochs"] = ray.is_initialized()
    # The read's Ray Data context is made without Ray's state API (ray_compat.context).
    record["state_api_imported_while_held"] = "ray.util.state" in sys.modules
    counted: list[int] = []
    counter = threading.Thread(target=lambda: counted.append(ds.count()), daemon=True)
    counter.start()
    counter.join(0.5)
    record["count_waited_for_the_start"] = counter.is_alive() and not ray.is_initialized()
    gate.set()
    counter.join(120)
    record["count"] = counted
    record["started_by_raydl"] = cluster._started_by_raydl
    for mode in modes:
        up = epochs(first[mode], 2)
        record[mode] = {"summaries": [e["ray_data"] for e in first[mode].stats()["epochs"]]}
        first[mode].close()
        second = loader(mode)
        record[mode]["same_as_a_loader_built_with_ray_up"] = epochs(second, 4) == held[mode] + up
        second.close()
        record[mode]["epochs"] = held[mode] + up


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "mode",
        choices=[
            "gated",
            "epochs",
            "dropped",
            "gated_then_dropped",
            "gated_read",
            "read_epochs",
            "read_interrupted_in_an_import",
            "ends_while_ray_starts",
        ],
    )
    parser.add_argument("record")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--folder", default="")
    parser.add_argument("--caught", action="store_true")
    args = parser.parse_args()
    record: dict = {}
    try:
        if args.mode == "gated":
            gated(record)
        elif args.mode == "gated_then_dropped":
            gated_then_dropped(record, args.folder)
        elif args.mode == "epochs":
            epochs(record, args.epochs)
        elif args.mode == "gated_read":
            gated_read(record, args.folder)
        elif args.mode == "read_epochs":
            read_epochs(record, args.folder, args.epochs)
        elif args.mode == "ends_while_ray_starts":
            ends_while_ray_starts(record)
        elif args.mode == "read_interrupted_in_an_import":
            read_interrupted_in_an_import(record, args.folder, args.caught)
        else:
            dropped(record, args.folder)
    finally:
        with open(args.record, "w") as f:
            json.dump(record, f)
    sys.exit(0)


if __name__ == "__main__":
    main()
