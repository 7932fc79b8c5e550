"""A module the torch-behaviour tests pickle by value, as a training script's ``__main__`` is.

``cloudpickle.register_pickle_by_value`` makes Ray's workers receive these functions
and classes as code with their own globals, exactly as they receive those of the
script a user runs; ``STATE`` is such a global, set by ``init_state`` in a worker.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

STATE: Any = None


def init_state(worker_id: int) -> None:
    global STATE
    STATE = f"set by worker {worker_id}"


class ReadsState(Dataset[Any]):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> Any:
        return STATE
