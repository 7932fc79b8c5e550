"""Fork the embedded Ray instance's worker processes from one that imported torch once.

Ray starts every worker as a fresh interpreter (the raylet runs ``setup_worker.py``,
which execs ``default_worker.py``), so each of a loader's actors imports torch by
itself: about 140 MB of private memory per actor here (its operator registrations
and Python objects), where torch's own ``DataLoader`` forks its workers from the
trainer and they share those pages. This process imports the heavy packages the
trainer's loaders want shared (``sys.argv[2:]``, and later a name a line on its
stdin: torch, numpy, pyarrow, ...) once, then forks a
worker for each request of the raylet's launcher (:mod:`.worker_launch`, run in
place of ``setup_worker.py``); the child becomes an ordinary Ray worker by running
``default_worker.py`` with the launcher's arguments, environment, working folder
and standard streams. Its pages stay shared with this process until written.

Standard library only, run by path (``python fork_server.py FD MODULE... [--per-env
MODULE... [--in-place]]``,
started by ``runtime/forking.py`` before the raylet) in its own session, so a
terminal's Ctrl-C does not reach it or the workers it forks.

* It serves the listening Unix socket ``FD`` (in a private folder), bound by the
  trainer before this process started: a launcher that connects while it still
  imports waits in the backlog.
* Ray is imported once per worker environment, not here: Ray core reads some of
  its settings (the worker's job, its raylet) once per process, when it is
  imported, from the environment the raylet gives each worker. So the modules named
  after ``--per-env`` are imported by an *environment server*: a child of this
  process that took the environment of the first request carrying it, imported
  them, and forks the workers of every later request with the same environment
  (this server passes each one on, with its connection and streams). One per job
  in practice; past ``MAX_ENV_SERVERS`` of them, a request's worker is forked here
  and imports Ray itself.
* ``--in-place`` (a trainer of one rank: one job): this process imports them itself,
  under the first request's environment, and forks every worker of that environment.
  One process instead of two: the pages an environment server and its workers write
  are no longer kept, unwritten, in this process too (docs/design/embedded-runtime.md, "Forked
  workers"). A request under another environment (another driver joined the instance)
  goes to an environment server started fresh (``python fork_server.py --inbox FD
  PARENT MODULE...``, :func:`serve_inbox`), as a forked one would get it: this process
  imported Ray for its own job, so no child of it may.
* One thread, no locks held at ``fork()``: requests, the children's exits
  (``SIGCHLD`` through a wake-up pipe) and the trainer's end (end of file on
  stdin) are served by one ``selectors`` loop.
* A child's exit status goes back to its launcher, which exits with it; a launcher
  that goes away first (the raylet gave up on a worker that did not register)
  takes its child with it (``SIGKILL``).
* A request whose interpreter settings differ from this process's (``PYTHONPATH``,
  ``-S``/``-s``, the executable) is refused and the launcher execs Ray's own path.

Ends when its stdin closes (the trainer stopped Ray or is gone), and the workers
it forked end with it (the kernel's parent-death signal), as they would with the
raylet.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import selectors
import signal
import socket
import sys
import traceback
import warnings
from collections.abc import Iterable
from typing import Any

#: Environment variables that change how an interpreter starts: a request whose values
#: differ from this process's cannot be served by a fork.
INTERPRETER_VARS = ("PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONSAFEPATH")

#: What this server imported for its workers to share, in order (:func:`share`).
SHARED: list[str] = []
#: The environment variable that tells a forked worker what it shares (:func:`shared_by_parent`).
SHARED_VAR = "RAYDL_FORK_SHARED"

#: Seconds a launcher has to send its request once connected.
REQUEST_TIMEOUT_S = 10.0

#: Launchers that may wait for the server at once.
BACKLOG = 128

#: The largest request (arguments and environment), in bytes.
MAX_REQUEST = 1 << 20

#: What separates, on the command line, the modules shared by every worker from those
#: imported once per worker environment (:data:`PER_ENV`).
PER_ENV_FLAG = "--per-env"
#: The modules an environment server imports (``--per-env``): Ray.
PER_ENV: list[str] = []
#: On the command line, after the per-environment modules: import them in this process,
#: under the first request's environment, in place of an environment server.
IN_PLACE_FLAG = "--in-place"
#: On the command line, first: an environment server started fresh, serving an inbox.
INBOX_FLAG = "--inbox"
#: The thread settings an environment server keeps from this process's environment
#: where the worker's has none (``runtime/forking.THREADS``).
THREAD_VARS = ("OMP_NUM_THREADS",)
#: Bytes asked for an environment server's inbox (the kernel caps it at
#: ``net.core.wmem_max``): requests (about 10 KB each, their environments) wait there
#: while it imports; past that the server forks the worker itself.
INBOX_BYTES = 4 << 20
#: The most environment servers at once (in practice one per job: under torchrun each
#: rank's driver is a job of its own).
MAX_ENV_SERVERS = 8


def flags() -> list[str]:
    """This interpreter's site flags as Ray passes them to a worker (``-S``, ``-s``)."""
    return (["-S"] if sys.flags.no_site else []) + (["-s"] if sys.flags.no_user_site else [])


def refusal(request: dict[str, Any]) -> str | None:
    """Why ``request`` cannot run in a child of this process, or None if it can."""
    if request.get("executable") != sys.executable:
        return f"the worker runs {request.get('executable')}, this server {sys.executable}"
    if sorted(request.get("flags", [])) != sorted(flags()):
        return f"the worker runs with {request.get('flags')}, this server with {flags()}"
    env = request.get("env")
    if not isinstance(env, dict) or not isinstance(request.get("argv"), list):
        return "the request has no environment or arguments"
    for name in INTERPRETER_VARS:
        if env.get(name) != os.environ.get(name):
            return f"{name} differs"
    return None


def shared_by_parent() -> tuple[str, ...]:
    """The modules this process inherited, imported, from its parent if that is a fork
    server; ``()`` otherwise (or off Linux).

    A forked worker has them in ``sys.modules`` without having paid for them: their
    pages are the server's until written.
    """
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as cmdline:
            args = [arg.decode() for arg in cmdline.read().split(b"\0") if arg]
    except OSError:
        return ()
    here = os.path.abspath(__file__)
    if not any(os.path.abspath(arg) == here for arg in args):
        return ()
    return tuple(name for name in os.environ.get(SHARED_VAR, "").split(",") if name)


def share(modules: Iterable[str]) -> None:
    """Import ``modules`` here (a package that fails to import is not shared), then keep
    the collector off every object so far: it would write to their pages."""
    for name in modules:
        with contextlib.suppress(Exception):
            __import__(name)
            if name not in SHARED:
                SHARED.append(name)
    gc.collect()
    gc.freeze()


def take_environment(env: dict[str, str]) -> None:
    """Make ``env`` this process's environment, with its thread settings where ``env``
    has none (a package shared later, torch, is imported here too, and OpenMP takes
    them then), and import :data:`PER_ENV` under it."""
    threads = {name: os.environ[name] for name in THREAD_VARS if name in os.environ}
    os.environ.clear()
    os.environ.update({**threads, **env})
    share(PER_ENV)


def become_worker(request: dict[str, Any], fds: list[int]) -> None:
    """In a forked child: take the launcher's streams, environment and arguments, and a
    process group of its own, as the raylet gives each worker it starts (it kills a
    worker's group when the worker exits: this server's would take the server and every
    other worker with it)."""
    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[SHARED_VAR] = ",".join(SHARED)
    os.chdir(request["cwd"])
    argv = request["argv"]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python default_worker.py`
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # as a fresh process's torch would read it
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:  # a fresh process seeds numpy's global generator from the OS
        numpy_random.seed()


def close_all(fds: Iterable[int]) -> None:
    """Close descriptors this process received and does not keep."""
    for fd in fds:
        os.close(fd)


def _inbox() -> tuple[socket.socket, socket.socket]:
    """An environment server's inbox: (the server's end, the environment server's)."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, INBOX_BYTES)
    return mine, theirs


def die_with(parent: int) -> None:
    """Have the kernel SIGKILL this process when ``parent`` (the server) ends.

    The server ends with the trainer or with Ray; a worker it forked then goes too,
    as Ray's workers go with their raylet, even one that has not reached the raylet
    yet (it would wait on a Ray that is gone).
    """
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before the call
        os._exit(1)


class Server:
    """The fork server's loop (:func:`serve`); one instance per process.

    The server serves the listening socket (launchers' requests) and its stdin (the
    trainer's module names); an environment server (:meth:`start_env_server`) serves
    its inbox, a ``SOCK_SEQPACKET`` pair with the server: each message a request with
    the launcher's connection and streams, or the modules to share.
    """

    def __init__(
        self,
        listener: socket.socket | None,
        inbox: socket.socket | None = None,
        *,
        in_place: bool = False,
    ) -> None:
        """Serve ``listener`` and stdin, or, in an environment server, ``inbox``;
        ``in_place``: import :data:`PER_ENV` here (see :data:`IN_PLACE_FLAG`)."""
        self.listener = listener
        self.inbox = inbox
        self.in_place = in_place
        #: In place: the environment this process imported :data:`PER_ENV` under, once it did.
        self.own_env: str | None = None
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, socket.socket] = {}
        #: Environment servers by the environment they imported under: (pid, its inbox).
        self.env_servers: dict[str, tuple[int, socket.socket]] = {}
        self.partial = b""  # the trainer's last line, until it ends
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select() through wake_w
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.selector.register(self.wake_r, selectors.EVENT_READ, "exits")
        if inbox is not None:
            self.selector.register(inbox, selectors.EVENT_READ, "inbox")
        if listener is not None:
            self.selector.register(listener, selectors.EVENT_READ, "accept")
            self.selector.register(sys.stdin, selectors.EVENT_READ, "trainer")

    def serve(self) -> tuple[dict[str, Any], list[int]] | None:
        """Serve until the trainer's end (returns None), or, in a forked child, its request."""
        while True:
            for key, _ in self.selector.select():
                child = None
                if key.data == "accept":
                    child = self.accept()
                elif key.data == "inbox":
                    child, open_ = self.take_forwarded()
                    if not open_:
                        return None
                elif key.data == "exits":
                    self.reap()
                elif key.data == "trainer":
                    if not self.read_trainer():
                        return None
                else:
                    self.launcher_gone(key.fileobj, key.data)  # type: ignore[arg-type]
                if child is not None:
                    return child

    def read_trainer(self) -> bool:
        """Import the modules the trainer named (a name a line), here and in each
        environment server; False at its end of file."""
        data = os.read(sys.stdin.fileno(), 4096)
        if not data:
            return False
        *lines, self.partial = (self.partial + data).split(b"\n")
        names = [line.decode() for line in lines if line]
        share(names)
        for _, inbox in self.env_servers.values():
            with contextlib.suppress(OSError):  # one that ended is reaped; one that is full
                # (busy importing) misses them: its workers import them themselves
                inbox.send(json.dumps({"share": names}).encode(), socket.MSG_DONTWAIT)
        return True

    def accept(self) -> tuple[dict[str, Any], list[int]] | None:
        """Take one request; fork its worker (here or in its environment's server). The
        child's request in the child, else None."""
        conn, _ = self.listener.accept()  # type: ignore[union-attr]
        conn.settimeout(REQUEST_TIMEOUT_S)  # a launcher killed mid-request must not hang the loop
        fds: list[int] = []
        try:
            message, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
            while not message.endswith(b"\n") and len(message) < MAX_REQUEST:
                more = conn.recv(MAX_REQUEST)  # a stream: a long request comes in pieces
                if not more:
                    break
                message += more
            request = json.loads(message)
        except (OSError, ValueError):
            close_all(fds)
            conn.close()
            return None
        why = refusal(request) if len(fds) == 3 else "the launcher sent no streams"
        if why is not None:
            return self.refuse(conn, fds, why)
        if PER_ENV:
            key = json.dumps(sorted(request["env"].items()))
            if self.in_place and self.own_env is None:
                self.own_env = key
                take_environment(request["env"])
            if key == self.own_env:
                return self.fork_worker(request, conn, fds)
            if key not in self.env_servers and len(self.env_servers) < MAX_ENV_SERVERS:
                if self.in_place:  # no child of this process may import Ray for another job
                    self.spawn_env_server(key, request["env"])
                else:
                    child = self.start_env_server(key, request["env"], conn, fds)
                    if child is not None:  # in the environment server: its first request
                        return child
            if key in self.env_servers and self.forward(key, request, conn, fds):
                return None
            if self.in_place:
                return self.refuse(conn, fds, "this server imported Ray for another job")
        return self.fork_worker(request, conn, fds)

    @staticmethod
    def refuse(conn: socket.socket, fds: list[int], why: str) -> None:
        """Tell the launcher of ``conn`` why its worker is not forked here (it runs Ray's
        own path then)."""
        close_all(fds)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"refused": why}).encode() + b"\n")
        conn.close()

    def fork_worker(
        self, request: dict[str, Any], conn: socket.socket, fds: list[int]
    ) -> tuple[dict[str, Any], list[int]] | None:
        """Fork the worker of ``request``; in the child, return the request and streams."""
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            die_with(server)
            self.close_in_child(conn)
            return request, fds
        close_all(fds)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        self.children[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)
        return None

    def start_env_server(
        self, key: str, env: dict[str, str], conn: socket.socket, fds: list[int]
    ) -> tuple[dict[str, Any], list[int]] | None:
        """Fork the server of the environment ``env``: it imports :data:`PER_ENV` under
        it and serves what :meth:`forward` passes it, the request at hand (``conn``,
        ``fds``) first. In that child this returns, in each worker it forks, the
        worker's request (or ends the process with the server)."""
        mine, theirs = _inbox()
        server = os.getpid()
        pid = os.fork()
        if pid != 0:
            theirs.close()
            self.env_servers[key] = (pid, mine)
            return None
        die_with(server)
        mine.close()
        self.close_in_child(conn)
        close_all(fds)  # the server passes them on (:meth:`forward`)
        devnull = os.open(os.devnull, os.O_RDONLY)  # not the trainer's pipe: the server reads it
        os.dup2(devnull, 0)
        os.close(devnull)
        take_environment(env)
        try:
            child = Server(None, inbox=theirs).serve()
        except BaseException:  # never unwind into the server's frames (and its exit)
            traceback.print_exc()
            os._exit(1)
        if child is None:
            os._exit(0)
        return child

    def spawn_env_server(self, key: str, env: dict[str, str]) -> None:
        """Start the server of the environment ``env`` as a fresh interpreter
        (:func:`serve_inbox`): it imports what this process shares, then
        :data:`PER_ENV` under ``env``, and serves what :meth:`forward` passes it."""
        mine, theirs = _inbox()
        os.set_inheritable(theirs.fileno(), True)
        threads = {name: os.environ[name] for name in THREAD_VARS if name in os.environ}
        argv = [sys.executable, *flags(), os.path.abspath(__file__), INBOX_FLAG]
        argv += [str(theirs.fileno()), str(os.getpid()), *SHARED, PER_ENV_FLAG, *PER_ENV]
        try:
            pid = os.posix_spawn(
                sys.executable,
                argv,
                {**threads, **env},
                file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)],
            )
        except OSError:
            mine.close()
            return
        finally:
            theirs.close()
        self.env_servers[key] = (pid, mine)

    def forward(
        self, key: str, request: dict[str, Any], conn: socket.socket, fds: list[int]
    ) -> bool:
        """Pass ``request``, its connection and streams to the environment server ``key``;
        False (everything still here) if it is gone or its inbox is full (never blocks:
        this loop serves every environment)."""
        _, inbox = self.env_servers[key]
        message = json.dumps(request).encode()
        try:
            socket.send_fds(inbox, [message], [conn.fileno(), *fds], socket.MSG_DONTWAIT)
        except OSError:
            return False
        close_all(fds)
        conn.close()
        return True

    def take_forwarded(self) -> tuple[tuple[dict[str, Any], list[int]] | None, bool]:
        """In an environment server: the next message of the inbox. Returns the child's
        request in a forked child, and whether the inbox is still open."""
        assert self.inbox is not None
        try:
            message, fds, _, _ = socket.recv_fds(self.inbox, MAX_REQUEST, 4)
        except OSError:
            return None, False
        if not message:
            return None, False
        data = json.loads(message)
        if "share" in data:
            share(data["share"])
            return None, True
        if len(fds) != 4:  # descriptors lost on the way (out of them): the launcher gets EOF
            close_all(fds)
            return None, True
        conn = socket.socket(fileno=fds[0])
        conn.settimeout(REQUEST_TIMEOUT_S)  # as the server set it (its flags came along)
        return self.fork_worker(data, conn, fds[1:]), True

    def close_in_child(self, conn: socket.socket | None) -> None:
        """What a forked child must not keep: the server's sockets, pipes and handlers."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.selector.close()
        others = [*self.children.values(), *(inbox for _, inbox in self.env_servers.values())]
        for other in (*others, conn, self.listener, self.inbox):
            if other is not None:
                other.close()
        os.close(self.wake_r)
        os.close(self.wake_w)

    def reap(self) -> None:
        """Collect exited children; tell each one's launcher its exit code."""
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            for key, (env_pid, inbox) in list(self.env_servers.items()):
                if env_pid == pid:  # its workers went with it (their parent-death signal)
                    del self.env_servers[key]
                    inbox.close()
            conn = self.children.pop(pid, None)
            if conn is not None:
                self.selector.unregister(conn)
                code = os.waitstatus_to_exitcode(status)  # -N: killed by signal N
                with contextlib.suppress(OSError):  # a shell's exit status, as bash gives it
                    conn.sendall(b"%d\n" % (code if code >= 0 else 128 - code))
                conn.close()

    def launcher_gone(self, conn: socket.socket, pid: int) -> None:
        """A launcher closed its connection before its child exited: the child goes too."""
        try:
            if conn.recv(1):
                return  # launchers send nothing more; ignore it
        except OSError:
            pass
        self.selector.unregister(conn)
        conn.close()
        if self.children.pop(pid, None) is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def serve_inbox(fd: int, parent: int, modules: list[str]) -> None:
    """Serve the inbox ``fd`` as the environment server of a server (``parent``) that
    imported Ray for another job (:meth:`Server.spawn_env_server`): import ``modules``
    (those after :data:`PER_ENV_FLAG` too) under this process's environment, the
    workers'; in a forked child, run the worker."""
    die_with(parent)
    # What the server had open and could be inherited (its listener, the streams of the
    # request at hand): a launcher's pipe held here would never reach its end of file.
    os.closerange(3, fd)
    os.closerange(fd + 1, os.sysconf("SC_OPEN_MAX"))
    inbox = socket.socket(fileno=fd)
    at = modules.index(PER_ENV_FLAG)
    modules, PER_ENV[:] = modules[:at], modules[at + 1 :]
    share(modules)
    share(PER_ENV)
    warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks")
    child = Server(None, inbox=inbox).serve()
    if child is not None:
        run_worker(child)


def run_worker(child: tuple[dict[str, Any], list[int]]) -> None:
    """In a forked child: become the worker of ``child``'s request and run it."""
    become_worker(*child)
    import runpy

    runpy.run_path(sys.argv[0], run_name="__main__")


def main(fd: int, modules: list[str]) -> None:
    """Import ``modules``, serve the listening socket ``fd``; in a forked child, run the worker.

    ``modules`` after :data:`PER_ENV_FLAG` are imported per worker environment (here,
    with :data:`IN_PLACE_FLAG` last).
    """
    listener = socket.socket(fileno=fd)
    path = listener.getsockname()
    in_place = modules[-1:] == [IN_PLACE_FLAG]
    if in_place:
        modules = modules[:-1]
    if PER_ENV_FLAG in modules:
        at = modules.index(PER_ENV_FLAG)
        modules, PER_ENV[:] = modules[:at], modules[at + 1 :]
    share(modules)
    # Python 3.12+ warns at each fork() of a process with threads; this one's are numpy's
    # OpenBLAS pool and pyarrow's jemalloc background thread, which both handle fork().
    warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks")
    child = Server(listener, in_place=in_place and bool(PER_ENV)).serve()
    if child is None:
        listener.close()
        os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))  # the private folder made for it
        return
    run_worker(child)


if __name__ == "__main__":
    if sys.argv[1] == INBOX_FLAG:
        serve_inbox(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
    else:
        main(int(sys.argv[1]), sys.argv[2:])
