"""One Ray cluster per test module: started by the first test that needs it, stopped after the last."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import ray

from raydl._internal.cluster import ensure_ray


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A 2-CPU local Ray instance shared by the tests of one module.

    Ray's temp dir is private to the module so that ``ray.init`` cannot find and
    join a cluster someone else started on this machine (``ray start`` leaves its
    address in ``/tmp/ray/ray_current_cluster``).
    """
    saved = os.environ.get("RAY_TMPDIR")
    with tempfile.TemporaryDirectory(prefix="rdl", ignore_cleanup_errors=True) as tmp:
        os.environ["RAY_TMPDIR"] = tmp
        try:
            ensure_ray(num_cpus=2)
            yield
        finally:
            ray.shutdown()
            if saved is None:
                os.environ.pop("RAY_TMPDIR", None)
            else:
                os.environ["RAY_TMPDIR"] = saved


@pytest.fixture(autouse=True)
def _uses_ray(ray_cluster: None) -> None:
    """Every integration test runs against the module's cluster."""
