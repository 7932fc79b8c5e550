"""raydl._internal.epochs.shuffle: seeds are pure functions of (seed, epoch, stream)."""

from __future__ import annotations

import pytest
import torch

from raydl._internal.epochs.shuffle import epoch_seed, seed_from_torch

pytestmark = pytest.mark.timeout(30)


def test_epoch_seed_is_pure() -> None:
    assert epoch_seed(7, 3) == epoch_seed(7, 3)
    assert epoch_seed(7, 3, 2) == epoch_seed(7, 3, 2)


def test_epoch_seed_default_stream_is_zero() -> None:
    assert epoch_seed(7, 3) == epoch_seed(7, 3, 0)


def test_epoch_seed_differs_per_epoch() -> None:
    seeds = {epoch_seed(0, epoch) for epoch in range(100)}
    assert len(seeds) == 100


def test_epoch_seed_differs_per_stream() -> None:
    seeds = {epoch_seed(0, 1, stream) for stream in range(20)}
    assert len(seeds) == 20


def test_epoch_seed_differs_per_base_seed() -> None:
    seeds = {epoch_seed(seed, 0) for seed in range(100)}
    assert len(seeds) == 100


def test_epoch_seed_does_not_confuse_arguments() -> None:
    # (seed, epoch) must not be symmetric or additive: seed + epoch collisions
    # would give two epochs of neighbouring seeds the same order.
    assert epoch_seed(1, 2) != epoch_seed(2, 1)
    assert epoch_seed(1, 2) != epoch_seed(0, 3)
    assert epoch_seed(0, 1, 2) != epoch_seed(0, 2, 1)


@pytest.mark.parametrize("args", [(0, 0), (2**40, 5), (123, 2**33, 7)])
def test_epoch_seed_is_a_31_bit_non_negative_int(args: tuple[int, ...]) -> None:
    seed = epoch_seed(*args)
    assert type(seed) is int
    assert 0 <= seed < 2**31


def test_epoch_seed_does_not_touch_global_rngs() -> None:
    import random

    import numpy as np

    torch_state = torch.get_rng_state()
    np_state = np.random.get_state()[1].copy()
    py_state = random.getstate()
    epoch_seed(3, 4, 5)
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert (np.random.get_state()[1] == np_state).all()
    assert random.getstate() == py_state


@pytest.mark.parametrize(("seed", "epoch", "stream"), [(-1, 0, 0), (0, -1, 0), (0, 0, -1)])
def test_epoch_seed_rejects_negative_values(seed: int, epoch: int, stream: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"seed, epoch and stream must be non-negative, got seed={seed}, "
        rf"epoch={epoch}, stream={stream}",
    ):
        epoch_seed(seed, epoch, stream)


def test_seed_from_torch_repeats_for_the_same_generator_seed() -> None:
    a = seed_from_torch(torch.Generator().manual_seed(42))
    b = seed_from_torch(torch.Generator().manual_seed(42))
    c = seed_from_torch(torch.Generator().manual_seed(43))
    assert a == b
    assert a != c


def test_seed_from_torch_draws_from_the_generator() -> None:
    generator = torch.Generator().manual_seed(0)
    first = seed_from_torch(generator)
    second = seed_from_torch(generator)
    assert first != second


def test_seed_from_torch_matches_torchs_own_draw() -> None:
    # The same single int64 draw torch's DataLoader makes for its worker base seed.
    expected = int(
        torch.empty((), dtype=torch.int64)
        .random_(generator=torch.Generator().manual_seed(5))
        .item()
    )
    assert seed_from_torch(torch.Generator().manual_seed(5)) == expected & (2**31 - 1)


def test_seed_from_torch_none_uses_global_rng() -> None:
    torch.manual_seed(123)
    a = seed_from_torch(None)
    torch.manual_seed(123)
    b = seed_from_torch(None)
    torch.manual_seed(124)
    c = seed_from_torch(None)
    assert a == b
    assert a != c


@pytest.mark.parametrize("seed", range(20))
def test_seed_from_torch_is_non_negative_31_bit(seed: int) -> None:
    value = seed_from_torch(torch.Generator().manual_seed(seed))
    assert 0 <= value < 2**31
