"""One Ray cluster per test module: started by the first test that needs it, stopped after the last."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _private_ray import private_ray


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A 2-CPU local Ray instance shared by the tests of one module.

    Ray's temp dir is private to the module so that ``ray.init`` cannot find and
    join a cluster someone else started on this machine (``ray start`` leaves its
    address in ``/tmp/ray/ray_current_cluster``).
    """
    with private_ray(num_cpus=2):
        yield


@pytest.fixture(autouse=True)
def _uses_ray(ray_cluster: None) -> None:
    """Every integration test runs against the module's cluster."""
