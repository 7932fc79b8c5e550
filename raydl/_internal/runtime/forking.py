"""The embedded instance's fork server, seen from the trainer: started with Ray, stopped with it.

``runtime/cluster.py`` starts it (:func:`start`) before the embedded raylet, and
gives the raylet the variables that point its launcher (``worker_launch.py``, run
in place of Ray's ``setup_worker.py``) at it. The server (``fork_server.py``)
imports the heavy packages this process has imported (:data:`SHARED`), so each
Ray worker forked from it shares their pages instead of importing them again;
docs/design.md, "Forked workers". Only the instance raydl starts has one: a
cluster raydl joins starts its workers as its raylets were told to.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from raydl._internal.runtime import fork_server, worker_launch

__all__ = ["SHARED", "ForkServer", "start"]

#: The packages the server imports if this process has: every raydl actor imports
#: numpy and torch (map-style work), pyarrow (reads), pandas (pyarrow's conversions
#: to numpy import it), so they are worth sharing whenever the trainer has them.
SHARED = ("numpy", "torch", "pyarrow", "pandas")


class ForkServer:
    """A running fork server; :meth:`stop` ends it (closing its stdin)."""

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

    def stop(self) -> None:
        """End the server (the workers it forked are the raylet's and end with it)."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def start(env_updates: dict[str, str], modules: Sequence[str] | None = None) -> ForkServer:
    """Start a fork server with this process's environment plus ``env_updates``.

    It imports ``modules`` (by default those of :data:`SHARED` this process has).

    It returns at once, its socket listening (bound here, handed to the server), so a
    worker the raylet starts while the server still imports waits for it. The server runs in a session of its own, so a
    terminal's Ctrl-C reaches neither it nor the workers it forks (the raylet stops
    them), and ends when this process closes its stdin or exits.
    """
    folder = tempfile.mkdtemp(prefix="raydl-fork-")  # mode 0700: only this user connects
    if modules is None:
        modules = [name for name in SHARED if name in sys.modules]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with listener:  # bound here: a launcher that connects before the server runs waits
        listener.bind(socket_in(folder))
        listener.listen(fork_server.BACKLOG)
        process = subprocess.Popen(
            [
                sys.executable,
                *fork_server.flags(),
                fork_server.__file__,
                str(listener.fileno()),
                *modules,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,  # its stderr is the trainer's: it is quiet unless it fails
            env={**os.environ, **env_updates},
            start_new_session=True,
            pass_fds=(listener.fileno(),),
        )
    return ForkServer(process, folder)


def socket_in(folder: str) -> str:
    """The path a fork server started in ``folder`` listens on."""
    return os.path.join(folder, "fork.sock")
