"""Starting or joining the Ray cluster that runs the loader's work.

By default raydl starts an embedded single-node Ray instance the first time a
loader needs it: quietly (Ray's logs go to its session directory, not the
user's terminal), without the dashboard, and with Ray token authentication on.
When ``RAY_ADDRESS`` or the loader's ``ray_address`` names a cluster, raydl
joins it instead. If the user already called ``ray.init``, raydl uses that.

Under torchrun (several ranks, no cluster given) rank 0 starts the embedded
instance and sends its address and auth token to the other ranks over the
process group; they join it, so one cluster serves every rank. The embedded
instance is started without torchrun's variables in its environment, so Ray
worker processes do not believe they are rank 0. Joiners give up on a vanished
rank-0 cluster after a few seconds instead of Ray's 60.

If the process that started the embedded instance is killed, a small watcher
process (:mod:`raydl._internal.runtime.reaper`) stops the instance's processes that
would otherwise linger for a minute.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator

from raydl._internal.runtime import env, reaper
from raydl._internal.runtime.world import Channel, World
from raydl.errors import RayDLError

#: Seconds a joining rank waits for rank 0's cluster to come back before giving up.
JOINER_RECONNECT_TIMEOUT_S = 5

_lock = threading.Lock()
_started_by_raydl = False


def is_connected() -> bool:
    """Whether this process is connected to Ray now (cleanup must not auto-start a new one)."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def ensure_ray(
    address: str | None = None, *, num_cpus: int | None = None, world: World | None = None
) -> None:
    """Make sure this process is connected to a Ray cluster.

    Args:
        address: Cluster to join; falls back to ``RAY_ADDRESS``; ``None`` starts an
            embedded local instance (on rank 0 only, when ``world`` has several ranks).
        num_cpus: CPUs the embedded instance may use (all when ``None``). Ignored
            when joining an existing cluster.
        world: This process's ranks. With several ranks and no address this is a
            collective call: every rank must make it.
    """
    address = address or env.ray_address()
    if world is not None and world.is_distributed and not address:
        _ensure_shared_cluster(world, num_cpus)
        return
    _ensure_ray(address, num_cpus)


def _ensure_shared_cluster(world: World, num_cpus: int | None) -> None:
    channel = Channel.get(world)
    if world.rank == 0:
        _ensure_ray(None, num_cpus)
        import ray

        handshake = (ray.get_runtime_context().gcs_address, env.ray_auth_token())
    else:
        handshake = None
    gcs_address, token = channel.broadcast(handshake)
    if world.rank != 0:
        import ray

        if ray.is_initialized():
            mine = ray.get_runtime_context().gcs_address
            if mine != gcs_address:
                raise RayDLError(
                    f"rank {world.rank} is connected to the Ray cluster at {mine}, but rank 0 "
                    f"runs the job's cluster at {gcs_address}. Something on this rank started "
                    "Ray before raydl could join rank 0's cluster (ray.data calls such as "
                    "from_numpy start one implicitly). Call raydl.init() on every rank before "
                    "creating Ray datasets, or set RAY_ADDRESS to one cluster for all ranks."
                )
            return
        if token:
            os.environ[env.RAY_AUTH_TOKEN] = token
        os.environ.setdefault(env.JOINER_RECONNECT_TIMEOUT, str(JOINER_RECONNECT_TIMEOUT_S))
        _ensure_ray(gcs_address, None)


@contextlib.contextmanager
def _without_torchrun_env() -> Iterator[None]:
    saved = {name: os.environ.pop(name) for name in env.TORCHRUN_VARS if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _ensure_ray(address: str | None, num_cpus: int | None) -> None:
    global _started_by_raydl
    with _lock:
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            return
        token_auth = env.ensure_token_auth_mode()
        import ray

        if token_auth:
            # Ray caches its config when it is imported; re-read it so that a
            # RAY_AUTH_MODE set just now (after an earlier `import ray`) applies.
            from raydl._internal.ray_compat import cluster as ray_core

            ray_core.reload_config()
        common = {
            "logging_level": logging.WARNING,
            "log_to_driver": True,
            "ignore_reinit_error": True,
        }
        if address:
            ray.init(address=address, **common)  # type: ignore[arg-type]
        else:
            before = reaper.ray_children(os.getpid())
            with _without_torchrun_env():
                ray.init(
                    address="local",  # a new instance, never another process's cluster
                    num_cpus=num_cpus,
                    include_dashboard=False,
                    dashboard_host="127.0.0.1",  # should any dashboard server start anyway
                    **common,  # type: ignore[arg-type]
                )
            _started_by_raydl = True
            # Should this process be SIGKILLed, no Ray process of the instance outlives it long.
            reaper.start(os.getpid(), reaper.ray_children(os.getpid()) - before)
        _quiet_ray_data()


def _quiet_ray_data() -> None:
    """Keep Ray Data's progress bars and per-execution banners off the user's terminal."""
    from ray.data import DataContext

    from raydl._internal.ray_compat import cluster as ray_core

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    # Ray Data warns once that progress bars are off; that is raydl's choice, not news.
    logging.getLogger(ray_core.PROGRESS_LOGGER).setLevel(logging.ERROR)


def cpus() -> int:
    """The CPUs of the cluster this process is connected to (at least 1)."""
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def shutdown() -> None:
    """Stop the embedded Ray instance if raydl started it; leave user-managed clusters alone."""
    global _started_by_raydl
    with _lock:
        if _started_by_raydl:
            import ray

            ray.shutdown()
            _started_by_raydl = False
