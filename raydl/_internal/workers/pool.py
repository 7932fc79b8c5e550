"""A pool of :class:`~raydl._internal.workers.worker.DatasetWorker` Ray actors.

The dataset is pickled once into the object store, together with the
``worker_init_fn`` and ``collate_fn`` in one payload (as torch hands them to a
worker process in one go, so references between them survive: a bound method
of the dataset, globals of the training script that both read); each actor
unpickles its own copy (writable, as in a torch worker process). The pool
holds the reference, so a restarted actor can load it again. A payload that
cannot be pickled is an error naming the part that cannot
(:mod:`~raydl._internal.workers.payload`), raised before any actor starts.

What one payload can share, pickled by value with cloudpickle: functions and
classes of ``__main__`` in the payload share one globals dict per worker, so a
``global`` set by ``worker_init_fn`` is what ``__getitem__`` reads. Not shared:
objects pickled apart (the sampler stays in the trainer, another loader has its
own payload), and module-level state of importable modules is the worker
process's own (shared by everything in that process, as in a torch worker).
Restarts are raydl's, not Ray's (the actors have ``max_restarts=0``): when a
map-style worker dies mid-epoch (SIGKILL, OOM), the epoch iterator replaces it
with :meth:`WorkerPool.restart` and re-submits that worker's in-flight fetches,
so no batch is lost or duplicated (a fetch is a pure function of its indices).
Each batch may be retried :data:`MAX_TASK_RETRIES` times, so an input that
crashes the process every time ends in a :class:`~raydl.errors.WorkerDiedError`
naming it instead of an endless retry. Iterable workers hold a position in a
stream that a restart would lose, so their death is reported at once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from raydl._internal.runtime.cluster import is_connected
from raydl._internal.workers.payload import pickle_payload
from raydl._internal.workers.worker import DatasetWorker, WorkerSpec

if TYPE_CHECKING:
    from torch.utils.data import Dataset

#: How often one batch is retried on a fresh worker after the worker loading it died.
MAX_TASK_RETRIES = 2


def stopped_error() -> RuntimeError:
    """What an epoch whose pool was stopped under it (``loader.close()``) raises."""
    return RuntimeError(
        "this loader's Ray actors were stopped (loader.close()) while an epoch still used "
        "them; iterate the loader again for a new epoch"
    )


class WorkerPool:
    """``num_workers`` actors holding the same dataset and :class:`WorkerSpec`."""

    def __init__(
        self,
        dataset: Dataset[Any] | object,
        spec: WorkerSpec,
        *,
        restartable: bool,
        options: Mapping[str, Any] | None = None,
        ahead: bool = False,
        start: int | None = None,
        payload: bytes | None = None,
    ) -> None:
        """Start ``spec.num_workers`` actors over ``dataset`` (``start`` of them, when given):
        a torch dataset, or the direct path's ``RunLoader`` (no torch needed in the actors).

        ``ahead``: started before their first epoch (the loader's background
        start); they import and unpickle now and become workers of the epoch's
        spec at :meth:`reset`, which must come before any fetch. ``start``: fewer
        actors for now (``num_workers="auto"``: ``spec.num_workers`` is the budget,
        what ``get_worker_info().num_workers`` says; :meth:`add` starts the others).
        ``payload``: the dataset already pickled (``workers/payload.py``), when the
        trainer's stand-ins for these workers load from the same bytes.
        """
        import ray

        actor_options: dict[str, Any] = {"max_restarts": 0, "max_task_retries": 0}
        actor_options.update(options or {})
        # One payload (see the module docstring). Nested in a list, the reference
        # reaches the actor unresolved: the actor unpickles its own writable copy.
        # Pickled before Ray is asked anything: what cannot travel is named (payload.py).
        if payload is None:
            payload = pickle_payload(dataset, spec.worker_init_fn, spec.collate_fn)
        self._dataset_ref = ray.put(payload)
        self._actor_cls = ray.remote(DatasetWorker).options(**actor_options)
        self.spec = _without_functions(spec)
        self.restartable = restartable
        self._restarting = threading.Lock()
        count = spec.num_workers if start is None else min(start, spec.num_workers)
        self.actors = [self._start(i, None if ahead else self.spec) for i in range(count)]

    def _start(self, worker_id: int, spec: WorkerSpec | None) -> Any:
        return self._actor_cls.remote([self._dataset_ref], worker_id, spec)

    def add(self) -> Any:
        """Start one more worker (the next id, the pool's spec now); its actor.

        Called by the fetch thread of the epoch that uses the pool
        (``num_workers="auto"``); the actor counts for requests only once it
        answers ``ready`` (the fetch thread checks).
        """
        with self._restarting:
            if not self.actors:
                raise stopped_error()
            if len(self.actors) >= self.spec.num_workers:
                raise ValueError(
                    f"this pool already has its {self.spec.num_workers} workers (its budget)"
                )
            actor = self._start(len(self.actors), self.spec)
            self.actors.append(actor)
            return actor

    def reset(self, spec: WorkerSpec) -> None:
        """Turn every worker into a fresh one for ``spec`` (see ``DatasetWorker.reset``).

        Asynchronous: each actor runs its tasks in order, so the reset happens
        before any fetch submitted after this call. ``worker_init_fn`` and
        ``collate_fn`` stay the payload's (a loader's are fixed).
        """
        spec = self.spec = _without_functions(spec)
        for actor in self.actors:
            actor.reset.remote(spec)

    def wait_ready(self) -> None:
        """Wait until every worker has started (or reset), as torch's ``iter()`` starts its processes.

        Raises the first worker's failure to start (``worker_init_fn``, unpickling).
        """
        import ray

        for failure in ray.get([actor.ready.remote() for actor in self.actors]):
            if failure is not None:
                failure.reraise()

    def load_states(self, states: list[Any]) -> None:
        """Each worker takes its saved state (``DatasetWorker.load_worker_state``).

        Queued, not awaited: each actor runs its calls in order, so the state is in
        place before the worker's next fetch.
        """
        for actor, state in zip(self.actors, states, strict=False):
            actor.load_worker_state.remote(state)

    def resting_states(self) -> list[dict[str, Any]]:
        """Each worker's ``DatasetWorker.resting_state``: what it carries into the next epoch."""
        import ray

        states: list[dict[str, Any]] = ray.get(
            [actor.resting_state.remote() for actor in self.actors]
        )
        return states

    def restart(self, worker_id: int, dead: Any) -> Any:
        """Replace the dead actor ``dead`` of worker ``worker_id``; the worker's actor now.

        Two epochs may share a pool (an epoch started early, two live iterators) and
        both see the same death: only the first replaces the actor, the second gets
        that replacement (``worker_init_fn`` runs once in it).
        """
        import ray

        with self._restarting:
            if not self.actors:
                raise stopped_error()
            if self.actors[worker_id] is dead:
                with contextlib.suppress(Exception):  # it is already gone
                    ray.kill(dead, no_restart=True)
                self.actors[worker_id] = self._start(worker_id, self.spec)
            return self.actors[worker_id]

    def __len__(self) -> int:
        return len(self.actors)

    def kill(self) -> None:
        """Stop every actor now (pending tasks fail; results already fetched stay valid)."""
        with self._restarting:  # not while a fetch thread adds or restarts one
            actors, self.actors = self.actors, []
        if not is_connected():  # Ray already shut down (e.g. at exit): the actors died with it
            return
        import ray

        for actor in actors:
            with contextlib.suppress(Exception):  # already dead, or Ray already shut down
                ray.kill(actor, no_restart=True)


def _without_functions(spec: WorkerSpec) -> WorkerSpec:
    """``spec`` as the actors get it: its functions travel in the payload instead."""
    return replace(spec, worker_init_fn=None, collate_fn=None)
