"""Unit tests run without Ray: starting it is an error, not a slow test."""

from __future__ import annotations

from typing import Any

import pytest
import ray


class RayStartedInUnitTest(AssertionError):
    """A unit test (or the code under test) tried to start or join Ray."""


@pytest.fixture(autouse=True)
def _forbid_ray_init(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RayStartedInUnitTest("unit tests must not call ray.init")

    monkeypatch.setattr(ray, "init", refuse)
    # Loaders built here must not start Ray on a thread of their own (raydl's
    # background_start option); tests of that start set the option themselves.
    monkeypatch.setenv("RAYDL_BACKGROUND_START", "0")
    assert not ray.is_initialized(), "Ray is already running in the unit-test process"
