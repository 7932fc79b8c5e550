"""What a test can observe of a Ray session from outside raydl: processes, threads, actors.

The embedded Ray runs without its dashboard, so Ray's state API (``list_tasks``,
``list_actors``) is not available; these helpers read the GCS actor table and
the process tree instead. Ray worker processes name themselves after the task
they run (``ray::MapBatches(f)``) and ``ray::IDLE`` when idle.
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

#: Ray Data's own helper actors, started once and alive for the rest of the session.
RAY_SERVICE_ACTORS = frozenset(
    {"_StatsActor", "_AutoscalingCoordinatorActor", "AutoscalingRequester", "ActorLocationTracker"}
)


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, every: float = 0.2) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds passed; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()


def session_processes() -> list[psutil.Process]:
    """The Ray processes of this process's embedded instance (all its descendants)."""
    alive = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    return alive


def busy_workers() -> list[str]:
    """Titles of this session's Ray workers that are running something right now.

    A worker titles itself ``ray::IDLE`` when idle, ``ray::Class`` when it holds an
    idle actor, ``ray::Class.method`` while the actor runs a method and, for Ray
    Data tasks, after the operators it runs: ``ray::ReadRange->MapBatches(f)``.
    A task that is a bare read (``ray::ReadRange``) is seen through the CPUs it holds
    (:func:`free_cpus`), not here.
    """
    titles = []
    for proc in session_processes():
        try:
            name = proc.name()
        except psutil.NoSuchProcess:
            continue
        if not name.startswith("ray::") or "Agent" in name:
            continue
        title = name.removeprefix("ray::")
        if title.split(".")[0].split("(")[0] in RAY_SERVICE_ACTORS:
            continue
        if "." in title or "(" in title or "->" in title:
            titles.append(name)
    return titles


def live_actors() -> list[str]:
    """Class names of the actors alive in the cluster, Ray's own service actors left out."""
    import ray

    return sorted(
        actor["ActorClassName"]
        for actor in ray._private.state.actors().values()
        if actor["State"] != "DEAD" and actor["ActorClassName"] not in RAY_SERVICE_ACTORS
    )


def raydl_threads() -> list[str]:
    """Names of raydl's and Ray Data's live threads in this process."""
    prefixes = ("raydl", "StreamingExecutor", "iter_threaded", "Prefetcher", "ray-data")
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(prefixes))


def free_cpus() -> float:
    import ray

    return float(ray.available_resources().get("CPU", 0.0))


def private_memory(proc: psutil.Process | None = None) -> int:
    """Resident memory not shared with other processes (the object store's pages are shared)."""
    info = (proc or psutil.Process()).memory_info()
    return int(info.rss - info.shared)


def open_fds() -> int:
    return psutil.Process().num_fds()


def processes_with_env(name: str, value: str) -> list[int]:
    """Pids of every process on this machine whose environment has ``name=value``."""
    needle = f"{name}={value}".encode()
    found = []
    for pid in psutil.pids():
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:
            continue
        if needle in entries:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    found.append(pid)
            except psutil.NoSuchProcess:
                continue
    return found


def object_store_bytes() -> tuple[int, int] | None:
    """``(pinned, spilled)`` bytes of primary copies, from the raylet's debug state.

    The raylet rewrites ``debug_state.txt`` every ``debug_dump_period_milliseconds``
    (10 s by default; the tests that read it start Ray with 200 ms). ``None``
    while the file is not written yet.
    """
    import ray

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    try:
        text = (session / "logs" / "debug_state.txt").read_text()
    except OSError:
        return None
    pinned = re.search(r"pinned objects size: (\d+)", text)
    spilled = re.search(r"num bytes currently spilled: (\d+)", text)
    if pinned is None or spilled is None:
        return None
    return int(pinned.group(1)), int(spilled.group(1))


def close_leaked_iterators() -> list[str]:
    """Close the epoch iterators whose producer threads are still running; their names.

    Clean-up after a test that exposed a leak, so the leaked pipelines do not hold
    the module's cluster for the tests after it. A producer thread's target is its
    iterator's bound method: that is how the iterator is found.
    """
    names = []
    for thread in threading.enumerate():
        target = getattr(thread, "_target", None)
        owner = getattr(target, "__self__", None)
        if thread.name.startswith("raydl-epoch") and hasattr(owner, "close"):
            names.append(thread.name)
            owner.close()
    return names


def read_until(proc: subprocess.Popen[str], prefix: str, timeout: float) -> tuple[list[str], bool]:
    """``proc``'s output lines up to the first starting with ``prefix``; whether it came.

    Gives up after ``timeout`` seconds or when ``proc`` closes its output.
    """
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if not ready:
            continue
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(prefix):
            return lines, True
    return lines, False
