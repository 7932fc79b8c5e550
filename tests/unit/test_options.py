"""LoaderOptions: raydl's own options, validated once in __post_init__."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from raydl import LoaderOptions

pytestmark = pytest.mark.timeout(30)


def test_defaults() -> None:
    options = LoaderOptions()
    assert options.seed is None
    assert options.shuffle_mode == "global"
    assert options.local_shuffle_buffer_size is None
    assert options.deterministic is True
    assert options.ray_address is None
    assert dict(options.worker_options) == {}


def test_defaults_are_not_shared_between_instances() -> None:
    assert LoaderOptions().worker_options is not LoaderOptions().worker_options


def test_valid_values_are_kept() -> None:
    options = LoaderOptions(
        seed=0,
        shuffle_mode="blocks",
        local_shuffle_buffer_size=1,
        deterministic=False,
        ray_address="127.0.0.1:6379",
        worker_options={"num_cpus": 1},
    )
    assert options.seed == 0
    assert options.shuffle_mode == "blocks"
    assert options.local_shuffle_buffer_size == 1
    assert options.worker_options == {"num_cpus": 1}


def test_is_frozen() -> None:
    options = LoaderOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.seed = 3  # type: ignore[misc]


@pytest.mark.parametrize("seed", [1.5, "3", True])
def test_seed_of_wrong_type(seed: Any) -> None:
    with pytest.raises(
        TypeError, match=re.escape(f"seed option should be an int or None, got {seed!r}")
    ):
        LoaderOptions(seed=seed)


def test_negative_seed() -> None:
    with pytest.raises(ValueError, match=re.escape("seed option should be non-negative, got -1")):
        LoaderOptions(seed=-1)


@pytest.mark.parametrize("mode", ["local", "", "GLOBAL", None])
def test_bad_shuffle_mode(mode: Any) -> None:
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"shuffle_mode option should be one of ('global', 'blocks', 'files'), got {mode!r}"
        ),
    ):
        LoaderOptions(shuffle_mode=mode)


@pytest.mark.parametrize("size", [0, -5, 2.0])
def test_bad_local_shuffle_buffer_size(size: Any) -> None:
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"local_shuffle_buffer_size option should be a positive int or None, got {size!r}"
        ),
    ):
        LoaderOptions(local_shuffle_buffer_size=size)


@pytest.mark.parametrize("worker_options", [["num_cpus", 1], "num_cpus=1", 1])
def test_bad_worker_options(worker_options: Any) -> None:
    with pytest.raises(
        TypeError,
        match=re.escape(
            "worker_options option should be a mapping of Ray actor options, "
            f"got {type(worker_options).__name__}"
        ),
    ):
        LoaderOptions(worker_options=worker_options)
