"""Shared setup of the framework tier: one Ray cluster the trainers join.

Each launch of a trainer would otherwise start (and stop) an embedded Ray on
rank 0; the trainers join this session's cluster instead (``RAY_ADDRESS`` and
its token, as jobs join a long-lived cluster), so a launch costs a connection.
Trainers that load in process (``num_workers=0``) never touch it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from _launch import base_env
from _private_ray import private_ray

from raydl._internal.runtime import env as raydl_env

# The trainers' dataset (_ids.py) is pickled by name: the tier's Ray workers import it.
_HERE = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_HERE, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _HERE]]
)


@pytest.fixture(scope="session")
def cluster_env() -> Iterator[dict[str, str]]:
    """A 2-CPU Ray cluster for the tier, and the environment that joins it with its token."""
    with private_ray(num_cpus=2):
        environ = base_env()
        environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        environ["RAY_AUTH_TOKEN"] = raydl_env.ray_auth_token() or ""
        yield environ
