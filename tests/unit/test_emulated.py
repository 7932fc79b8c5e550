"""workers/emulated.py: the trainer's stand-ins for a pool's workers, without Ray."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, default_collate

from raydl._internal.workers.emulated import EmulatedWorkers
from raydl._internal.workers.payload import pickle_payload
from raydl._internal.workers.worker import WorkerSpec


class ThreadCount(Dataset[int]):
    """Sample ``i``: the number of intra-op threads torch runs ``__getitem__`` with."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return torch.get_num_threads()


def test_stand_ins_run_torch_on_one_thread_as_torchs_workers_do_then_put_it_back() -> None:
    """torch's worker processes call ``torch.set_num_threads(1)``; a stand-in loads so too
    (the trainer's spinning OpenMP threads would starve the actors' start)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        spec = WorkerSpec(
            num_workers=1, collate_fn=None, auto_collation=True, worker_init_fn=None, base_seed=0
        )
        here = EmulatedWorkers(pickle_payload(ThreadCount(), None, default_collate), spec)
        batch = here.fetch([0, 1], 0)
        one = torch.backends.openmp.is_available()  # the native pool is not resized
        assert batch.tolist() == ([1, 1] if one else [2, 2])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
