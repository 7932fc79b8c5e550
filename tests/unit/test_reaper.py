"""The embedded instance's watcher (``runtime/reaper.py``), on stand-in programs.

No Ray here: a folder standing in for Ray's package holds a ``gcs_server`` and a
``worker`` program (each sleeps until killed); this test process plays the driver
that starts them, as ``ray.init`` would. Linux only, as the watcher is.
"""

from __future__ import annotations

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


def _program(ray_dir: Path, name: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(ray_dir / f"{name}.py")])


def _watched_instance(
    ray_dir: Path,
) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    """A watcher, then an instance's GCS and a worker, once the watcher has seen them."""
    watcher = reaper.start(reaper.os.getpid(), str(ray_dir), set())
    assert watcher is not None
    gcs, worker = _program(ray_dir, "gcs_server"), _program(ray_dir, "worker")
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
