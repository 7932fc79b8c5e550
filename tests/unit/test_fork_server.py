"""The fork server and its launcher (``runtime/fork_server.py``, ``worker_launch.py``), without Ray.

This test process plays the raylet: it runs the launcher with a worker's command
line, where the "worker" is a small script that reports what it was given (its
arguments, environment, folder, streams, parent) and exits with a chosen status.
Linux only, as the fork server is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from raydl._internal.runtime import fork_server, forking, worker_launch

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks Linux processes"),
    pytest.mark.timeout(60),
]

#: A stand-in for ``default_worker.py``: writes what it saw to ``REPORT``, then exits.
WORKER = """
import json, os, sys, time
from raydl._internal.runtime.fork_server import shared_by_parent
report = {
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "pid": os.getpid(),
    "marker": os.environ.get("MARKER"), "json_loaded": "json" in sys.modules,
    "shared": list(shared_by_parent()), "stdin": sys.stdin.readline().strip(),
    "ppid": os.getppid(), "envmod": getattr(sys.modules.get("envmod"), "MARKER", None),
}
with open(os.environ["REPORT"], "w") as f:
    json.dump(report, f)
if os.environ.get("DRAW"):
    import numpy
    print(numpy.random.random(), flush=True)
print("worker says hello", flush=True)
if "--sleep" in sys.argv:
    time.sleep(60)
sys.exit(int(os.environ.get("EXIT", "0")))
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[forking.ForkServer]:
    """A fork server sharing ``json`` (this test's stand-in for torch)."""
    started = forking.start({}, modules=["json"], per_env=())
    yield started
    forking.stop()


def _launch(
    server: forking.ForkServer | None,
    tmp_path: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    context: str = "{}",
) -> subprocess.Popen[str]:
    script = tmp_path / "default_worker.py"
    script.write_text(WORKER)
    environ = {
        **os.environ,
        "REPORT": str(tmp_path / "report.json"),
        "MARKER": "from-the-raylet",
        worker_launch.RAY_SETUP_VAR: str(tmp_path / "ray_setup_worker.py"),
        **(env or {}),
    }
    if server is not None:
        environ[worker_launch.SERVER_VAR] = server.socket
    (tmp_path / "ray_setup_worker.py").write_text(  # Ray's path: execs the worker itself
        "import os, sys\n"
        "args = [a for a in sys.argv[1:] if not a.startswith('--language')"
        " and not a.startswith('--serialized')]\n"
        "os.execv(sys.executable, [sys.executable, *args])\n"
    )
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    return subprocess.Popen(
        [
            sys.executable,
            worker_launch.__file__,
            str(script),
            "--node-ip-address=127.0.0.1",
            *extra,
            f"--serialized-runtime-env-context={context}",
            "--language=PYTHON",
        ],
        env=environ,
        cwd=cwd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _report(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "report.json").read_text())


def test_a_launched_worker_is_forked_with_the_launchers_arguments_environment_and_streams(
    server: forking.ForkServer, tmp_path: Path
) -> None:
    launcher = _launch(server, tmp_path, env={"EXIT": "3"})
    out, _ = launcher.communicate("line for the worker\n", timeout=30)
    assert launcher.returncode == 3  # the worker's status, passed on
    assert out == "worker says hello\n"  # the launcher's stdout, written by the worker
    seen = _report(tmp_path)
    assert seen["argv"] == [str(tmp_path / "default_worker.py"), "--node-ip-address=127.0.0.1"]
    assert seen["marker"] == "from-the-raylet"
    assert seen["cwd"] == str(tmp_path / "cwd")
    assert seen["path0"] == str(tmp_path)  # as `python default_worker.py` would have it
    assert seen["stdin"] == "line for the worker"
    assert seen["pid"] != launcher.pid
    assert "json" in seen["shared"] and seen["json_loaded"]


def test_a_worker_with_a_runtime_env_or_without_a_server_starts_as_ray_starts_it(
    server: forking.ForkServer, tmp_path: Path
) -> None:
    context = json.dumps({"env_vars": {"A": "1"}})
    for launched in (_launch(server, tmp_path, context=context), _launch(None, tmp_path)):
        out, _ = launched.communicate("", timeout=30)
        assert launched.returncode == 0 and out == "worker says hello\n"
        seen = _report(tmp_path)
        assert seen["pid"] == launched.pid  # Ray's path: the launcher became the worker
        assert seen["shared"] == []


def test_a_request_the_server_cannot_serve_falls_back_to_rays_path(
    server: forking.ForkServer, tmp_path: Path
) -> None:
    other = {"PYTHONPATH": os.environ.get("PYTHONPATH", "") + os.pathsep + str(tmp_path)}
    launched = _launch(server, tmp_path, env=other)
    launched.communicate("", timeout=30)
    assert launched.returncode == 0
    assert _report(tmp_path)["pid"] == launched.pid


def test_a_killed_launcher_takes_its_worker_and_a_killed_worker_its_launcher(
    server: forking.ForkServer, tmp_path: Path
) -> None:
    launcher = _launch(server, tmp_path, "--sleep")
    assert launcher.stdin is not None and launcher.stdout is not None
    launcher.stdin.close()  # the worker reads its stdin to its end
    assert launcher.stdout.readline() == "worker says hello\n"
    worker = _report(tmp_path)["pid"]
    launcher.kill()  # the raylet giving up on a worker that did not register
    launcher.wait(timeout=10)
    _gone_within(worker, 10)

    launcher = _launch(server, tmp_path, "--sleep")
    assert launcher.stdin is not None and launcher.stdout is not None
    launcher.stdin.close()  # the worker reads its stdin to its end
    assert launcher.stdout.readline() == "worker says hello\n"
    os.kill(_report(tmp_path)["pid"], signal.SIGKILL)  # the raylet killing the worker it knows
    assert launcher.wait(timeout=10) == 128 + signal.SIGKILL


def test_workers_end_with_their_server(tmp_path: Path) -> None:
    """The trainer gone (its end of the server's stdin closed): the server ends, and so
    does every worker it forked (as Ray's workers end with their raylet)."""
    started = forking.start({}, modules=[], per_env=())
    try:
        launcher = _launch(started, tmp_path, "--sleep")
        assert launcher.stdin is not None and launcher.stdout is not None
        launcher.stdin.close()
        assert launcher.stdout.readline() == "worker says hello\n"
        worker = _report(tmp_path)["pid"]
        assert worker != launcher.pid
    finally:
        forking.stop()
    _gone_within(worker, 10)
    assert launcher.wait(timeout=10) != 0


def test_the_server_ends_with_its_stdin_and_removes_its_folder(tmp_path: Path) -> None:
    started = forking.start({}, modules=[], per_env=())
    _wait_for(lambda: os.path.exists(started.socket), 20)
    assert started.process.stdin is not None
    started.process.stdin.close()
    assert started.process.wait(timeout=20) == 0
    assert not os.path.exists(started.folder)


def test_each_worker_draws_its_own_numpy_stream(tmp_path: Path) -> None:
    """numpy's global generator, created in the server, is reseeded from the OS in each
    child, as a fresh process seeds it."""
    started = forking.start({}, modules=["numpy.random"], per_env=())
    draws = []
    try:
        for _ in range(2):
            launched = _launch(started, tmp_path, env={"DRAW": "1"})
            out, _ = launched.communicate("", timeout=30)
            assert launched.returncode == 0
            assert _report(tmp_path)["shared"] == ["numpy.random"]
            draws.append(out.splitlines()[0])
    finally:
        forking.stop()
    assert draws[0] != draws[1], draws


def test_modules_shared_later_reach_the_workers_forked_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loader built once the server runs has it import what its actors need."""
    monkeypatch.setattr(forking, "_wanted", [])  # this process's loaders' wishes stay as they are
    started = forking.start({}, modules=[], per_env=())
    try:
        launched = _launch(started, tmp_path)
        launched.communicate("", timeout=30)
        assert _report(tmp_path)["shared"] == []
        forking.share(["json", "no_such_module_here"])  # the second fails: not shared
        deadline = time.monotonic() + 20
        while True:
            launched = _launch(started, tmp_path)
            launched.communicate("", timeout=30)
            if _report(tmp_path)["shared"] or time.monotonic() > deadline:
                break
        assert _report(tmp_path)["shared"] == ["json"]
    finally:
        forking.stop()


#: A module that reads the environment when imported, as Ray reads its worker's job.
ENVMOD = "import os\nMARKER = os.environ.get('MARKER')\n"


def _start_with_envmod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, one_job: bool = False
) -> forking.ForkServer:
    """A server sharing ``json`` that imports ``envmod`` (which keeps ``MARKER``) per environment."""
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "envmod.py").write_text(ENVMOD)
    monkeypatch.setenv("PYTHONPATH", str(modules))  # the server's and the launchers'
    monkeypatch.setattr(forking, "_wanted", [])
    return forking.start({}, modules=["json"], per_env=["envmod"], one_job=one_job)


def _three_jobs(started: forking.ForkServer, tmp_path: Path) -> dict[str, dict]:
    """Launch a worker of job a, one of job b, one of job a again: what each reported."""
    seen = {}
    for name, marker in (("a1", "job-a"), ("b", "job-b"), ("a2", "job-a")):
        launched = _launch(started, tmp_path, env={"MARKER": marker})
        out, _ = launched.communicate("", timeout=30)
        assert launched.returncode == 0 and out == "worker says hello\n"
        seen[name] = {**_report(tmp_path), "launcher": launched.pid}
    return seen


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_per_environment_modules_are_imported_once_per_worker_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers of one environment (one job) fork from one environment server that
    imported ``per_env`` under that environment; another environment gets its own."""
    started = _start_with_envmod(tmp_path, monkeypatch)
    try:
        seen = _three_jobs(started, tmp_path)
        assert [seen[n]["envmod"] for n in ("a1", "b", "a2")] == ["job-a", "job-b", "job-a"]
        assert seen["a1"]["ppid"] == seen["a2"]["ppid"] != seen["b"]["ppid"]
        for report in seen.values():
            assert report["ppid"] != started.process.pid
            assert _parent(report["ppid"]) == started.process.pid  # a child of the server
            assert report["shared"] == ["json", "envmod"]

        forking.share(["colorsys"])  # a loader built later: its environment servers import it
        deadline = time.monotonic() + 20
        while True:
            launched = _launch(started, tmp_path, "--sleep", env={"MARKER": "job-a"})
            assert launched.stdin is not None and launched.stdout is not None
            launched.stdin.close()
            assert launched.stdout.readline() == "worker says hello\n"
            late = _report(tmp_path)
            if "colorsys" in late["shared"] or time.monotonic() > deadline:
                break
            launched.kill()
            launched.wait(timeout=10)
        assert late["shared"] == ["json", "envmod", "colorsys"] and late["envmod"] == "job-a"
        launched.kill()  # the raylet giving up on it: its environment server kills the worker
        launched.wait(timeout=10)
        _gone_within(late["pid"], 10)

        # Two live workers of a new environment: the first one's launcher killed (the
        # connection its environment server got with its first request) takes only it.
        pair = []
        for _ in range(2):
            launched = _launch(started, tmp_path, "--sleep", env={"MARKER": "job-c"})
            assert launched.stdin is not None and launched.stdout is not None
            launched.stdin.close()
            assert launched.stdout.readline() == "worker says hello\n"
            pair.append((launched, _report(tmp_path)))
        assert pair[0][1]["ppid"] == pair[1][1]["ppid"]
        pair[0][0].kill()
        pair[0][0].wait(timeout=10)
        _gone_within(pair[0][1]["pid"], 10)
        os.kill(pair[1][1]["pid"], 0)  # its sibling still runs
        launched, last = pair[1]
    finally:
        forking.stop()
    for pid in (last["pid"], last["ppid"], seen["a1"]["ppid"]):  # they end with the server
        _gone_within(pid, 10)
    assert launched.wait(timeout=10) != 0


def test_for_one_job_the_server_imports_per_environment_modules_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``one_job`` (a trainer of one rank): the server itself imports ``per_env`` under
    the first worker's environment and forks that environment's workers; a worker of
    another environment (another driver joined) comes from an environment server started
    as a fresh interpreter, which imported what the server shares, then ``per_env``."""
    started = _start_with_envmod(tmp_path, monkeypatch, one_job=True)
    try:
        seen = _three_jobs(started, tmp_path)
        launched = _launch(started, tmp_path, "--sleep", env={"MARKER": "job-b"})
        assert launched.stdin is not None and launched.stdout is not None
        launched.stdin.close()
        assert launched.stdout.readline() == "worker says hello\n"
        seen["b2"] = _report(tmp_path)
        with open(f"/proc/{seen['b']['ppid']}/cmdline", "rb") as f:
            env_server = f.read().split(b"\0")
    finally:
        forking.stop()
    for name in ("a1", "a2"):
        assert seen[name]["ppid"] == started.process.pid, seen  # forked by the server itself
        assert seen[name]["envmod"] == "job-a" and seen[name]["shared"] == ["json", "envmod"]
    assert seen["b"]["pid"] != seen["b"]["launcher"], seen  # forked, not Ray's path
    assert seen["b"]["ppid"] == seen["b2"]["ppid"] != started.process.pid, seen
    assert fork_server.INBOX_FLAG.encode() in env_server, env_server  # started fresh
    assert seen["b"]["envmod"] == "job-b" and seen["b"]["shared"] == ["json", "envmod"]
    for pid in (seen["b2"]["pid"], seen["b"]["ppid"]):  # they end with the server
        _gone_within(pid, 10)
    assert launched.wait(timeout=10) != 0


def test_a_long_request_is_read_whole(server: forking.ForkServer, tmp_path: Path) -> None:
    """A launcher's environment of 100 KB arrives in pieces (a stream carrying descriptors
    gives its first 36 KB or so to the first read): still forked, not Ray's path."""
    launched = _launch(server, tmp_path, env={"BIG": "x" * 100_000})
    out, _ = launched.communicate("", timeout=30)
    assert launched.returncode == 0 and out == "worker says hello\n"
    seen = _report(tmp_path)
    assert seen["pid"] != launched.pid and seen["marker"] == "from-the-raylet"


def test_parse_splits_the_raylets_arguments_in_either_form() -> None:
    assert worker_launch.parse(
        ["-s", "w.py", "--a=1", "--language", "PYTHON", "--serialized-runtime-env-context", "{}"]
    ) == ({}, "PYTHON", ["-s"], ["w.py", "--a=1"])
    assert worker_launch.forkable({}, "PYTHON")
    assert not worker_launch.forkable({"env_vars": {"A": "1"}}, "PYTHON")
    assert not worker_launch.forkable({"py_executable": "/other/python"}, "PYTHON")
    assert not worker_launch.forkable({}, "JAVA")


def test_a_process_not_forked_by_a_server_shares_nothing() -> None:
    assert fork_server.shared_by_parent() == ()


def _gone_within(pid: int, seconds: float) -> None:
    def gone() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().split(") ")[1].startswith("Z")  # a zombie is gone too
        except (FileNotFoundError, ProcessLookupError):  # gone before or while read
            return True

    _wait_for(gone, seconds)


def _wait_for(done: object, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
