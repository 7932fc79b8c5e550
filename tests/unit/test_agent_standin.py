"""The stand-ins for the raylet's two agents (``runtime/agent_standin.py``), without Ray.

This test process plays the raylet: it runs the stand-in with an agent's command
line, reads the port files it writes, connects where the raylet would, and goes
away (an intermediate parent is killed) to see the stand-in follow. The runtime-env
agent is a small HTTP server that writes its port file as Ray's does. Linux only, as
the raylet's agents are.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raydl._internal.ray_compat import head
from raydl._internal.runtime import agent_standin

pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="Ray's agents are Linux processes here"
    ),
    pytest.mark.timeout(60),
]

NODE_ID = "ab" * 28

#: A runtime-env agent: records that it started, writes its port file, answers each request
#: (keeping the connection open, as HTTP/1.1 does). Like Ray's, it writes its port file
#: after it binds and before it listens.
FAKE_AGENT = """
import http.server, os, sys, time
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if "=" in a)
open(os.path.join(args["session-dir"], "agent-started"), "w").write(str(os.getpid()))
class Answer(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        reply = b"agent " + os.environ["RAY_RAYLET_PID"].encode() + b" got " + body
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)
address = (args["node-ip-address"], int(args["runtime-env-agent-port"]))
server = http.server.HTTPServer(address, Answer, bind_and_activate=False)
server.server_bind()
path = os.path.join(args["session-dir"], "runtime_env_agent_port_" + args["node-id"])
open(path, "w").write(str(server.server_address[1]))
time.sleep(0.5)  # bound, not yet listening: a connection now is refused
server.server_activate()
server.serve_forever()
"""


def _command(session: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-u",
        "agent.py",
        f"--node-id={NODE_ID}",
        f"--session-dir={session}",
        *extra,
    ]


def _standin(role: str, command: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
    script = agent_standin.__file__
    return subprocess.Popen([sys.executable, "-I", "-S", script, role, *command], **kwargs)  # type: ignore[call-overload]


def _port(session: Path, name: str, timeout: float = 10.0) -> int:
    path = session / f"{name}_{NODE_ID}"
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no port file {path.name}"
        time.sleep(0.02)
    return int(path.read_text())


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            return True
        if state in {b"Z", b"X"}:
            return True
        time.sleep(0.05)
    return False


def _post(port: int, *bodies: bytes) -> list[bytes]:
    """Each body POSTed in turn on one kept-alive connection, as the raylet's client does."""
    replies = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        stream = conn.makefile("rb")
        for body in bodies:
            conn.sendall(
                b"POST /get_or_create_runtime_env HTTP/1.1\r\nHost: x\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            length = 0
            while (line := stream.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            replies.append(stream.read(length))
    return replies


def test_the_dashboard_standin_declares_its_ports_unused_and_exits_with_its_raylet(
    tmp_path: Path,
) -> None:
    # A parent that plays the raylet and can be SIGKILLed, as a raylet dies.
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            f"p = subprocess.Popen({[sys.executable, '-I', '-S', agent_standin.__file__, 'dashboard', *_command(tmp_path)]!r})\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if k != "RAY_RAYLET_PID"},
    )
    assert parent.stdout is not None
    standin = int(parent.stdout.readline())
    for name in agent_standin.DASHBOARD_PORTS:
        assert _port(tmp_path, name) == -1  # Ray's minimal agent's "not in use"
    assert not _gone(standin, timeout=1.5)  # it lives as long as its raylet
    parent.kill()
    parent.wait()
    assert _gone(standin), "the stand-in outlived its raylet"


def test_the_runtime_env_standin_starts_the_agent_at_the_first_call_and_relays_to_it(
    tmp_path: Path,
) -> None:
    (tmp_path / "agent.py").write_text(FAKE_AGENT)
    command = _command(tmp_path, "--node-ip-address=127.0.0.1", "--runtime-env-agent-port=0")
    command[2] = str(tmp_path / "agent.py")
    standin = _standin(
        "runtime_env", command, env={**os.environ, "RAY_RAYLET_PID": str(os.getpid())}
    )
    try:
        port = _port(tmp_path, agent_standin.RUNTIME_ENV_PORT)
        time.sleep(0.5)
        assert not (tmp_path / "agent-started").exists()  # nothing asked yet: no agent
        # The first call starts the agent (it waits while the agent binds but does not yet
        # listen); the agent sees the stand-in as its raylet (its parent).
        first = _post(port, b"first", b"again")
        assert first == [f"agent {standin.pid} got {w}".encode() for w in ("first", "again")]
        agent = int((tmp_path / "agent-started").read_text())
        assert _post(port, b"second") == [f"agent {standin.pid} got second".encode()]
        assert int((tmp_path / "agent-started").read_text()) == agent  # one agent
        assert _port(tmp_path, agent_standin.RUNTIME_ENV_PORT) != port  # the agent's own port
    finally:
        standin.kill()  # as the raylet stops its agents: SIGKILL, which it cannot pass on
        standin.wait(10)
    assert _gone(agent), "the agent outlived its stand-in"


def test_an_agent_that_fails_to_start_takes_the_standin_along(tmp_path: Path) -> None:
    (tmp_path / "agent.py").write_text("import sys\nsys.exit(3)\n")
    command = _command(tmp_path, "--node-ip-address=127.0.0.1", "--runtime-env-agent-port=0")
    command[2] = str(tmp_path / "agent.py")
    standin = _standin(
        "runtime_env", command, env={**os.environ, "RAY_RAYLET_PID": str(os.getpid())}
    )
    port = _port(tmp_path, agent_standin.RUNTIME_ENV_PORT)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(b"POST / HTTP/1.1\r\n\r\n")
        # The raylet fate-shares with its agent: the stand-in exits with the agent's status.
        assert standin.wait(30) == 3
        # Closed unanswered (a reset: the request was never read).
        with contextlib.suppress(ConnectionResetError):
            assert conn.recv(1) == b""


def test_the_raylets_command_line_runs_the_standins() -> None:
    script = agent_standin.__file__
    dashboard = "/py -u /ray/dashboard/agent.py --node-id=ab --session-dir=/s"
    rewritten = head.standin_command("--dashboard_agent_command=", dashboard, script)
    assert rewritten == f"--dashboard_agent_command=/py -I -S {script} dashboard {dashboard}"
    dynamic = "/py -u main.py --node-id=ab --runtime-env-agent-port=0"
    assert head.standin_command("--runtime_env_agent_command=", dynamic, script).endswith(
        f"{script} runtime_env {dynamic}"
    )
    # A port the user fixed stays the real agent's.
    fixed = "/py -u main.py --node-id=ab --runtime-env-agent-port=7777"
    assert head.standin_command("--runtime_env_agent_command=", fixed, script) == (
        f"--runtime_env_agent_command={fixed}"
    )
    # The port files the stand-ins write are the ones the check compares with Ray's names.
    assert (
        *agent_standin.DASHBOARD_PORTS,
        agent_standin.RUNTIME_ENV_PORT,
    ) == head._AGENT_PORT_FILES
