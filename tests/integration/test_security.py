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


#: The client's tries to reach the GCS (Ray's own knob, ``ray_constants.NUM_REDIS_GET_RETRIES``).
FEW_RETRIES = {"RAY_NUM_REDIS_GET_RETRIES": "2"}


def _clients(gcs: str, *extra_envs: dict[str, str]) -> list[str]:
    """What a client printed, per environment (the clients run at once)."""
    procs = []
    for extra_env in extra_envs:
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        child_env["HOME"] = "/nonexistent-raydl-home"  # no ~/.ray/auth_token to fall back on
        child_env.update(extra_env)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", CLIENT, gcs],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=child_env,
            )
        )
    try:
        return [proc.communicate(timeout=90)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(240)
def test_clients_without_the_right_token_are_refused() -> None:
    gcs = ray.get_runtime_context().gcs_address
    token = env.ray_auth_token()
    assert token, "raydl's embedded Ray must run with an auth token"
    no_token, wrong, right = _clients(
        gcs,
        {"RAY_AUTH_MODE": "token"},
        # Ray retries a refused connection once a second, 20 times by default: 2 tries
        # refuse the same, and the reason is asserted below.
        {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * len(token), **FEW_RETRIES},
        {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token},
    )
    assert "CONNECTED" not in no_token, no_token
    assert "CONNECTED" not in wrong and "InvalidAuthToken" in wrong, wrong
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
