"""Stand in for one of the raylet's two Python agents in the embedded Ray instance.

A raylet starts two agents and exits when either does: the dashboard agent
(metrics export, the dashboard's per-node services) and the runtime-env agent
(it builds the environments of tasks and actors that ask for a ``runtime_env``).
Each is a Python process that imports grpc, aiohttp and much of Ray: about 60 and
50 MB of resident memory and 0.5-0.7 s of CPU while the instance starts, on the
cores the trainer and the loader's actors need. A local loader uses neither: an
embedded instance serves no dashboard, and its actors ask for no ``runtime_env``.

The raylet runs this file (standard library only, by path, so it imports neither
raydl nor Ray) in their place, with the agent's own command line after the role:

* ``dashboard``: what Ray's agent does in its minimal mode, without the process:
  it declares its three ports not in use (``-1`` in the session's port files), so
  no process connects to them, and it exits when the raylet does.
* ``runtime_env``: it listens where the agent would and writes the port file the
  raylet reads. Nothing connects while every ``runtime_env`` is empty; the first
  connection (an actor with ``runtime_env``, or a Ray Data operator that sets
  environment variables for its workers) starts the real agent, with the same
  command line, and from then on every connection is relayed to it unchanged.

Either exits when the raylet is gone (its parent changes; the raylet stops its agents
with SIGKILL), and a started agent ends with it (the kernel's parent-death signal). One
whose agent dies or never comes up exits with the agent's status, so the raylet
fate-shares with the agent as it would without the stand-in. Started by
``ray_compat.head.standin_agents``; docs/design/embedded-runtime.md, "Lean".
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

#: Seconds between two checks that the raylet is still this process's parent.
POLL_S = 0.5

#: Seconds the real runtime-env agent gets to write its port file.
AGENT_START_TIMEOUT_S = 60.0

#: Seconds a relayed connection keeps trying to reach the agent (Ray's agent writes its
#: port file after it binds and before it listens, so the first tries may be refused).
AGENT_CONNECT_TIMEOUT_S = 30.0

#: The dashboard agent's ports; ``-1``: not in use (Ray's minimal agent writes the same).
DASHBOARD_PORTS = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port")

#: The runtime-env agent's port file, and the argument that sets its port.
RUNTIME_ENV_PORT = "runtime_env_agent_port"
RUNTIME_ENV_PORT_ARG = "--runtime-env-agent-port="


def _arg(command: list[str], name: str) -> str:
    """The value of ``--name=value`` in ``command``."""
    prefix = f"--{name}="
    for arg in command:
        if arg.startswith(prefix):
            return arg[len(prefix) :]
    raise SystemExit(f"raydl agent stand-in: the agent's command has no {prefix}")


class Session:
    """The session's port files and the raylet this process belongs to."""

    def __init__(self, command: list[str]) -> None:
        """Read the node's identity from the agent's ``command``.

        Args:
            command: The agent's command line, as the raylet was given it.
        """
        self.folder = _arg(command, "session-dir")
        self.node_id = _arg(command, "node-id")
        # The raylet names itself (the agents check their parent against it).
        self.raylet = int(os.environ.get("RAY_RAYLET_PID") or os.getppid())

    def port_path(self, name: str) -> str:
        """The port file ``name`` of this node (the name Ray's ``persist_port`` writes)."""
        return os.path.join(self.folder, f"{name}_{self.node_id}")

    def persist_port(self, name: str, port: int) -> None:
        """Write port file ``name``: whole, or not at all, for the raylet that waits for it."""
        path = self.port_path(name)
        with open(f"{path}.standin", "w") as f:
            f.write(str(port))
        os.replace(f"{path}.standin", path)

    def read_port(self, name: str) -> int | None:
        """The port in file ``name``, ``None`` while it is missing or unreadable."""
        try:
            with open(self.port_path(name)) as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    def raylet_alive(self) -> bool:
        """Whether the raylet is still this process's parent (a dead one's children go to init)."""
        return os.getppid() == self.raylet


def stand_in_for_dashboard(session: Session) -> int:
    """The dashboard agent's stand-in: ports not in use, then wait for the raylet to go.

    Returns:
        The exit status, 0.
    """
    for name in DASHBOARD_PORTS:
        session.persist_port(name, -1)
    while session.raylet_alive():
        time.sleep(POLL_S)
    return 0


def _connect(address: tuple[str, int]) -> socket.socket | None:
    """A connection to the agent at ``address``, retried while refused; ``None`` if it never came."""
    deadline = time.monotonic() + AGENT_CONNECT_TIMEOUT_S
    while True:
        try:
            return socket.create_connection(address, timeout=AGENT_CONNECT_TIMEOUT_S)
        except OSError:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)


def _relay(client: socket.socket, address: tuple[str, int]) -> None:
    """Relay ``client``'s connection to the agent at ``address`` (closed unanswered if unreachable)."""
    upstream = _connect(address)
    if upstream is None:
        client.close()
        return
    upstream.settimeout(None)
    _pump_both(client, upstream)


def _pump_both(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways between ``a`` and ``b`` until both sides are done, then close both."""

    def pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    back = threading.Thread(target=pump, args=(b, a), daemon=True)
    back.start()
    pump(a, b)
    back.join()
    a.close()
    b.close()


class RuntimeEnvStandIn:
    """The runtime-env agent's stand-in: it listens, and starts the agent at the first call."""

    def __init__(self, session: Session, command: list[str]) -> None:
        """Listen where the agent would (the node's address, a free port) and say so.

        Args:
            session: The node's session.
            command: The agent's command line.
        """
        self.session = session
        self.command = command
        host = _arg(command, "node-ip-address")
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        self.listener = socket.socket(family, kind, proto)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(address)
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.agent: subprocess.Popen[bytes] | None = None
        self.agent_address: tuple[str, int] | None = None
        session.persist_port(RUNTIME_ENV_PORT, self.port)

    def start_agent(self) -> None:
        """Start the real agent on a port of its own choosing and wait for its port file.

        It checks its parent against ``RAY_RAYLET_PID``: here that parent is this process.
        The raylet stops its agents with SIGKILL, which this process cannot pass on, so
        the kernel does (``PR_SET_PDEATHSIG``): the agent ends when this process does.
        """
        command = [
            f"{RUNTIME_ENV_PORT_ARG}0" if arg.startswith(RUNTIME_ENV_PORT_ARG) else arg
            for arg in self.command
        ]
        self.agent = subprocess.Popen(
            command,
            env={**os.environ, "RAY_RAYLET_PID": str(os.getpid())},
            preexec_fn=_die_with_parent,  # started on the main thread, before any relay
        )
        deadline = time.monotonic() + AGENT_START_TIMEOUT_S
        while time.monotonic() < deadline and self.session.raylet_alive():
            port = self.session.read_port(RUNTIME_ENV_PORT)
            if port is not None and port != self.port:
                self.agent_address = (self.listener.getsockname()[0], port)
                return
            if self.agent.poll() is not None:
                raise SystemExit(self.agent.returncode or 1)
            time.sleep(0.02)
        if not self.session.raylet_alive():
            raise SystemExit(0)
        raise SystemExit(
            f"raydl agent stand-in: the runtime-env agent wrote no port in {AGENT_START_TIMEOUT_S:.0f} s"
        )

    def serve(self) -> int:
        """Relay each connection to the agent (started at the first) while the raylet lives.

        Returns:
            The exit status: 0 once the raylet is gone, else the agent's own.
        """
        while self.session.raylet_alive():
            if self.agent is not None and self.agent.poll() is not None:
                return self.agent.returncode or 1
            readable, _, _ = select.select([self.listener], [], [], POLL_S)
            if not readable:
                continue
            client, _ = self.listener.accept()
            if self.agent is None:
                self.start_agent()
            assert self.agent_address is not None
            threading.Thread(target=_relay, args=(client, self.agent_address), daemon=True).start()
        return 0

    def stop_agent(self) -> None:
        """Stop the real agent, if it was started (SIGTERM, then SIGKILL after 5 s)."""
        if self.agent is None or self.agent.poll() is not None:
            return
        self.agent.terminate()
        try:
            self.agent.wait(5)
        except subprocess.TimeoutExpired:
            self.agent.kill()


def _die_with_parent() -> None:
    """In a child about to run its program: have the kernel SIGKILL it when its parent dies."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def main(argv: list[str]) -> int:
    """``agent_standin.py {dashboard,runtime_env} <the agent's command line...>``."""
    role, command = argv[0], argv[1:]
    session = Session(command)
    if role == "dashboard":
        return stand_in_for_dashboard(session)
    if role != "runtime_env":
        raise SystemExit(f"raydl agent stand-in: unknown role {role!r}")
    standin = RuntimeEnvStandIn(session, command)
    # A SIGTERM (``ray.shutdown``'s clean-up, a user's kill) takes a started agent along; the
    # raylet's own SIGKILL cannot be caught, and the agent's parent-death signal covers it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        return standin.serve()
    finally:
        standin.stop_agent()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
