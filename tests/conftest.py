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


_extend_pythonpath()
