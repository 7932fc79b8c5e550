"""The Ray actors that run a torch ``Dataset`` on the cluster, one per loader worker.

A worker plays the part of one of torch's ``DataLoader`` worker processes:
it holds a copy of the dataset, seeds ``torch``/``random`` like torch does,
sets what :func:`torch.utils.data.get_worker_info` returns, calls
``worker_init_fn(worker_id)``, and then fetches and collates batches on request.

Exceptions from user code are caught here and returned as torch's own
``ExceptionWrapper`` so the training process re-raises them with the original
type, the original traceback text and the indices being loaded.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset
from torch.utils.data._utils import ExceptionWrapper
from torch.utils.data._utils import worker as torch_worker

from raydl._internal.workers.convert import tensors_to_numpy

#: Returned by an iterable worker whose dataset is exhausted.
EXHAUSTED = "__raydl_exhausted__"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs besides the dataset; identical for all workers of a pool."""

    num_workers: int
    collate_fn: Callable[[Any], Any] | None
    auto_collation: bool
    worker_init_fn: Callable[[int], None] | None
    base_seed: int
    batch_size: int | None = None
    drop_last: bool = False


def describe_indices(indices: Sequence[int] | int) -> str:
    """Short text naming the sample indices of a batch, for error messages."""
    if isinstance(indices, int):
        return f"index {indices}"
    items = list(indices)
    if len(items) <= 8:
        return f"indices {items}"
    return f"indices [{items[0]}, {items[1]}, ..., {items[-1]}] ({len(items)} samples)"


class DatasetWorker:
    """One loader worker; instantiated as a Ray actor by :mod:`raydl._internal.workers.pool`."""

    def __init__(self, dataset_ref: list[Any], worker_id: int, spec: WorkerSpec) -> None:
        self._dataset_ref = dataset_ref
        self._id = worker_id
        self.reset(spec)

    def reset(self, spec: WorkerSpec) -> None:
        """Become a fresh worker, as a newly started torch worker process would be.

        A new copy of the dataset is unpickled, the RNGs are seeded from
        ``spec.base_seed``, ``get_worker_info()`` is set and ``worker_init_fn``
        runs again. Reusing the process this way saves starting one (and
        importing torch in it) every epoch; only module-level state of user code
        outlives an epoch, where a new torch worker process would start clean.
        """
        import ray

        worker_id = self._id
        dataset: Dataset[Any] = pickle.loads(ray.get(self._dataset_ref[0]))
        self._dataset = dataset
        self._spec = spec
        self._init_error: ExceptionWrapper | None = None
        self._iter: Iterator[Any] | None = None
        self._exhausted = False
        seed = spec.base_seed + worker_id
        random.seed(seed)
        torch.manual_seed(seed)
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=worker_id, num_workers=spec.num_workers, seed=seed, dataset=dataset
        )
        try:
            if spec.worker_init_fn is not None:
                spec.worker_init_fn(worker_id)
        except Exception:
            self._init_error = ExceptionWrapper(
                where=f"in worker_init_fn of Ray worker {worker_id}"
            )

    def fetch(self, indices: Sequence[int] | int) -> Any:
        """Load and collate one batch of a map-style dataset (or one sample without batching)."""
        if self._init_error is not None:
            return self._init_error
        spec = self._spec
        try:
            if spec.auto_collation:
                assert not isinstance(indices, int)
                getitems = getattr(self._dataset, "__getitems__", None)
                if getitems is not None:
                    data = getitems(list(indices))
                else:
                    data = [self._dataset[i] for i in indices]
            else:
                data = self._dataset[indices]
            if spec.collate_fn is not None:
                data = spec.collate_fn(data)
        except Exception:
            return ExceptionWrapper(
                where=f"in Ray worker {self._id} while loading {describe_indices(indices)}"
            )
        return tensors_to_numpy(data)

    def start_iteration(self) -> None:
        """Begin a fresh pass over an ``IterableDataset`` (one per epoch)."""
        assert isinstance(self._dataset, IterableDataset)
        self._iter = None
        self._exhausted = False

    def next_batch(self) -> Any:
        """The next batch of an ``IterableDataset``, or :data:`EXHAUSTED`."""
        if self._init_error is not None:
            return self._init_error
        spec = self._spec
        try:
            if self._iter is None:
                if self._exhausted:
                    return EXHAUSTED
                self._iter = iter(self._dataset)
            if spec.batch_size is None:
                data = next(self._iter)
            else:
                data = []
                for _ in range(spec.batch_size):
                    try:
                        data.append(next(self._iter))
                    except StopIteration:
                        break
                if not data or (spec.drop_last and len(data) < spec.batch_size):
                    raise StopIteration
            if spec.collate_fn is not None:
                data = spec.collate_fn(data)
        except StopIteration:
            self._iter = None
            self._exhausted = True
            return EXHAUSTED
        except Exception:
            return ExceptionWrapper(where=f"in Ray worker {self._id} while iterating the dataset")
        return tensors_to_numpy(data)
