"""The background start, seen from outside: fresh training processes (``_startup_script.py``).

Each test runs a script in a new process with a Ray of its own (a cold start is
only cold once): construction returns while Ray is still starting, a Ctrl-C at
any moment ends the process as interrupted with no Ray process left behind, and
a loader built and dropped leaves no actor behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from _probes import wait_until

SCRIPT = str(Path(__file__).resolve().parent / "_startup_script.py")


@pytest.fixture
def ray_tmp() -> Iterator[str]:
    """A private ``RAY_TMPDIR`` (short: Ray's socket paths have a length limit)."""
    with tempfile.TemporaryDirectory(prefix="rdl", ignore_cleanup_errors=True) as tmp:
        yield tmp


def _start(mode: str, record: Path, ray_tmp: str, *args: str, **env: str) -> subprocess.Popen[str]:
    environ = {**os.environ, "RAY_TMPDIR": ray_tmp, **env}
    environ.pop("RAY_ADDRESS", None)
    return subprocess.Popen(
        [sys.executable, SCRIPT, mode, str(record), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environ,
        preexec_fn=_ctrl_c_as_at_a_terminal,
    )


def _ctrl_c_as_at_a_terminal() -> None:
    """In the script's process: SIGINT's default disposition, as a terminal's shell gives it.

    A test run started in the background by a non-interactive shell (``nohup ... &``)
    ignores SIGINT, and its children inherit that: their Ctrl-C would do nothing.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for(proc: subprocess.Popen[str], line: str, count: int = 1) -> None:
    assert proc.stdout is not None
    seen = 0
    for got in proc.stdout:
        seen += got.strip() == line
        if seen == count:
            return
    raise AssertionError(f"the script ended before printing {line!r}: {proc.stderr.read()[-3000:]}")


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(procs: list[psutil.Process]) -> list[str]:
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{proc.pid} {proc.name()}")
        except psutil.NoSuchProcess:
            continue
    return alive


def _parquet_folder(root: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = root / "data"
    folder.mkdir()
    for part in range(4):
        pq.write_table(
            pa.table({"id": list(range(part * 8, part * 8 + 8))}), folder / f"{part}.parquet"
        )
    return folder


def _direct_actors(proc: subprocess.Popen[str]) -> list[str]:
    return [name for name in _alive(_descendants(proc.pid)) if "DatasetWorker" in name]


def _tell(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(f"{line}\n")
    proc.stdin.flush()


@pytest.mark.timeout(120)
def test_a_script_that_ends_while_ray_starts_exits_once_the_start_is_over(
    tmp_path: Path, ray_tmp: str
) -> None:
    """A short epoch ends in the trainer before Ray is up, and the script with it.

    Exiting while the background start was inside ``ray.init`` aborted the process
    now and then (gRPC's ``Illegal header value``, exit status 134: C++ static
    destructors ran under Ray's gRPC threads). The exit now waits for the start
    (``cluster._finish_start_at_exit``, before every ``atexit`` handler), so Ray's own
    exit handler finds an instance to stop.
    """
    record = tmp_path / "record.json"
    proc = _start("ends_while_ray_starts", record, ray_tmp)
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0, err[-3000:]
    seen = json.loads(record.read_text())
    assert seen["batches"] == [
        [0.0, 1.0, 2.0, 3.0],
        [4.0, 5.0, 6.0, 7.0],
        [8.0, 9.0, 10.0, 11.0],
        [12.0, 13.0, 14.0, 15.0],
    ]
    assert seen["ray_held_at_the_end"] is True  # the script ended while Ray was starting
    lines = out.splitlines()
    # raydl's wait ran before Ray's exit handler, which then found an instance to stop
    assert lines == [
        "Ray stops its instance, a start under way: False",
        "start under way at exit: False",
    ], out[-2000:] + err[-3000:]


@pytest.mark.timeout(240)
def test_construction_returns_while_ray_starts_then_a_dropped_loader_leaves_no_ray_work(
    tmp_path: Path, ray_tmp: str
) -> None:
    """Two checks in one process, one Ray start (``gated_then_dropped``).

    First a map-style loader built while ``ray.init`` is held back: construction
    returns before Ray is up, and its first batch comes while Ray is still held
    (loaded in the trainer, ``start_in_process``); later epochs are the actor's. Then, once that loader is
    closed and its actor gone, a loader over a raydl read whose background start
    begins epoch 0 on raydl's actors, unasked: dropped, it leaves no actor behind.
    """
    record = tmp_path / "record.json"
    folder = _parquet_folder(tmp_path)
    proc = _start("gated_then_dropped", record, ray_tmp, "--folder", str(folder))
    try:
        _wait_for(proc, "closed")
        # the first loader's actor is gone, so the actors seen below are the second's
        assert wait_until(lambda: not _direct_actors(proc), timeout=30), _direct_actors(proc)
        _tell(proc, "go")
        _wait_for(proc, "warm")
        # The background start began epoch 0 on raydl's actors, unasked.
        assert wait_until(lambda: bool(_direct_actors(proc)), timeout=60), "no direct actors"
        _tell(proc, "drop")
        _wait_for(proc, "dropped")
        assert wait_until(lambda: not _direct_actors(proc), timeout=30), _direct_actors(proc)
        _tell(proc, "end")
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    seen = json.loads(record.read_text())
    # ray.init was held back by the script: construction returned before it ran.
    assert seen["initialized_after_construction"] is False
    assert seen["start_running"] is True
    assert seen["ray_held_at_first_batch"] is True
    assert seen["on_the_actor_at_last"] is True and seen["initialized_at_last"] is True
    # Ray's start draws from its own random.Random (ray_compat.cluster.private_random), and
    # the trainer's stand-ins for the worker put the script's state back.
    assert seen["scripts_random_stream_kept"] is True
    assert [x for batch in seen["batches"] for x in batch] == [float(i) for i in range(64)]


@pytest.mark.timeout(240)
def test_a_read_plan_loads_its_first_epochs_here_while_ray_starts_and_ray_calls_wait(
    tmp_path: Path, ray_tmp: str
) -> None:
    """``raydl.read_parquet`` returns before Ray is up (``ray.init`` held by the script);
    a loader's first epochs load in the trainer meanwhile (files order: its runs; a
    global shuffle: its map phase), in the order a loader built with Ray up gives; the
    script's own ``ds.count()`` waits for raydl's start rather than starting a second
    instance."""
    record = tmp_path / "record.json"
    folder = _parquet_folder(tmp_path)
    proc = _start("gated_read", record, ray_tmp, "--folder", str(folder))
    try:
        _, err = proc.communicate(timeout=200)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    seen = json.loads(record.read_text())
    assert seen["initialized_after_read"] is False
    assert seen["count_waited_for_the_start"] is True
    assert seen["initialized_after_held_epochs"] is False  # both epochs while Ray was held
    assert seen["state_api_imported_while_held"] is False  # (0.9 s of the read, before)
    assert seen["count"] == [32] and seen["started_by_raydl"] is True
    for mode, here in [("files", "4 runs loaded"), ("global", "4 runs mapped")]:
        for epoch in seen[mode]["epochs"]:
            assert sorted(x for batch in epoch for x in batch) == list(range(32)), mode
        assert seen[mode]["epochs"][0] != seen[mode]["epochs"][1]  # a new order each epoch
        summaries = seen[mode]["summaries"]
        assert all(f"{here} in the training process" in s for s in summaries[:2]), summaries
        assert seen[mode]["same_as_a_loader_built_with_ray_up"] is True, mode
    assert any(len({x // 8 for x in b}) > 1 for b in seen["global"]["epochs"][0])  # mixed files


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("moment", "after", "background"),
    [
        ("during the background ray.init", "built", "1"),
        ("while iter() waits for the start", "iterating", "1"),
        ("during an epoch", "batch", "1"),
        ("during ray.init on the trainer's thread", "iterating", "0"),
        ("during a raydl read's start of Ray, the first batches loading here", "read", "1"),
    ],
)
def test_ctrl_c_at_any_moment_exits_as_interrupted_and_leaves_no_ray_process(
    tmp_path: Path, ray_tmp: str, moment: str, after: str, background: str
) -> None:
    script = (
        ["read_epochs", "--folder", str(_parquet_folder(tmp_path))]
        if after == "read"
        else ["epochs"]
    )
    proc = _start(
        script[0], tmp_path / "record.json", ray_tmp, *script[1:], "--epochs", "5",
        RAYDL_BACKGROUND_START=background,
    )  # fmt: skip
    try:
        _wait_for(proc, after, count=2 if after == "batch" else 1)
        if after != "batch":
            # Ray's start has begun (a GCS exists) but is not over: no raylet yet.
            assert wait_until(
                lambda: any(p.name() == "gcs_server" for p in _descendants(proc.pid)),
                timeout=30,
                every=0.02,
            ), f"Ray's start did not begin ({moment})"
        ray_processes = _descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGINT, f"{moment}: exit {proc.returncode}\n{err[-3000:]}"
    assert "KeyboardInterrupt" in err
    assert ray_processes, "no Ray process had started: the test did not test anything"
    assert wait_until(lambda: not _alive(ray_processes), timeout=20), _alive(ray_processes)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("caught", [False, True], ids=["unhandled", "caught_then_exit_3"])
def test_ctrl_c_that_leaves_the_import_lock_held_still_exits_and_leaves_no_ray_process(
    tmp_path: Path, ray_tmp: str, caught: bool
) -> None:
    """A Ctrl-C inside an import can leave CPython's import lock held for good (seen once in
    about 40 tries of the read case above), so a start of Ray for reads would never end: the
    process must not wait for it at exit for long (it waited 60 s), also when the script
    catches the interrupt and exits on its own (it waited 60 s after the first fix)."""
    folder = _parquet_folder(tmp_path)
    proc = _start("read_interrupted_in_an_import", tmp_path / "record.json", ray_tmp,
                  "--folder", str(folder), *(["--caught"] if caught else []))  # fmt: skip
    try:
        _wait_for(proc, "locked")  # once Ray's start began
        began = time.monotonic()
        ray_processes = _descendants(proc.pid)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - began
    finally:
        proc.kill()
    if caught:
        assert proc.returncode == 3, f"exit {proc.returncode}\n{err[-3000:]}"
        assert json.loads((tmp_path / "record.json").read_text()) == {"caught": True}
    else:
        assert proc.returncode == -signal.SIGINT, f"exit {proc.returncode}\n{err[-3000:]}"
        assert "KeyboardInterrupt" in err
    assert took < 30, took  # not the 60 s a normal exit gives a start under way
    assert wait_until(lambda: not _alive(ray_processes), timeout=20), _alive(ray_processes)
