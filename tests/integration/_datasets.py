"""Datasets, samplers and collate functions shared by the integration tests.

They live in an importable module (on ``PYTHONPATH``, see ``tests/conftest.py``)
because Ray worker processes unpickle them by module name.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class TensorData(Dataset[torch.Tensor]):
    """Sample ``i`` is ``tensor([i, 1000 + i])``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, 1000 + index], dtype=torch.float32)


class TupleData(TensorData):
    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        return torch.tensor([index]), 1000 + index


class DictData(TensorData):
    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        return {"x": torch.full((2, 2), float(index)), "id": index, "name": f"s{index}"}


class NumpyData(TensorData):
    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        return np.array([index, index + 0.5], dtype=np.float64)


class IntData(TensorData):
    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        return index


class GetItemsData(TensorData):
    """Batched access through ``__getitems__`` (what torch's fetcher prefers)."""

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        return {"id": index}

    def __getitems__(self, indices: list[int]) -> list[Any]:
        assert isinstance(indices, list)
        return [{"id": i, "batched": len(indices)} for i in indices]


def collate_ids(batch: Any) -> dict[str, Any]:
    """A custom collate_fn: a list of samples (or one sample) -> plain python."""
    if isinstance(batch, list):
        return {"ids": [int(s[0]) for s in batch], "size": len(batch)}
    return {"ids": [int(batch[0])], "size": 1}


class StreamData(IterableDataset[torch.Tensor]):
    """``range(n)`` sharded across loader workers with ``get_worker_info()``.

    ``shard=(worker, num_workers)`` forces one shard, to build torch's
    per-worker reference output without worker processes.
    """

    def __init__(self, n: int, shard: tuple[int, int] | None = None, as_dict: bool = False) -> None:
        self.n = n
        self.shard = shard
        self.as_dict = as_dict

    def __iter__(self) -> Iterator[Any]:
        if self.shard is not None:
            worker, workers = self.shard
        else:
            info = get_worker_info()
            worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(worker, self.n, workers):
            yield {"id": i, "x": torch.tensor([float(i)])} if self.as_dict else torch.tensor(i)


class WorkerInfoData(TensorData):
    """Reports, per sample, which process and loader worker loaded it."""

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        info = get_worker_info()
        return {
            "index": index,
            "pid": os.getpid(),
            "worker": -1 if info is None else info.id,
            "num_workers": -1 if info is None else info.num_workers,
            "seed": -1 if info is None else info.seed,
            "init_pid": int(os.environ.get("RAYDL_TEST_INIT_PID", "-1")),
            "init_worker": int(os.environ.get("RAYDL_TEST_INIT_WORKER", "-1")),
        }


def record_worker_init(worker_id: int) -> None:
    """A worker_init_fn that leaves a trace the dataset reports back."""
    os.environ["RAYDL_TEST_INIT_PID"] = str(os.getpid())
    os.environ["RAYDL_TEST_INIT_WORKER"] = str(worker_id)


class FailingData(TensorData):
    """``__getitem__`` raises for one index."""

    def __init__(self, n: int, bad: int, error: type[Exception] = ValueError) -> None:
        super().__init__(n)
        self.bad = bad
        self.error = error

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.bad:
            raise self.error(f"sample {index} is corrupt")
        return super().__getitem__(index)


def failing_collate(batch: Any) -> Any:
    raise KeyError("collate cannot handle this batch")


class SlowData(TensorData):
    def __init__(self, n: int, delay: float) -> None:
        super().__init__(n)
        self.delay = delay

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.delay)
        return super().__getitem__(index)


class PoisonData(TensorData):
    """The worker process dies (``os._exit``) every time ``index == poison`` is loaded."""

    def __init__(self, n: int, poison: int) -> None:
        super().__init__(n)
        self.poison = poison

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.poison:
            os._exit(1)
        return super().__getitem__(index)


class DieOnceData(TensorData):
    """The worker process dies the first time ``index == victim`` is loaded, never again."""

    def __init__(self, n: int, victim: int, marker: Path) -> None:
        super().__init__(n)
        self.victim = victim
        self.marker = str(marker)

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.victim:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.close(fd)
                os._exit(1)
        return super().__getitem__(index)


class SlowWorkerData(TensorData):
    """Sleeps ``delay`` s per sample (no CPU) and reports the loader worker that loaded it."""

    def __init__(self, n: int, delay: float) -> None:
        super().__init__(n)
        self.delay = delay

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        time.sleep(self.delay)
        info = get_worker_info()
        return {
            "index": index,
            "worker": -1 if info is None else info.id,
            "num_workers": -1 if info is None else info.num_workers,
        }


class PageFaults(Dataset[int]):
    """Sample ``i``: the minor page faults of 20 rounds of eight 600 KB arrays, in the worker.

    Counted for the loading thread alone (``RUSAGE_THREAD``).

    A decoded 224x224 float image and its temporaries are that size; raydl's actors
    keep freed memory for the next round (``workers/allocator.py``).
    """

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        import resource

        def one_round() -> None:
            arrays = [np.ones(600 << 10, dtype=np.uint8) for _ in range(8)]
            del arrays

        # This thread's faults only: the actor's other threads (Ray's core worker, gRPC)
        # fault pages too, which a loaded machine could push past the bound.
        one_round()
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(20):
            one_round()
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


class ForkReport(Dataset[dict[str, Any]]):
    """Sample ``i``: this process's pid, whether it shares torch and Ray with a fork server,
    and how many intra-op threads its torch runs."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict[str, Any]:
        from raydl._internal.runtime.fork_server import shared_by_parent

        return {
            "pid": os.getpid(),
            "torch_shared": "torch" in shared_by_parent(),
            "ray_shared": "ray" in shared_by_parent(),  # imported by its job's environment server
            "torch_threads": torch.get_num_threads(),
        }


def collate_and_report_shared(samples: list[Any]) -> dict[str, torch.Tensor]:
    """torch's ``default_collate``, and whether the batch it built lives in shared memory."""
    from torch.utils.data import default_collate

    out = default_collate(samples)
    return {"x": out, "shared": torch.tensor(out.is_shared())}


class RandomDraws(Dataset[dict[str, Any]]):
    """Sample ``i``: draws from the worker's torch, numpy and Python RNGs, its worker id and pid.

    A dataset whose random augmentations come from the worker's RNGs, as torch seeds them.
    """

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, Any]:
        import random

        info = get_worker_info()
        return {
            "index": index,
            "torch": torch.rand(2),
            "python": random.random(),
            "numpy": np.random.rand(),
            "worker": -1 if info is None else info.id,
            "pid": os.getpid(),
        }


class FilledBlocks(Dataset[dict[str, Any]]):
    """Sample ``i``: 256 KiB of ``float(i)`` made by a torch operator, and the pid that made it.

    Operators this size run on torch's intra-op threads where the process has several
    (OpenMP): the trainer's, when it loads batches itself while the actors start.
    """

    def __len__(self) -> int:
        return 1600

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"x": torch.full((65536,), float(index)), "pid": os.getpid()}
