"""Seeds as pure functions of (seed, epoch): no hidden global random state.

Every random choice raydl makes for an epoch (the global shuffle, the block
order, the local shuffle buffer) is seeded from :func:`epoch_seed`, so the
same ``seed`` gives the same order on every run, and each epoch differs.
"""

from __future__ import annotations

import numpy as np
import torch

_MAX_SEED = 2**31 - 1  # Ray Data and numpy accept seeds below 2**32; stay well inside.


def epoch_seed(seed: int, epoch: int, stream: int = 0) -> int:
    """A 31-bit seed derived from (``seed``, ``epoch``, ``stream``) with numpy's SeedSequence.

    ``stream`` separates independent uses within one epoch (e.g. the block order
    and the local shuffle buffer).

    Example:
        >>> epoch_seed(0, 1) == epoch_seed(0, 1)
        True
        >>> epoch_seed(0, 1) != epoch_seed(0, 2)
        True
    """
    if seed < 0 or epoch < 0 or stream < 0:
        raise ValueError(
            f"seed, epoch and stream must be non-negative, got seed={seed!r}, "
            f"epoch={epoch!r}, stream={stream!r}"
        )
    state = np.random.SeedSequence([seed, epoch, stream]).generate_state(1, dtype=np.uint32)
    return int(state[0]) & _MAX_SEED


def rank_seed(seed: int | None, rank: int) -> int | None:
    """Rank ``rank``'s variant of a per-epoch seed (each rank's local buffer differs).

    Example:
        >>> rank_seed(10, 0), rank_seed(10, 1), rank_seed(None, 1)
        (10, 11, None)
    """
    return None if seed is None else (seed + rank) % _MAX_SEED


def seed_from_torch(generator: torch.Generator | None) -> int:
    """One non-negative seed drawn from ``generator``, or from torch's global RNG when ``None``.

    This is how a loader without an explicit ``seed`` becomes reproducible
    under ``torch.manual_seed``, as torch's own ``DataLoader`` is.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> seed_from_torch(g) == seed_from_torch(torch.Generator().manual_seed(0))
        True
    """
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()) & _MAX_SEED
