"""A private embedded Ray for one test module (shared by the integration and S3 tiers)."""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import threading
import time
from collections.abc import Iterator

import ray

from raydl._internal.epochs.overlap import discard_all as discard_early_epochs
from raydl._internal.runtime.cluster import ensure_ray


@contextlib.contextmanager
def private_ray(num_cpus: int = 2) -> Iterator[None]:
    """raydl's embedded Ray with its own temp dir, shut down on exit.

    The private ``RAY_TMPDIR`` keeps ``ray.init`` from finding, and joining, a
    cluster someone else started on this machine (``ray start`` leaves its
    address in ``/tmp/ray/ray_current_cluster``).
    """
    saved = os.environ.get("RAY_TMPDIR")
    with tempfile.TemporaryDirectory(prefix="rdl", ignore_cleanup_errors=True) as tmp:
        os.environ["RAY_TMPDIR"] = tmp
        try:
            ensure_ray(num_cpus=num_cpus)
            yield
        finally:
            gc.collect()  # loaders the tests dropped close their pipelines while Ray is up
            discard_early_epochs()
            lingering = _ray_data_executors(wait_s=20.0)
            ray.shutdown()
            if saved is None:
                os.environ.pop("RAY_TMPDIR", None)
            else:
                os.environ["RAY_TMPDIR"] = saved
    # After the cluster is gone: a pipeline still running at the end of a
    # module is a leak (a loader left open, or a close() that did not stop Ray
    # Data's executor); its thread would call a Ray that no longer exists.
    assert not lingering, f"Ray Data executions still running at the end of the module: {lingering}"


def _ray_data_executors(wait_s: float) -> list[str]:
    """Names of Ray Data executor threads still alive after up to ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = [t.name for t in threading.enumerate() if t.name.startswith("StreamingExecutor")]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)
