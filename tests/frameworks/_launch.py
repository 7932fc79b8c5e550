"""Helpers of the framework tier's tests: the launch environment, a free port, the extra check."""

from __future__ import annotations

import importlib.util
import os
import socket

import pytest


def require(package: str) -> None:
    """Fail (never skip) when a framework of the ``test`` extra is not installed."""
    if importlib.util.find_spec(package) is None:
        pytest.fail(
            f"{package} is not installed, but the framework tests need it; it is in raydl's "
            "test extra: pip install -e '.[test]'",
            pytrace=False,
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def distributed_share(n: int, rank: int, epoch: int, *, shuffle: bool = True) -> list[int]:
    """Rank ``rank`` of 2's indices in ``epoch`` under ``DistributedSampler(seed=0)``."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(n), num_replicas=2, rank=rank, shuffle=shuffle, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def sampler_epoch_of(ids: list[int], n: int, rank: int, tries: int = 8) -> int | None:
    """The ``DistributedSampler`` epoch whose share of ``rank`` starts with ``ids``, if any."""
    for epoch in range(tries):
        if distributed_share(n, rank, epoch)[: len(ids)] == ids:
            return epoch
    return None


def assert_one_epoch(per_rank: list[list[int]], n: int) -> None:
    """Both ranks got half of ``range(n)`` each: together every sample, once."""
    assert len(per_rank[0]) == len(per_rank[1]) == n // 2, [len(ids) for ids in per_rank]
    assert sorted(per_rank[0] + per_rank[1]) == list(range(n)), "a sample missing or repeated"
