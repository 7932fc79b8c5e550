"""The embedded Ray instance keeps token authentication on and its dashboard off.

Ray 2.60's core servers listen on all interfaces whatever the node IP says, so
the token is what keeps other clients out: checked here with real clients in
subprocesses (no token, a wrong token, the right token).
"""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
import ray

from raydl._internal.runtime import env

CLIENT = """
import ray, sys
try:
    ray.init(address=sys.argv[1], logging_level="ERROR")
    print("CONNECTED", ray.cluster_resources().get("CPU"))
except Exception as err:
    print("REFUSED", type(err).__name__, err)
"""


def _client(gcs: str, **extra_env: str) -> str:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    child_env["HOME"] = "/nonexistent-raydl-home"  # no ~/.ray/auth_token to fall back on
    child_env.update(extra_env)
    proc = subprocess.run(
        [sys.executable, "-c", CLIENT, gcs],
        capture_output=True,
        text=True,
        timeout=90,
        env=child_env,
    )
    return proc.stdout + proc.stderr


@pytest.mark.timeout(240)
def test_clients_without_the_right_token_are_refused() -> None:
    gcs = ray.get_runtime_context().gcs_address
    token = env.ray_auth_token()
    assert token, "raydl's embedded Ray must run with an auth token"

    no_token = _client(gcs, RAY_AUTH_MODE="token")
    assert "CONNECTED" not in no_token, no_token
    wrong = _client(gcs, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * len(token))
    assert "CONNECTED" not in wrong, wrong
    right = _client(gcs, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    assert "CONNECTED" in right, right  # the check above can fail: the token is what matters


def test_dashboard_serves_nothing() -> None:
    # Ray keeps the processes it started for this node in node.all_processes (private
    # API, read-only here). Ray 2.60 runs a "dashboard" process for internal modules
    # even with include_dashboard=False; it must not listen on any port.
    node = ray._private.worker.global_worker.node
    assert "raylet" in node.all_processes  # we are looking at the right node
    for info in node.all_processes.get("dashboard", []):
        listening = [
            c.laddr
            for c in psutil.Process(info.process.pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN
        ]
        assert listening == [], listening
    assert os.environ.get(env.RAY_AUTH_MODE) == "token"
