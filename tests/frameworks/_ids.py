"""The framework trainers' dataset (one module, importable by the Ray workers too)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset


class Ids(Dataset):
    """Sample ``i`` is ``{"id": i, "x": [i]}``: each batch tells which samples it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": i, "x": torch.tensor([float(i)])}
