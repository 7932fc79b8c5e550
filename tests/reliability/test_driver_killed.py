"""Item 11: the training process is SIGKILLed while raydl's embedded Ray is running.

The trainer runs as a subprocess with its own ``RAY_TMPDIR``. Its Ray session's
processes are found twice: as the trainer's descendants while it runs (Ray's
agents are among them, but do not inherit ``RAY_TMPDIR``), and, after the kill,
by that variable in their environment (workers started later inherit it),
wherever they were reparented. A process counts as the same one only with the
same start time, so a reused pid is not mistaken for a survivor.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from _probes import processes_with_env, read_until, wait_until

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
#: Seconds the session's processes may outlive the trainer (Ray alone leaves two for 60 s).
BOUND_S = 15


def _start(mode: str, ray_tmpdir: str) -> subprocess.Popen[str]:
    env = dict(os.environ, RAY_TMPDIR=ray_tmpdir, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(
        [sys.executable, str(HERE / "_trainer.py"), mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_line(proc: subprocess.Popen[str], prefix: str, timeout: float) -> None:
    lines, found = read_until(proc, prefix, timeout)
    if not found:
        proc.kill()
        pytest.fail(f"no {prefix!r} line within {timeout} s:\n{''.join(lines[-40:])}")


def _session(ray_tmpdir: str, trainer: int | None = None) -> dict[int, float]:
    """pid -> start time of the Ray processes of ``ray_tmpdir``'s session (and the live trainer's)."""
    procs = {}
    if trainer is not None:
        children = psutil.Process(trainer).children(recursive=True)
        procs = {p.pid: p.create_time() for p in children}
    for pid in processes_with_env("RAY_TMPDIR", ray_tmpdir):
        with contextlib.suppress(psutil.NoSuchProcess):
            procs[pid] = psutil.Process(pid).create_time()
    return procs


def _alive(procs: dict[int, float], command: bool = False) -> list[str]:
    """``procs`` still running, as "pid name" (``command``: "pid command line")."""
    out = []
    for pid, started in procs.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{pid} {' '.join(proc.cmdline()) if command else proc.name()}")
        except psutil.NoSuchProcess:
            continue
    return out


def _ray_shm(names: set[str]) -> set[str]:
    return {n for n in names if "plasma" in n.lower() or "ray" in n.lower()}


@pytest.mark.timeout(300)
def test_sigkilled_trainer_leaves_no_ray_process_and_a_new_run_starts(ray_tmpdir: str) -> None:
    # Every wait below is bounded and they add up to less than the test's timeout, so
    # a slow step fails with what the trainers printed instead of killing the run.
    deadline = time.monotonic() + 270
    shm_before = set(os.listdir("/dev/shm"))
    trainer = _start("serve", ray_tmpdir)
    try:
        _wait_for_line(trainer, "READY", timeout=120)
        # The loader's first batches may load in the trainer while its actors start
        # (start_in_process): wait for them, so that the kill finds them running.
        assert wait_until(
            lambda: any("DatasetWorker" in n for n in _alive(_session(ray_tmpdir, trainer.pid))),
            timeout=60,
        ), _alive(_session(ray_tmpdir, trainer.pid))
        session = _session(ray_tmpdir, trainer.pid)
        names = _alive(session)
        # gcs_server, raylet, the stand-ins for its agents and the real runtime-env agent
        # (the trainer ran a task with a runtime_env), workers, the loader's actors
        assert any("raylet" in n for n in names), names
        assert any("RuntimeEnvAgent" in n for n in names), names
        assert any("agent_standin.py" in n for n in _alive(session, command=True)), names
        assert any("DatasetWorker" in n for n in names), names
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=10)
    finally:
        trainer.kill()
    killed = time.monotonic()

    def leftovers() -> list[str]:
        return _alive(session | _session(ray_tmpdir), command=True)

    gone = wait_until(lambda: not leftovers(), timeout=BOUND_S)
    assert gone, f"still running {time.monotonic() - killed:.0f} s after the SIGKILL: {leftovers()}"
    assert not _ray_shm(set(os.listdir("/dev/shm")) - shm_before)

    # a new run in the same RAY_TMPDIR starts cleanly, finishes, and leaves nothing behind
    again = _start("finish", ray_tmpdir)
    try:
        budget = deadline - time.monotonic() - BOUND_S
        lines, done = read_until(again, "DONE", timeout=budget)
        out = "".join(lines)
        assert done, f"the new run printed no DONE within {budget:.0f} s:\n{out[-4000:]}"
        rest, _ = again.communicate(timeout=max(5.0, deadline - time.monotonic() - BOUND_S))
        out += rest
    finally:
        again.kill()
    assert again.returncode == 0, out[-4000:]
    assert wait_until(lambda: not _alive(_session(ray_tmpdir)), timeout=BOUND_S), _alive(
        _session(ray_tmpdir)
    )
    assert not _ray_shm(set(os.listdir("/dev/shm")) - shm_before)
