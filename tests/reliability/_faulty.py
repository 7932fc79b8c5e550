"""Datasets and Ray Data functions that misbehave on purpose (crash, raise, stall).

They live in an importable module (on ``PYTHONPATH``, see ``conftest.py``)
because Ray worker processes unpickle them by module name. A fault that must
happen once (the first attempt only) claims a marker file with ``O_EXCL``: the
retry, in a fresh process, finds the file and goes on.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


def claim(marker: str | Path) -> bool:
    """Create ``marker``; ``True`` only for the first caller, in any process."""
    try:
        fd = os.open(str(marker), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


# ------------------------------------------------------------------ Ray Data functions


class KillOnce:
    """``map_batches`` function: SIGKILLs its own process the first time it sees row ``victim``."""

    def __init__(self, victim: int, marker: str) -> None:
        self.victim = victim
        self.marker = marker

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.victim in batch["id"] and claim(self.marker):
            os.kill(os.getpid(), signal.SIGKILL)
        return batch


def reject_row_57(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``map_batches`` function: a user error on row 57."""
    if 57 in batch["id"]:
        raise ValueError("row 57 is corrupt")
    return batch


class StallOnRow:
    """``map_batches`` function: hangs on row ``row`` until ``release`` exists (at most 300 s)."""

    def __init__(self, row: int, release: str) -> None:
        self.row = row
        self.release = release

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.row in batch["id"]:
            deadline = time.monotonic() + 300
            while not os.path.exists(self.release) and time.monotonic() < deadline:
                time.sleep(0.1)
        return batch


# ------------------------------------------------------------------ torch datasets


class PidData(Dataset[dict[str, Any]]):
    """Sample ``i`` reports ``i`` and the pid of the process that loaded it (slowly)."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        time.sleep(self.delay)
        return {"index": index, "pid": os.getpid()}


class RaisingData(Dataset[torch.Tensor]):
    """``__getitem__`` raises a ``KeyError`` for index 5."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return load_sample(index)


def load_sample(index: int) -> torch.Tensor:
    """A user function one level below ``__getitem__``: its frame must reach the trainer."""
    if index == 5:
        raise KeyError(f"no label for sample {index}")
    return torch.tensor([index])


class StallData(Dataset[torch.Tensor]):
    """``__getitem__`` of ``index`` hangs until ``release`` exists (at most 300 s)."""

    def __init__(self, n: int, index: int, release: str) -> None:
        self.n = n
        self.index = index
        self.release = release

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.index:
            deadline = time.monotonic() + 300
            while not os.path.exists(self.release) and time.monotonic() < deadline:
                time.sleep(0.1)
        return torch.tensor([index])


class BlobData(Dataset[torch.Tensor]):
    """``n`` samples of ``mib`` MiB each (for memory bounds); sample ``i`` starts with ``i``."""

    def __init__(self, n: int, mib: int) -> None:
        self.n = n
        self.mib = mib

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        blob = torch.zeros(self.mib * 2**20 // 8, dtype=torch.float64)
        blob[0] = index
        return blob


class SizedData(Dataset[torch.Tensor]):
    """``range(n)`` as tensors; ``n`` may be 0."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index])
