"""Stop the embedded Ray instance's processes when the training process dies.

Ray ties the processes ``ray.init`` starts (gcs_server, raylet, monitors) to the
driver, and the raylet's workers exit soon after the raylet. Two helpers do
not: when the raylet dies unexpectedly, the dashboard agent and the runtime-env
agent try to report it to the (dead) GCS and only exit after that call's 60 s
timeout. A training process that is SIGKILLed (OOM killer, a scheduler
pre-empting the job) would leave them behind for a minute, every time.

When raydl starts the embedded instance it also starts this file as a small
separate process (standard library only; run by path, so it imports neither
raydl nor torch), before ``ray.init``, so that an interrupted start is covered
too. It follows the Ray processes the driver starts from then on and their
descendants, and once the driver is gone it SIGKILLs what is left of them. It
exits by itself once they are all gone (``ray.shutdown()``). Linux only (it
reads ``/proc``); elsewhere nothing is started.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

#: Seconds between two looks at the process table.
POLL_S = 0.5

#: Seconds the instance's other processes get to exit after its GCS and raylet did
#: (``ray.shutdown()``) before they are SIGKILLed.
LEFTOVER_GRACE_S = 5.0

#: A process: (pid, start time in clock ticks since boot); the pair survives pid reuse.
Proc = tuple[int, int]

#: The instance's session folder in its processes' command lines (``--session-dir=``,
#: ``--object-store-name=<session>/sockets/plasma_store``, ...).
_SESSION = re.compile(rb"/session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_\d+")


def _stat(pid: int) -> tuple[int, int] | None:
    """``(parent pid, start time)`` of a live process, ``None`` if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields follow the last ")".
    fields = data[data.rindex(b")") + 2 :].split()
    if fields[0] in {b"Z", b"X"}:
        return None
    return int(fields[1]), int(fields[19])


def started(pid: int) -> int | None:
    """When the live process ``pid`` started (clock ticks since boot); ``None`` if it is
    gone, a zombie, or this is not Linux (no ``/proc`` to read)."""
    if not sys.platform.startswith("linux"):
        return None
    stat = _stat(pid)
    return None if stat is None else stat[1]


def _table() -> dict[int, tuple[int, int]]:
    """Every live process: pid -> (parent pid, start time)."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None:
                table[int(name)] = stat
    return table


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def ray_children(pid: int, ray_dir: str) -> set[Proc]:
    """The live child processes of ``pid`` that run a program of Ray's package ``ray_dir``.

    What ``ray.init`` starts runs from there (gcs_server, raylet, the monitors);
    a child that only mentions Ray (this watcher: ``raydl/...``; a script's own
    subprocess with ``ray`` in an argument) is not Ray's.
    """
    if not sys.platform.startswith("linux"):
        return set()
    marker = os.path.join(ray_dir, "").encode()
    return {
        (child, start)
        for child, (parent, start) in _table().items()
        if parent == pid and marker in _cmdline(child)
    }


def _sessions(procs: set[Proc]) -> set[bytes]:
    """The session folders named in the command lines of ``procs``."""
    return {m.group() for pid, _ in procs for m in _SESSION.finditer(_cmdline(pid))}


def _open_paths(pid: int) -> list[bytes]:
    """The paths of the files ``pid`` holds open (empty if it is gone or not ours to read)."""
    folder = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(folder)
    except OSError:
        return []
    paths = []
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile
            paths.append(os.fsencode(os.readlink(f"{folder}/{fd}")))
    return paths


def _mentions(text: bytes, session: bytes) -> bool:
    """Whether ``text`` (a path, or a command line's NUL-separated arguments) names
    ``session`` itself, not a longer name it begins."""
    return any(session + end in text for end in (b"/", b"\0")) or text.endswith(session)


def _of_session(pid: int, sessions: set[bytes], marker: bytes) -> bool:
    """Whether ``pid`` is a Ray process of one of ``sessions``.

    A Ray process: it runs a program of Ray's package (``marker``, its folder), or it
    retitled itself (``ray::IDLE``, ``ray::DashboardAgent``); never a user's
    ``tail -f`` of a log. Of the session: its command line names it, or, retitled, it
    holds one of its files open.
    """
    line = _cmdline(pid)
    retitled = line.startswith(b"ray::")
    if not retitled and marker not in line:
        return False
    if any(_mentions(line, session) for session in sessions):
        return True
    return retitled and any(
        _mentions(path, session) for path in _open_paths(pid) for session in sessions
    )


def _of_sessions(sessions: set[bytes], ray_dir: str, driver: int) -> set[Proc]:
    """Every live Ray process (but this one and the driver) of one of ``sessions``.

    The processes the raylet forked just before it died (a worker, its dashboard
    agent): reparented before the next look, they are no one's descendants any
    more, and would wait for their raylet until Ray's own timeout. Their command
    line names their session, until they retitle themselves (``ray::IDLE``,
    ``ray::DashboardAgent``); the raylet's log files they inherit (``raylet.out``,
    open from the fork on) still do.
    """
    if not sessions:
        return set()
    marker = os.path.join(ray_dir, "").encode()
    return {
        (pid, start)
        for pid, (_, start) in _table().items()
        if pid not in {os.getpid(), driver} and _of_session(pid, sessions, marker)
    }


def _named_after(driver: Proc, ray_dir: str) -> set[bytes]:
    """The session folders named after ``driver`` that live Ray processes still name.

    Ray names a session after the process that starts it
    (``session_<date>_<time>_<usec>_<driver pid>``). A driver that dies within one look
    of its GCS's start leaves this watcher without the session's name (nothing followed),
    and its Ray processes, reparented, are no one's descendants; they still name the
    session, on their command line or (retitled) in the files they hold open. Only Ray
    processes started since the driver count, and only sessions named since it began:
    an instance that a process with the same pid started before (``ray start``, its
    cluster still running) is not its.
    """
    marker = os.path.join(ray_dir, "").encode()
    pid = str(driver[0]).encode()
    since = _wall_time(driver[1]) - 1.0  # a session named before the driver began is not its
    found: set[bytes] = set()
    for other, (_, start) in _table().items():
        line = _cmdline(other)
        retitled = line.startswith(b"ray::")
        if start < driver[1] or other == os.getpid() or not (retitled or marker in line):
            continue
        for text in [line, *(_open_paths(other) if retitled else [])]:
            for match in _SESSION.finditer(text):
                name = match.group()
                if name.endswith(b"_" + pid) and _mentions(text, name) and _named_at(name) >= since:
                    found.add(name)
    return found


def _wall_time(ticks: int) -> float:
    """A process's start (clock ticks since boot, ``/proc/<pid>/stat``) as seconds since the epoch."""
    with open("/proc/stat", "rb") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _named_at(session: bytes) -> float:
    """When Ray named ``session`` (``/session_<date>_<time>_<usec>_<pid>``, local time)."""
    date, clock, usec = session.decode().split("_")[1:4]
    return time.mktime(time.strptime(f"{date} {clock}", "%Y-%m-%d %H-%M-%S")) + int(usec) / 1e6


def _is_core(pid: int) -> bool:
    """The GCS or the raylet: once they are gone, so is the instance."""
    line = _cmdline(pid)
    return b"gcs_server" in line or b"raylet" in line


def _alive_with_descendants(procs: set[Proc]) -> set[Proc]:
    """``procs`` still running (same pid and start time) and all their descendants."""
    table = _table()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found = {(pid, start) for pid, start in procs if table.get(pid, (0, -1))[1] == start}
    stack = [pid for pid, _ in found]
    while stack:
        for child in children.get(stack.pop(), []):
            proc = (child, table[child][1])
            if proc not in found:
                found.add(proc)
                stack.append(child)
    return found


def start(driver: int, ray_dir: str, exclude: set[Proc]) -> subprocess.Popen[bytes] | None:
    """Watch, from a separate process, the Ray processes ``driver`` starts from now on.

    Started before ``ray.init``: a Ctrl-C or a kill in the middle of Ray's own start
    leaves nothing behind either. ``exclude``: Ray children the driver already has
    (another instance's), which are not this watcher's. ``ray_dir``: Ray's
    package folder (this watcher does not import Ray).

    Returns:
        The watcher's process, ``None`` where none started (not Linux, no driver).
    """
    if not sys.platform.startswith("linux"):
        return None
    driver_start = _stat(driver)
    if driver_start is None:
        return None
    args = [f"{pid}:{start}" for pid, start in sorted(exclude)]
    return subprocess.Popen(
        [
            sys.executable,
            "-I",
            "-S",
            os.path.abspath(__file__),
            f"{driver}:{driver_start[1]}",
            ray_dir,
            *args,
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the driver's process group: a Ctrl-C does not stop it
        close_fds=True,
    )


def _parse(arg: str) -> Proc:
    pid, start = arg.split(":")
    return int(pid), int(start)


def watch(driver: Proc, ray_dir: str, exclude: set[Proc]) -> None:
    """Follow the driver's new Ray children and their descendants; SIGKILL them once it is gone.

    A process stays followed while it lives, also after its parent died (the
    raylet's agents outlive it). Returns when the driver is gone, or once the
    instance it started is over: its GCS or raylet was followed and nothing
    followed is left (``ray.shutdown()``) and no Ray process names its session. What
    is still running ``LEFTOVER_GRACE_S`` after the GCS and raylet are gone is
    SIGKILLed, and the watcher returns.
    """
    tracked: set[Proc] = set()
    core: set[Proc] = set()
    sessions: set[bytes] = set()  # the instance's session folders, from its GCS and raylet
    over_at: float | None = None  # when the GCS and raylet were found gone
    while True:
        stat = _stat(driver[0])
        driver_alive = stat is not None and stat[1] == driver[1]
        tracked = _alive_with_descendants(tracked)
        if core and not core & tracked:
            # The instance is over (ray.shutdown()). From now on the driver's new Ray
            # children are another instance's, not this watcher's.
            over_at = over_at or time.monotonic()
        if driver_alive and over_at is None:
            new = ray_children(driver[0], ray_dir) - exclude - tracked
            found = {proc for proc in new if _is_core(proc[0])}
            core |= found
            sessions |= _sessions(found)
            tracked |= new
        if not driver_alive and not core:
            # It died before this watcher saw its instance's GCS: the session is named after it.
            sessions |= _named_after(driver, ray_dir)
        if not tracked and (core or not driver_alive):
            # ray.shutdown(), or a driver that never started Ray; unless a process the
            # raylet forked in its last moments escaped the descendants' walk.
            tracked = _alive_with_descendants(_of_sessions(sessions, ray_dir, driver[0]))
            if not tracked:
                return
            # What it found gets what is left of the grace begun at the GCS and raylet's exit.
        if not driver_alive or (
            # Some of the instance's processes outlive it (a worker stuck on its way
            # out) beside a driver that goes on.
            over_at is not None and time.monotonic() - over_at > LEFTOVER_GRACE_S
        ):
            _kill(tracked)
            # Workers forked in the last moments escaped the descendants' walk: the
            # session's name finds them (twice: one may still be forking).
            for _ in range(2):
                _kill(_alive_with_descendants(_of_sessions(sessions, ray_dir, driver[0])))
                time.sleep(POLL_S)
            return
        time.sleep(POLL_S)


def _kill(procs: set[Proc]) -> None:
    for pid, _ in procs:
        with contextlib.suppress(OSError):  # it exited meanwhile
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(_parse(sys.argv[1]), sys.argv[2], {_parse(arg) for arg in sys.argv[3:]})
