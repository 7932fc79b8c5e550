"""Shared pytest setup for raydl's test suite.

Integration tests hand datasets, samplers and ``collate_fn``s defined in test
modules to Ray worker processes. Those objects are pickled by reference (module
name + attribute), so the workers must be able to import the test modules: the
test folders are put on ``PYTHONPATH`` here, before any test starts Ray, and
Ray's worker processes inherit it.
"""

from __future__ import annotations

import os
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
_PATHS = [str(_TESTS / "integration"), str(_TESTS)]


def _extend_pythonpath() -> None:
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([*[p for p in _PATHS if p not in current], *current])


def _no_implicit_ray_init() -> None:
    """A Ray call after ``ray.shutdown()`` raises instead of starting a new Ray.

    Ray's ``ray.get``/``ray.put``/... start a local instance when none is up.
    A background thread of a pipeline that outlived its module's cluster would
    start one in the middle of the next module's setup, and Ray's core worker
    then ends the whole pytest process (exit 1, no summary). Only this process
    is affected: the examples and torchrun trainers the tests start keep Ray's
    default. raydl itself always starts Ray explicitly.
    """
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False


_extend_pythonpath()
_no_implicit_ray_init()
