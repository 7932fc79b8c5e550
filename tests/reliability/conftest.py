"""Shared setup of the reliability tier.

The datasets and Ray Data functions of this tier live in ``_faulty.py``; Ray
worker processes unpickle them by module name, so this folder goes on
``PYTHONPATH`` (inherited by Ray's workers) before any test starts Ray.
Modules that share one Ray instance use the ``ray_cluster`` fixture; the
memory and driver-kill tests start their own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from _private_ray import private_ray
from _probes import wait_until

_HERE = str(Path(__file__).resolve().parent)


def _extend_pythonpath() -> None:
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _HERE not in current:
        os.environ["PYTHONPATH"] = os.pathsep.join([_HERE, *current])


_extend_pythonpath()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A 2-CPU private Ray instance shared by the tests of one module.

    On the way out it also checks that raydl's watcher of the embedded instance
    (``raydl/_internal/runtime/reaper.py``) exits with it.
    """
    with private_ray(num_cpus=2):
        yield
    assert wait_until(lambda: not _watchers(), timeout=10), (_watchers(), _ray_processes())


def _watchers() -> list[int]:
    """This process's live raydl watcher processes."""
    found = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.status() != psutil.STATUS_ZOMBIE and any(
                arg.endswith("reaper.py") for arg in child.cmdline()
            ):
                found.append(child.pid)
    return found


def _ray_processes() -> list[str]:
    """Every live process that runs a program of Ray's package: what a watcher may still follow."""
    ray_dir = os.path.dirname(importlib.util.find_spec("ray").origin or "")
    found = []
    for proc in psutil.process_iter(["pid", "ppid", "cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if ray_dir in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(f"{proc.info['pid']} (parent {proc.info['ppid']}): {cmdline[:200]}")
    return found


@pytest.fixture
def ray_tmpdir() -> Iterator[str]:
    """A fresh, short ``RAY_TMPDIR`` for a Ray started in a subprocess (socket paths <= 107 bytes)."""
    path = tempfile.mkdtemp(prefix="rdl")
    yield path
    shutil.rmtree(path, ignore_errors=True)
