"""Starting or joining the Ray cluster that runs the loader's work.

By default raydl starts an embedded single-node Ray instance the first time a
loader needs it: quietly (Ray's logs go to its session directory, not the
user's terminal), without the dashboard, and with Ray token authentication on.
When ``RAY_ADDRESS`` or the loader's ``ray_address`` names a cluster, raydl
joins it instead. If the user already called ``ray.init``, raydl uses that.
"""

from __future__ import annotations

import logging
import sys
import threading

from raydl._internal import env

_lock = threading.Lock()
_started_by_raydl = False


def started_by_raydl() -> bool:
    """Whether the Ray instance in this process was started by raydl (and is raydl's to stop)."""
    return _started_by_raydl


def ensure_ray(address: str | None = None, *, num_cpus: int | None = None) -> None:
    """Make sure this process is connected to a Ray cluster.

    Args:
        address: Cluster to join; falls back to ``RAY_ADDRESS``; ``None`` starts an
            embedded local instance.
        num_cpus: CPUs the embedded instance may use (all when ``None``). Ignored
            when joining an existing cluster.
    """
    global _started_by_raydl
    with _lock:
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            return
        token_auth = env.ensure_token_auth_mode()
        import ray

        if token_auth:
            # Ray caches its config when it is imported; re-read it so that a
            # RAY_AUTH_MODE set just now (after an earlier `import ray`) applies.
            from ray._raylet import Config  # type: ignore[attr-defined]

            Config.initialize("")
        address = address or env.ray_address()
        common = {
            "logging_level": logging.WARNING,
            "log_to_driver": True,
            "ignore_reinit_error": True,
        }
        if address:
            ray.init(address=address, **common)  # type: ignore[arg-type]
        else:
            ray.init(
                num_cpus=num_cpus,
                include_dashboard=False,
                **common,  # type: ignore[arg-type]
            )
            _started_by_raydl = True
        _quiet_ray_data()


def _quiet_ray_data() -> None:
    """Keep Ray Data's progress bars and per-execution banners off the user's terminal."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    # Ray Data warns once that progress bars are off; that is raydl's choice, not news.
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)


def shutdown() -> None:
    """Stop the embedded Ray instance if raydl started it; leave user-managed clusters alone."""
    global _started_by_raydl
    with _lock:
        if _started_by_raydl:
            import ray

            ray.shutdown()
            _started_by_raydl = False
