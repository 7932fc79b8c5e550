"""The trainer's stand-ins for a map-style pool's workers while its actors start.

A new pool's actors take seconds before their first batch: Ray's own start (when
the loader's background start is still on it), a process, ``import torch``, the
dataset unpickled. Meanwhile the trainer loads the epoch's first batches itself,
as torch's ``num_workers=0`` would, but each one *as the worker that would have
loaded it*: batch ``k`` of the epoch as worker ``k % num_workers`` (torch's
round-robin), on that worker's own copy of the dataset (unpickled from the same
payload the actors get), with that worker's RNG states (seeded ``base_seed + id``
as torch seeds it) and ``get_worker_info()`` saying so. When the actors are up,
each takes over its worker's RNG states (``DatasetWorker.continue_from``), so its
next draw is the one it would have made had it loaded those batches itself: a
dataset that draws random augmentations from the worker's RNG gives the same
batches as torch's loader either way.

The states are swapped in and out around each batch, on the trainer's thread
(``MapStyleProducer.deliver``), never while the training step runs, so the
training loop's own draws (dropout, its sampler) see the trainer's RNG alone.

What differs from an actor: ``os.getpid()`` is the trainer's; a crash of the
process (``os._exit``, a segfault) takes the trainer down; state the dataset keeps
on itself (a cache) stays with the stand-in's copy. Where it is not done
(``TorchSource._may_load_here``): with a ``worker_init_fn`` (it would run in the
trainer, where ``torch.set_num_threads`` or a global seed would change the training
process), torch's ``timeout`` and a device copy stage. With ``num_workers="auto"``
the trainer stands in for worker 0 alone (``MapStyleProducer``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

from raydl._internal.workers import allocator
from raydl._internal.workers.failure import RemoteError
from raydl._internal.workers.worker import (
    RngStates,
    WorkerSpec,
    collate_into_plain_memory,
    describe_indices,
    load_batch,
    shard_datapipe,
)

#: Largest pickled dataset (``(dataset, worker_init_fn, collate_fn)``, times the
#: number of workers) copied into the trainer for its stand-ins: a dataset that
#: holds its samples in memory is copied once per stand-in, as into each actor.
MAX_COPIED_BYTES = 64 << 20


class EmulatedWorkers:
    """Stand-ins for the ``spec.num_workers`` workers of a pool, loading in this process.

    Args:
        payload: The pool's pickled ``(dataset, worker_init_fn, collate_fn)``
            (``workers/payload.py``); its ``worker_init_fn`` must be ``None``.
        spec: The pool's spec (its base seed decides the RNG states).
    """

    def __init__(self, payload: bytes, spec: WorkerSpec) -> None:
        self._payload = payload
        self.spec = spec
        self._copies: dict[int, tuple[Any, Any]] = {}  # worker id -> (dataset, collate_fn)
        self._rng: dict[int, RngStates] = {}
        self.loaded = 0  # batches loaded here
        self.handed_over = False  # the actors took over (they go on from the states)

    def fetch(self, indices: Sequence[int] | int, worker_id: int) -> Any:
        """Worker ``worker_id``'s batch of ``indices``, loaded here; a ``RemoteError`` if it raised."""
        from torch.utils.data._utils import worker as torch_worker

        spec = self.spec
        trainers, trainers_info = RngStates.current(), torch_worker._worker_info
        # As in an actor, torch's default collate stacks into plain memory here, not into
        # the shared memory a worker process's queue needs (put back afterwards: the
        # workers of the script's own torch DataLoaders, forked later, need it).
        plain_collate_undo = collate_into_plain_memory()
        threads = one_thread()
        loading = False
        try:
            # Unpickled first, as an actor does before it is seeded: whatever unpickling
            # draws comes from the trainer's states, put back below.
            dataset, collate_fn = self._copy(worker_id)
            rng = self._rng.get(worker_id) or RngStates.seeded(spec.base_seed, worker_id)
            rng.apply()
            loading = True
            torch_worker._worker_info = torch_worker.WorkerInfo(
                id=worker_id,
                num_workers=spec.num_workers,
                seed=spec.base_seed + worker_id,
                dataset=dataset,
            )
            batch = load_batch(dataset, collate_fn, spec.auto_collation, indices)
        except Exception:
            batch = RemoteError(
                where=f"in the training process, as Ray worker {worker_id} while raydl's "
                f"actors started, while loading {describe_indices(indices)}"
            )
        finally:
            if loading:
                self._rng[worker_id] = RngStates.current()
            torch_worker._worker_info = trainers_info
            trainers.apply()
            plain_collate_undo()
            threads()
            allocator.release_freed_memory()  # the trainer's heap is the user's
        self.loaded += 1
        return batch

    def rng_states(self) -> dict[int, RngStates]:
        """The RNG states of the workers that loaded here so far (no hand-over)."""
        return dict(self._rng)

    def handover(self) -> dict[int, RngStates]:
        """The RNG states of the workers that loaded here, for their actors to go on from.

        Once: the stand-ins are done (a persistent pool's later epochs use the actors).
        """
        self.handed_over = True
        self._copies.clear()
        return dict(self._rng)

    def _copy(self, worker_id: int) -> tuple[Any, Any]:
        copy = self._copies.get(worker_id)
        if copy is None:
            dataset, init_fn, collate_fn = pickle.loads(self._payload)
            assert init_fn is None, "a worker_init_fn must run in a worker process"
            shard_datapipe(dataset, self.spec, worker_id)
            copy = self._copies[worker_id] = (dataset, collate_fn)
        return copy


def one_thread() -> Callable[[], None]:
    """Run torch's operators on one thread, as a torch worker process does; returns the undo.

    torch's ``_worker_loop`` calls ``torch.set_num_threads(1)``; the trainer keeps its
    intra-op pool for the training step. Loading with that pool here would be more
    than a difference from torch: between the dataset's small operators its OpenMP
    threads spin, so on a machine of few cores the training process kept every core
    busy and raydl's actors, started meanwhile, ran their first task only 20-23 s in
    (measured on 2 CPUs: 2 MB batches of ``torch.full`` and
    ``torch.stack``, no training step, the trainer and an OpenMP thread at 100 % each,
    40-49 epochs loaded here; with one thread the actors took over 3-4 s after they were
    made). Only where torch runs on OpenMP: the native pool cannot be resized once it
    has run.
    """
    import torch

    threads = torch.get_num_threads()
    if threads == 1 or not torch.backends.openmp.is_available():
        return lambda: None
    torch.set_num_threads(1)
    return lambda: torch.set_num_threads(threads)
