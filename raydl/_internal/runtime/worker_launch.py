"""Start one Ray worker process, forked by raydl's fork server when it can be.

The embedded instance's raylet runs this file where Ray runs its own
``setup_worker.py`` (``python worker_launch.py [-S] [-s] default_worker.py ARGS``,
with ``--serialized-runtime-env-context`` and ``--language`` among ARGS). When the
worker needs nothing a fork cannot give (a Python worker whose ``runtime_env``
context is empty: no environment variables, command prefix, other interpreter or
entry point) and the fork server named by ``RAYDL_FORK_SERVER`` takes the request,
this process asks it for the worker (:mod:`.fork_server`), passing its arguments,
environment, working folder and standard streams, then becomes a shell that waits
for the worker and exits with its status (:func:`ask`). Otherwise it execs
Ray's ``setup_worker.py`` (``RAYDL_RAY_SETUP_WORKER``) with its own arguments, as
the raylet would have.

The raylet knows the forked worker by the process id the worker registers with
(it signals and kills that process); this launcher is what the raylet started,
and if the raylet kills it before the worker registered, the fork server kills
the worker. Standard library only, run by path.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any

#: The fork server's socket, in the environment the raylet gives its workers.
SERVER_VAR = "RAYDL_FORK_SERVER"
#: Ray's own ``setup_worker.py``, the path taken when no fork serves.
RAY_SETUP_VAR = "RAYDL_RAY_SETUP_WORKER"

#: The shell the launcher becomes once its worker runs, and what it runs: wait for the
#: worker's exit status on descriptor 3 (the server's connection) and exit with it; 1 if
#: the server went away first.
SHELL = "/bin/sh"
WAIT = 'read -r code <&3 && exit "$code"; exit 1'

_CONTEXT = "--serialized-runtime-env-context"
_LANGUAGE = "--language"
_SITE_FLAGS = ("-S", "-s")


def parse(args: list[str]) -> tuple[dict[str, Any], str, list[str], list[str]]:
    """Split the raylet's arguments as Ray's ``setup_worker.py`` does.

    Returns:
        The runtime-env context, the language, the site flags, and the worker's own
        command line (``default_worker.py`` and its arguments).

    Example:
        >>> parse(["-S", "w.py", "--x=1", "--language=PYTHON", "--serialized-runtime-env-context={}"])
        ({}, 'PYTHON', ['-S'], ['w.py', '--x=1'])
    """
    context, language = "{}", ""
    site: list[str] = []
    rest: list[str] = []
    items = iter(args)
    for arg in items:
        name, eq, value = arg.partition("=")
        if name in (_CONTEXT, _LANGUAGE):
            value = value if eq else next(items, "")
            if name == _CONTEXT:
                context = value or "{}"
            else:
                language = value
        elif arg in _SITE_FLAGS and not rest:
            site.append(arg)
        else:
            rest.append(arg)
    return json.loads(context), language, site, rest


def forkable(context: dict[str, Any], language: str) -> bool:
    """Whether a worker with this runtime-env context can be a fork of the server."""
    return (
        language == "PYTHON"
        and not context.get("command_prefix")
        and not context.get("env_vars")
        and context.get("py_executable") in (None, sys.executable)
        and not context.get("override_worker_entrypoint")
    )


def ask(path: str, site: list[str], argv: list[str]) -> None:
    """Have the server at ``path`` fork the worker, then wait for it as a shell.

    Returns only if the server did not take the request. Once it did, this process
    execs ``sh`` (:data:`WAIT`), which holds the connection (descriptor 3) and exits
    with the worker's status when the server sends it: about 1 MB where this
    interpreter holds 8. A signal that ends the shell closes the connection, and the
    server kills the worker.
    """
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        request = {
            "argv": argv,
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "executable": sys.executable,
            "flags": site,
        }
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        answer = json.loads(_line(conn) or b"{}")
    except (OSError, ValueError):
        return
    if not isinstance(answer.get("pid"), int):
        return
    if conn.fileno() != 3:
        os.dup2(conn.fileno(), 3)
    os.set_inheritable(3, True)  # the shell reads the worker's status there
    os.execv(SHELL, ["sh", "-c", WAIT])


def _line(conn: socket.socket) -> bytes:
    """One line from ``conn``, read a byte at a time (nothing after it is consumed)."""
    line = b""
    while not line.endswith(b"\n"):
        byte = conn.recv(1)
        if not byte:
            break
        line += byte
    return line


def main(args: list[str]) -> None:
    """Start the worker for the raylet's ``args``: forked if it can be, else Ray's way."""
    context, language, site, argv = parse(args)
    server = os.environ.get(SERVER_VAR)
    if server and argv and forkable(context, language):
        ask(server, site, argv)  # returns only if the server did not take it
    setup = os.environ[RAY_SETUP_VAR]
    os.execv(sys.executable, [sys.executable, setup, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
