"""The embedded instance's watcher (``runtime/reaper.py``), on stand-in programs.

No Ray here: a folder standing in for Ray's package holds a ``gcs_server`` and a
``worker`` program (each sleeps until killed); this test process plays the driver
that starts them, as ``ray.init`` would. Linux only, as the watcher is.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from raydl._internal.runtime import reaper

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watcher reads /proc"),
    pytest.mark.timeout(60),
]

SLEEPER = "import time\nwhile True:\n    time.sleep(1)\n"


@pytest.fixture
def ray_dir(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "ray"
    folder.mkdir()
    for name in ("gcs_server", "worker"):
        (folder / f"{name}.py").write_text(SLEEPER)
    yield folder


def _program(ray_dir: Path, name: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(ray_dir / f"{name}.py"), *args])


def _session(ray_dir: Path, driver: int = 19347, named: str = "2026-12-03_16-29-08_485884") -> Path:
    """A session folder, named as Ray names them: when, and after the process that started it."""
    session = ray_dir.parent / f"session_{named}_{driver}"
    (session / "logs").mkdir(parents=True, exist_ok=True)
    return session


def _holder(tmp_path: Path) -> Path:
    """A program that holds the file named by ``$HELD`` open and prints its pid."""
    holder = tmp_path / "holder.py"
    holder.write_text(
        "import os, time\nf = open(os.environ['HELD'], 'ab')\nprint(os.getpid(), flush=True)\n"
        + SLEEPER
    )
    return holder


def _orphan(started: list[reaper.Proc], held: Path, *argv: str) -> int:
    """``argv`` (``argv[0]`` its title) holding ``held`` open, started by a parent that
    exits at once: reparented, no one's descendant here. Its pid; appended to ``started``."""
    spawn = (
        "import subprocess, sys\n"
        f"p = subprocess.Popen({[*argv]!r}, executable=sys.executable,"
        " stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.stdout.readline().decode().strip())"
    )
    env = {**reaper.os.environ, "HELD": str(held)}
    out = subprocess.run(
        [sys.executable, "-c", spawn], env=env, capture_output=True, text=True, timeout=30
    ).stdout
    pid = int(out)
    stat = reaper._stat(pid)
    assert stat is not None
    started.append((pid, stat[1]))
    return pid


def _kill_all(started: list[reaper.Proc]) -> None:
    for pid, start in started:
        stat = reaper._stat(pid)
        if stat is not None and stat[1] == start:  # still that process, not a reused pid
            with contextlib.suppress(OSError):
                reaper.os.kill(pid, 9)


def _watched_instance(
    ray_dir: Path,
) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    """A watcher, then an instance's GCS and a worker, once the watcher has seen them."""
    watcher = reaper.start(reaper.os.getpid(), str(ray_dir), set())
    assert watcher is not None
    gcs = _program(ray_dir, "gcs_server", f"--log_dir={_session(ray_dir)}/logs")
    worker = _program(ray_dir, "worker")
    _adopted(watcher)
    return watcher, gcs, worker


def _stopped(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()


def _adopted(watcher: subprocess.Popen[bytes]) -> None:
    """Give the watcher two looks at the process table."""
    time.sleep(2.5 * reaper.POLL_S)
    assert watcher.poll() is None


def test_watcher_exits_once_the_instance_shuts_down(ray_dir: Path) -> None:
    watcher, gcs, worker = _watched_instance(ray_dir)
    for proc in (worker, gcs):  # ray.shutdown(): everything exits
        _stopped(proc)
    assert watcher.wait(timeout=5) == 0


def test_a_process_outliving_the_shut_down_instance_is_killed(ray_dir: Path) -> None:
    """A worker stuck on its way out beside a driver that goes on: killed after the grace."""
    watcher, gcs, worker = _watched_instance(ray_dir)
    gone = time.monotonic()
    _stopped(gcs)
    assert worker.wait(timeout=reaper.LEFTOVER_GRACE_S + 5) == -9  # SIGKILL
    assert time.monotonic() - gone >= reaper.LEFTOVER_GRACE_S
    assert watcher.wait(timeout=5) == 0


def test_the_next_instance_of_the_same_driver_is_not_adopted(ray_dir: Path) -> None:
    """After the first instance is over, its watcher leaves a second one alone."""
    watcher, gcs, worker = _watched_instance(ray_dir)
    _stopped(gcs)
    _adopted(watcher)  # it saw the instance end; the worker is still running
    second = _program(ray_dir, "gcs_server")
    try:
        assert worker.wait(timeout=reaper.LEFTOVER_GRACE_S + 5) == -9
        assert watcher.wait(timeout=5) == 0
        assert second.poll() is None  # not the first watcher's
    finally:
        _stopped(second)


@pytest.mark.parametrize("leftover", [False, True], ids=["all_else_gone", "a_worker_left"])
def test_an_orphan_that_retitled_itself_is_found_by_the_session_files_it_holds_open(
    ray_dir: Path, tmp_path: Path, leftover: bool
) -> None:
    """The dashboard agent the raylet forked just before it died: reparented, so no one's
    descendant, and retitled ``ray::DashboardAgent``, so its command line no longer names
    the session; it still holds the raylet's log files open (seen once in CI: it outlived
    a Ctrl-C'd training process). Killed after the grace, both when everything the watcher
    followed is gone (``ray.shutdown()`` at exit) and beside a leftover worker (the path a
    dead driver takes too: what is left is killed, then the session's Ray processes). A
    user's ``tail`` of the same log, the session's path on its command line, is not Ray's."""
    session = _session(ray_dir)
    log = session / "logs" / "raylet.out"
    holder = _holder(tmp_path)
    started: list[reaper.Proc] = []
    orphan = functools.partial(_orphan, started, log)

    watcher = reaper.start(reaper.os.getpid(), str(ray_dir), set())
    assert watcher is not None
    gcs = _program(ray_dir, "gcs_server", f"--log_dir={session}/logs")
    worker = _program(ray_dir, "worker") if leftover else None  # stuck on its way out
    try:
        _adopted(watcher)
        agent = orphan("ray::DashboardAgent", str(holder))
        reader = orphan("tail", str(holder), str(log))  # a user reading the log
        assert session.name.encode() not in reaper._cmdline(agent)
        stopped = time.monotonic()
        _stopped(gcs)  # ray.shutdown(); the orphans (and the worker) are left over
        if worker is not None:
            assert worker.wait(timeout=reaper.LEFTOVER_GRACE_S + 5) == -9
        assert watcher.wait(timeout=reaper.LEFTOVER_GRACE_S + 10) == 0
        assert time.monotonic() - stopped >= reaper.LEFTOVER_GRACE_S  # the grace was given
        assert reaper._stat(agent) is None, "the orphan holding the session's files survived"
        assert reaper._stat(reader) is not None, "a process that is not Ray's was killed"
    finally:
        for proc in (watcher, gcs, worker):
            if proc is not None:
                _stopped(proc)
        _kill_all(started)


def test_a_driver_dead_before_the_watcher_saw_its_instance_leaves_no_ray_process(
    ray_dir: Path, tmp_path: Path
) -> None:
    """A trainer killed within one look of its GCS's start (seen once: a Ctrl-C test left a
    ``ray::RuntimeEnvAgent``): the watcher followed nothing and knows no session, and the
    agent, reparented and retitled, is no one's descendant. Ray names the session after
    its driver and the time, so the session's agent is killed; not one of another driver's
    session, nor one of a session named after the same pid before the driver began (a
    ``ray start`` whose pid the driver reuses, its cluster still running)."""
    older = datetime.datetime.now() - datetime.timedelta(seconds=5)
    driver = subprocess.Popen([sys.executable, "-c", SLEEPER])
    started: list[reaper.Proc] = []
    try:
        watcher = reaper.start(driver.pid, str(ray_dir), set())
        assert watcher is not None
        holder = _holder(tmp_path)
        now = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S_%f")
        log = Path("logs") / "runtime_env_agent.log"
        mine = _session(ray_dir, driver.pid, now) / log
        other = _session(ray_dir, driver.pid + 1, now) / log
        before = _session(ray_dir, driver.pid, older.strftime("%Y-%m-%d_%H-%M-%S_%f")) / log
        agent = _orphan(started, mine, "ray::RuntimeEnvAgent", str(holder))
        strangers = [
            _orphan(started, held, "ray::RuntimeEnvAgent", str(holder)) for held in (other, before)
        ]
        _stopped(driver)
        assert watcher.wait(timeout=10) == 0
        assert reaper._stat(agent) is None, "the dead driver's agent survived"
        for stranger in strangers:
            assert reaper._stat(stranger) is not None, "another instance's Ray process was killed"
    finally:
        _stopped(driver)
        _kill_all(started)
