"""Every environment variable raydl reads, read in this one place."""

from __future__ import annotations

import os
import sys

#: Address of an existing Ray cluster to join (Ray's own variable).
RAY_ADDRESS = "RAY_ADDRESS"
#: Ray's authentication mode; raydl sets it to ``token`` unless the user chose otherwise.
RAY_AUTH_MODE = "RAY_AUTH_MODE"
#: Ray's token sources, in Ray's order of precedence (the token file defaults to ~/.ray/auth_token).
RAY_AUTH_TOKEN = "RAY_AUTH_TOKEN"
RAY_AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"


def ray_address() -> str | None:
    """The cluster address from ``RAY_ADDRESS``, or ``None`` when unset or empty."""
    return os.environ.get(RAY_ADDRESS) or None


def ensure_token_auth_mode() -> bool:
    """Turn on Ray token authentication for this process unless the user set a mode.

    Returns:
        Whether token authentication is on after the call.
    """
    mode = os.environ.setdefault(RAY_AUTH_MODE, "token")
    return mode.lower() == "token"


#: ``0`` turns the loader's background start off by default (the ``background_start`` option).
BACKGROUND_START = "RAYDL_BACKGROUND_START"


def background_start_default() -> bool:
    """The ``background_start`` option when the loader is not given one: on unless ``RAYDL_BACKGROUND_START=0``."""
    return _on_unless_off(BACKGROUND_START)


#: ``0`` starts the embedded Ray with its autoscaler monitor and dashboard head (off by default).
LEAN_RAY = "RAYDL_LEAN_RAY"


def lean_ray() -> bool:
    """Whether the embedded Ray instance skips the processes a loader does not use (``RAYDL_LEAN_RAY``)."""
    return _on_unless_off(LEAN_RAY)


#: ``0`` starts each of the embedded Ray's workers as a fresh interpreter, as Ray does; by
#: default (on Linux) they are forked from one process that imported what the loaders'
#: actors import, once (``runtime/fork_server.py``).
FORK_WORKERS = "RAYDL_FORK_WORKERS"


def fork_workers() -> bool:
    """Whether the embedded Ray instance forks its workers from raydl's fork server (on Linux,
    unless ``RAYDL_FORK_WORKERS=0``)."""
    return _on_unless_off(FORK_WORKERS) and sys.platform == "linux"


#: ``0`` leaves glibc's ``malloc`` thresholds as they are in raydl's actors (``workers/allocator.py``).
KEEP_FREED_MEMORY = "RAYDL_KEEP_FREED_MEMORY"


def keep_freed_memory() -> bool:
    """Whether raydl's actors keep freed memory for their next batch (``RAYDL_KEEP_FREED_MEMORY``)."""
    return _on_unless_off(KEEP_FREED_MEMORY)


def _on_unless_off(name: str) -> bool:
    """A switch that is on unless the variable ``name`` says ``0``, ``false``, ``no`` or ``off``."""
    return os.environ.get(name, "1").strip().lower() not in {"0", "false", "no", "off"}


#: CPUs ``num_workers="auto"`` may use for its actors (the ``cpu_budget`` option's default).
CPU_BUDGET = "RAYDL_CPU_BUDGET"


def cpu_budget_default() -> float | None:
    """``RAYDL_CPU_BUDGET`` as a positive number, ``None`` when unset or empty.

    Raises:
        ValueError: It is set to something else (the message names the variable).
    """
    raw = os.environ.get(CPU_BUDGET, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(
            f"{CPU_BUDGET} should be a positive number of CPUs, got {CPU_BUDGET}={raw!r}; "
            "unset it for the default (the cluster's CPUs less one per rank, shared by the ranks)"
        )
    return value


#: Variables torchrun sets for each rank; Ray processes started by a rank must not inherit them.
TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)

#: How long a rank that joined rank 0's Ray cluster waits for it to come back (Ray's default: 60 s).
JOINER_RECONNECT_TIMEOUT = "RAY_gcs_rpc_server_reconnect_timeout_s"


def torchrun_world() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` from torchrun's variables, or ``None`` outside torchrun."""
    # Empty in Ray's worker processes started by a rank (cluster.py blanks them there).
    if not os.environ.get("RANK") or not os.environ.get("WORLD_SIZE"):
        return None
    return (
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        int(os.environ.get("LOCAL_RANK") or 0),
    )


def torchrun_store() -> tuple[str, int, str] | None:
    """``(host, port, key prefix)`` of torchrun's agent store, or ``None`` without one.

    torchrun's agent hosts a key-value store at ``MASTER_ADDR:MASTER_PORT`` for the
    whole run (``TORCHELASTIC_USE_AGENT_STORE``); the prefix names this run and
    restart, so a restarted job never reads a value of the previous attempt.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    run = os.environ.get("TORCHELASTIC_RUN_ID") or "none"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    return host, int(port), f"raydl/{run}/{restart}/"


def ray_auth_token() -> str | None:
    """The token this process authenticates to Ray with, from Ray's sources in Ray's order."""
    token = os.environ.get(RAY_AUTH_TOKEN)
    if token:
        return token
    path = os.environ.get(RAY_AUTH_TOKEN_PATH) or os.path.expanduser("~/.ray/auth_token")
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None
