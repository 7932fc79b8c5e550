"""The embedded instance's fork server, seen from the trainer: started with Ray, stopped with it.

``runtime/cluster.py`` starts it (:func:`start`) before the embedded raylet, and
gives the raylet the variables that point its launcher (``worker_launch.py``, run
in place of Ray's ``setup_worker.py``) at it. The server (``fork_server.py``)
imports the packages the loaders' actors will import (:func:`share`), so each Ray
worker forked from it shares their pages instead of importing them again;
docs/design/embedded-runtime.md, "Forked workers". Only the instance raydl starts has one: a
cluster raydl joins starts its workers as its raylets were told to.

What to share is each loader's to say, when it is built (``startup.begin_for``):
a torch dataset's actors import torch, a Ray Data plan's import pyarrow and pandas
and no torch. A package the server imports costs its memory once, whether or not
an actor uses it, so only what a loader's actors import is shared. Said before Ray
starts, it is imported before the first worker is forked; said later, the running
server imports it between two requests (a line on its stdin), and workers forked
from then on share it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence

from raydl._internal.runtime import fork_server, worker_launch

__all__ = ["ForkServer", "share", "start", "stop"]

#: What every worker imports under its own environment, imported once per environment:
#: Ray (docs/design/embedded-runtime.md, "Forked workers").
PER_ENV = ("ray",)

_lock = threading.Lock()
_wanted: list[str] = []  # what the loaders built so far want shared, in order
_server: ForkServer | None = None  # the running one, if any


class ForkServer:
    """A running fork server (:func:`start`, :func:`stop`)."""

    def __init__(self, process: subprocess.Popen[bytes], folder: str) -> None:
        """Wrap the server ``process`` listening in ``folder``."""
        self.process = process
        self.folder = folder

    @property
    def socket(self) -> str:
        """The path the server listens on."""
        return socket_in(self.folder)

    def raylet_env(self, ray_setup_worker: str) -> dict[str, str]:
        """What the raylet's environment needs for its launcher to use this server."""
        return {
            worker_launch.SERVER_VAR: self.socket,
            worker_launch.RAY_SETUP_VAR: ray_setup_worker,
        }

    def ask_to_import(self, modules: Sequence[str]) -> None:
        """Have the server import ``modules`` (one name a line on its stdin)."""
        if self.process.stdin is None or not modules:
            return
        try:
            self.process.stdin.write("".join(f"{name}\n" for name in modules).encode())
            self.process.stdin.flush()
        except OSError:  # it is gone: the launchers fall back to Ray's way
            pass

    def end(self) -> None:
        """End the server (the workers it forked end with it)."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


#: The OpenMP threads of the server, and so of its workers' torch, unless the trainer's
#: environment sets them: OpenMP reads ``OMP_NUM_THREADS`` once, when torch is imported
#: (here). A fresh Ray worker imports torch after Ray set it to the task's CPUs (1 for an
#: actor that asks for none, as raydl's do), and torch's own loader workers run one thread;
#: with the server's default (a thread per core) two forked actors decoding JPEGs ran at a
#: quarter of their speed on 2 cores.
THREADS = {"OMP_NUM_THREADS": "1"}


def share(modules: Sequence[str]) -> None:
    """Have the embedded instance's workers share ``modules`` (imported once, in the server).

    Recorded for a server started later; a running one imports the new names now.
    """
    with _lock:
        new = [name for name in modules if name not in _wanted]
        _wanted.extend(new)
        if _server is not None:
            _server.ask_to_import(new)


def start(
    env_updates: dict[str, str],
    modules: Sequence[str] | None = None,
    per_env: Sequence[str] = PER_ENV,
    *,
    one_job: bool = False,
) -> ForkServer:
    """Start the fork server (ending one that runs) with this environment plus ``env_updates``.

    It imports ``modules``, by default what :func:`share` was told so far, and
    ``per_env`` once per worker environment (in practice per job: Ray, which reads
    the worker's job and raylet from its environment when imported): with
    ``one_job`` (a trainer of one rank), in the server itself under the first
    worker's environment, and in an environment server started fresh for any other;
    else in an environment server, a child of the server, for each. It returns
    at once, its socket listening (bound here, handed to the server), so a worker the
    raylet starts while the server still imports waits for it. The server runs in a
    session of its own, so a terminal's Ctrl-C reaches neither it nor the workers it
    forks (the raylet stops them), and ends when this process closes its stdin
    (:func:`stop`) or exits.
    """
    global _server
    stop()
    folder = tempfile.mkdtemp(prefix="raydl-fork-")  # mode 0700: only this user connects
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with _lock, listener:  # bound here: a launcher that connects before the server runs waits
        names = list(_wanted if modules is None else modules)
        listener.bind(socket_in(folder))
        listener.listen(fork_server.BACKLOG)
        process = subprocess.Popen(
            [
                sys.executable,
                *fork_server.flags(),
                fork_server.__file__,
                str(listener.fileno()),
                *names,
                *([fork_server.PER_ENV_FLAG, *per_env] if per_env else []),
                *([fork_server.IN_PLACE_FLAG] if per_env and one_job else []),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,  # its stderr is the trainer's: it is quiet unless it fails
            env={**THREADS, **os.environ, **env_updates},  # the trainer's threads, if it sets them
            start_new_session=True,
            pass_fds=(listener.fileno(),),
        )
        _server = ForkServer(process, folder)
        return _server


def stop() -> None:
    """End the running fork server, if any."""
    global _server
    with _lock:
        server, _server = _server, None
    if server is not None:
        server.end()


def socket_in(folder: str) -> str:
    """The path a fork server started in ``folder`` listens on."""
    return os.path.join(folder, "fork.sock")
