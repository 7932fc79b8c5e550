"""Last-mile work that imports no torch, as a user's feature module would.

The lean-actor tests pickle this module by value (as a training script's
``__main__`` travels), so the actors that run it import only what it names.
"""

from __future__ import annotations

import sys

import numpy as np


def parse_and_report(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Files holding their id as text -> ``id``, and whether this process imported torch, Ray Data."""
    from raydl._internal.runtime.fork_server import shared_by_parent

    ids = np.array([int(b) for b in batch["bytes"]], dtype=np.int64)
    shared = shared_by_parent()  # a forked actor's imports from the fork server cost it nothing
    return {
        "id": ids,
        "torch_loaded": np.full(len(ids), "torch" in sys.modules and "torch" not in shared),
        "ray_data_loaded": np.full(len(ids), "ray.data" in sys.modules),
    }


def fails_on_seven(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Like :func:`parse_and_report`, raising a ``KeyError`` for the file holding 7."""
    out = parse_and_report(batch)
    if 7 in out["id"]:
        raise KeyError("file seven")
    return out
