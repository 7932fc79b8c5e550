"""Shared setup of the reliability tier.

The datasets and Ray Data functions of this tier live in ``_faulty.py``; Ray
worker processes unpickle them by module name, so this folder goes on
``PYTHONPATH`` (inherited by Ray's workers) before any test starts Ray.
Modules that share one Ray instance use the ``ray_cluster`` fixture; the
memory and driver-kill tests start their own.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _private_ray import private_ray

_HERE = str(Path(__file__).resolve().parent)


def _extend_pythonpath() -> None:
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _HERE not in current:
        os.environ["PYTHONPATH"] = os.pathsep.join([_HERE, *current])


_extend_pythonpath()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A 2-CPU private Ray instance shared by the tests of one module."""
    with private_ray(num_cpus=2):
        yield


@pytest.fixture
def ray_tmpdir() -> Iterator[str]:
    """A fresh, short ``RAY_TMPDIR`` for a Ray started in a subprocess (socket paths <= 107 bytes)."""
    path = tempfile.mkdtemp(prefix="rdl")
    yield path
    shutil.rmtree(path, ignore_errors=True)
