"""Ray Data iteration internals: handles on what one ``iter_batches`` starts.

Relies on these private parts of Ray Data's ``DataIterator`` (checked by
:func:`check`): ``_to_ref_bundle_iterator`` (returns the block bundles, the stats
and, for a ``Dataset``, the ``StreamingExecutor`` thread), ``_create_batch_iterator``
(its result's ``_prefetcher``), the executor's ``_resource_manager`` with its
``GLOBAL_LIMITS_UPDATE_INTERVAL_S`` and its ``_topology`` (the operators), and the
operators' ``_cancel_active_tasks`` and their running tasks, ``_data_tasks`` and
``_metadata_tasks`` (:func:`no_cancel_at_shutdown`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

#: How often an epoch's executor re-reads the resources Ray Data lets it use (Ray: 1 s).
LIMITS_REFRESH_S = 0.05


class RayIteration:
    """One ``iter_batches`` of a Ray Data source, with handles on what it starts.

    Ray Data leaves things behind when an iteration ends early: its block
    prefetcher's thread (stopped only when the blocks run out, so every ``break``
    leaks one parked thread); its batch threads (``iter_threaded``), which are
    only told to stop and may still be inside Ray a moment later, so a
    ``ray.shutdown()`` right after ``close()`` makes Ray's core worker end the
    process; and, when the consumer gives up on a stalled stage, the executor
    itself (the producer thread is stuck inside it and cannot close it). The
    ``DataIterator`` is wrapped so raydl sees the executor, the prefetchers and the
    threads the iteration starts, and can stop or wait for them.
    """

    #: How long an iteration closed early waits for Ray's batch threads to return.
    THREADS_JOIN_S = 5.0
    #: How long a closed iteration waits for Ray's executor thread to end.
    EXECUTOR_JOIN_S = 15.0

    def __init__(self, source: Any) -> None:
        # A Dataset makes a new DataIterator per call; a streaming_split part is one.
        iterator = source.iterator() if hasattr(source, "iterator") else source
        self.iterator = iterator
        self._executor: Any = None
        self._prefetchers: list[Any] = []
        self._threads: list[threading.Thread] = []
        to_bundles = iterator._to_ref_bundle_iterator
        create_batches = iterator._create_batch_iterator

        def ref_bundles() -> Any:
            result = to_bundles()
            # (bundles, stats, executor) in Ray 2.60; the executor is None for a split,
            # whose executor runs in Ray's coordinator actor. Found by type, not place.
            parts = result if isinstance(result, tuple) else ()
            self._executor = next((p for p in parts if isinstance(p, threading.Thread)), None)
            _refresh_limits_promptly(self._executor)
            no_cancel_at_shutdown(self._executor)
            return result

        def batch_iterator(*args: Any, **kwargs: Any) -> Any:
            before = set(threading.enumerate())
            batches = create_batches(*args, **kwargs)
            prefetcher = getattr(batches, "_prefetcher", None)
            if prefetcher is not None:
                self._prefetchers.append(prefetcher)
            return self._watch_threads(batches, before)

        iterator._to_ref_bundle_iterator = ref_bundles
        iterator._create_batch_iterator = batch_iterator

    def _watch_threads(self, batches: Any, before: set[threading.Thread]) -> Iterator[Any]:
        """``batches``, noting the threads Ray starts for them (by the first batch).

        Threads another iteration started in the same moment may be noted too:
        they are only waited for, boundedly and only when this iteration is closed
        early (at its natural end Ray's threads have already returned).
        """
        iterator = iter(batches)
        try:
            first = next(iterator)
        except StopIteration:  # an empty epoch
            return
        finally:
            self._threads.extend(t for t in threading.enumerate() if t not in before)
        yield first
        yield from iterator

    def join_threads(self) -> None:
        """Wait (boundedly) for the threads this iteration started, once it is closed."""
        deadline = time.monotonic() + self.THREADS_JOIN_S
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def join_executor(self) -> None:
        """Wait (boundedly) for the executor's scheduling thread, once it was shut down.

        Ray Data's ``StreamingExecutor.shutdown`` waits only 2 s for its
        scheduling loop; a step that takes longer (an actor pool starting on a
        busy machine) goes on calling Ray afterwards, and after a
        ``ray.shutdown()`` such a call starts a new Ray instance in the middle of
        its teardown, which ends the process.
        """
        executor = self._executor
        if isinstance(executor, threading.Thread) and executor is not threading.current_thread():
            with contextlib.suppress(RuntimeError):  # never started
                executor.join(timeout=self.EXECUTOR_JOIN_S)

    def execution_done(self) -> bool:
        """Whether Ray's executor has run every task (its outputs may still be queued)."""
        executor = self._executor
        return (
            isinstance(executor, threading.Thread)
            and executor.ident is not None
            and not executor.is_alive()
        )

    def stop_prefetchers(self) -> None:
        """Stop the block prefetchers' threads (idempotent; Ray stops them only at the end)."""
        for prefetcher in self._prefetchers:
            with contextlib.suppress(Exception):
                prefetcher.stop()

    def abort(self) -> None:
        """Shut the executor down from another thread.

        Its running tasks are cancelled (``force``: their processes are killed) and
        its output ends, so a producer stuck waiting for the next block returns.
        Only here are they cancelled (see :func:`no_cancel_at_shutdown`): they are
        stalled, not about to finish.
        """
        executor = self._executor
        if executor is not None:
            with contextlib.suppress(Exception):  # already shut down, or Ray is gone
                _cancel_at_shutdown(executor)
                executor.shutdown(force=True)
        self.stop_prefetchers()


def _refresh_limits_promptly(executor: Any) -> None:
    """Let a new execution learn its resources within ``LIMITS_REFRESH_S``, not 1 s.

    Ray Data 2.60's executor asks the cluster's autoscaling coordinator for its
    share of resources asynchronously, so its first answer is "none", and it asks
    again only a second later; until then each stage runs one task at a time.
    raydl starts an execution per epoch and an epoch often lasts about a second:
    on 2 CPUs the tabular benchmark's epochs ran about 1.3-1.5x faster with this.
    The executor's thread reads the interval at each step, so setting it after the
    start takes effect at the next refresh.
    """
    manager = getattr(executor, "_resource_manager", None)
    if manager is not None:
        manager.GLOBAL_LIMITS_UPDATE_INTERVAL_S = LIMITS_REFRESH_S


def no_cancel_at_shutdown(executor: Any) -> None:
    """Make ``executor``'s shutdown let its running tasks end instead of cancelling them.

    Ray Data shuts an execution down when its iteration ends early (a ``break``, an
    epoch closed before its end: ``DataIterator._on_iteration_end``), and its
    operators then ``ray.cancel`` their running tasks. Ray 2.60's core worker has a
    race there that ends the whole training process: a cancel that comes while the
    task's completion reply is being handled (``NormalTaskSubmitter``'s reply callback
    has taken the task out of ``executing_tasks_`` and not yet completed it) fails
    the task as cancelled, and the completion that follows trips
    ``Check failed: it != submissible_tasks_.end() Tried to complete task that was
    not pending`` in ``task_manager.cc``; the driver exits with status 1. Seen in a
    fresh-clone test run, its driver log matching this line by line (early breaks of
    Ray Data loaders; probably an earlier silent exit 1 too). So the operators of
    raydl's executions drop their running tasks instead: a task-pool map task
    finishes on its own (a map task waiting on its output's backpressure is let go
    once its generator is dropped), an actor pool's tasks end with its actors, which
    the operator kills as before.
    :meth:`RayIteration.abort` (a stalled stage) still cancels.

    Operators without ``_data_tasks`` and ``_metadata_tasks`` (shuffles) keep
    Ray Data's cancel.
    """
    for op in getattr(executor, "_topology", None) or ():
        if all(isinstance(getattr(op, name, None), dict) for name in _RUNNING_TASKS):
            op._cancel_active_tasks = functools.partial(_drop_running_tasks, op)


#: A map operator's running tasks (index -> task), which hold the tasks' generators.
_RUNNING_TASKS = ("_data_tasks", "_metadata_tasks")


def _drop_running_tasks(op: Any, force: bool) -> None:
    """An operator's ``_cancel_active_tasks`` that lets its running tasks end unwatched."""
    del force
    for name in _RUNNING_TASKS:
        getattr(op, name).clear()


def _cancel_at_shutdown(executor: Any) -> None:
    """Undo :func:`no_cancel_at_shutdown`: ``executor``'s shutdown cancels its tasks again."""
    for op in getattr(executor, "_topology", None) or ():
        vars(op).pop("_cancel_active_tasks", None)


def check() -> None:
    """Fail if this Ray lacks the iteration internals :class:`RayIteration` relies on."""
    from ray.data import DataIterator
    from ray.data._internal.execution.resource_manager import ResourceManager
    from ray.data._internal.execution.streaming_executor import StreamingExecutor

    for name in ("_to_ref_bundle_iterator", "_create_batch_iterator"):
        if not hasattr(DataIterator, name):
            raise AttributeError(f"ray.data.DataIterator has no {name}")
    if not issubclass(StreamingExecutor, threading.Thread):
        raise TypeError("Ray Data's StreamingExecutor is no longer a thread")
    if not hasattr(ResourceManager, "GLOBAL_LIMITS_UPDATE_INTERVAL_S"):
        raise AttributeError("Ray Data's ResourceManager has no GLOBAL_LIMITS_UPDATE_INTERVAL_S")
    from ray.data._internal.execution.interfaces.physical_operator import PhysicalOperator
    from ray.data._internal.execution.operators.map_operator import MapOperator

    if not callable(getattr(PhysicalOperator, "_cancel_active_tasks", None)):
        raise AttributeError("Ray Data's PhysicalOperator has no _cancel_active_tasks")
    if not set(_RUNNING_TASKS) <= set(MapOperator.__init__.__code__.co_names):
        raise AttributeError(f"Ray Data's MapOperator keeps none of {_RUNNING_TASKS}")
