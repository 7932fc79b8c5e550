"""The per-epoch iterators behind :class:`raydl.RayDataLoader`.

* :class:`MapStyleIterator`: the driver walks torch's (batch) sampler, exactly as
  torch does, and hands each batch of indices to the epoch's fetch thread, which
  sends it to a Ray actor of the pool (``num_workers * prefetch_factor`` batches
  in flight or waiting) and queues the converted results in sampler order (or as
  they finish with ``in_order=False``).
* :class:`IterableIterator`: each actor iterates its own copy of an
  ``IterableDataset`` (sharding itself with ``get_worker_info()``) and the
  epoch's fetch thread takes batches round-robin from the workers, as torch does.
* :class:`RayDatasetIterator`: a named background thread drives Ray Data's
  streaming executor for the epoch's plan and hands converted batches over a
  bounded queue; it stops on ``close()`` and its exceptions are re-raised in
  the consumer.

All three stop their Ray work on exhaustion, ``close()``, an exception or
garbage collection.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data._utils.pin_memory import pin_memory as pin_structure

from raydl._internal.epochs.plan import STAGE_RETRIES
from raydl._internal.runtime.cluster import is_connected
from raydl._internal.stream.batching import cut_batches, ray_batches
from raydl._internal.stream.fetchers import (
    DONE,
    END_OF_REQUESTS,
    DirectFetcher,
    Failure,
    IterableFetcher,
    MapStyleFetcher,
    take,
    timeout_error,
)
from raydl._internal.stream.metrics import EpochStats, logger
from raydl._internal.stream.threads import put_until_stopped
from raydl._internal.workers.convert import numpy_batch_to_tensors
from raydl._internal.workers.pool import WorkerPool
from raydl.errors import WorkerDiedError


class _BaseIterator(Iterator[Any]):
    """Bookkeeping shared by the epoch iterators: counting, pinning, closing."""

    def __init__(
        self,
        *,
        timeout: float,
        pin_memory: bool,
        length: int | None,
        on_exhausted: Callable[[], None] | None = None,
    ) -> None:
        self._timeout = timeout
        self._pin = pin_memory
        self._length = length
        self._closed = False
        self._on_exhausted = on_exhausted
        self.num_yielded = 0
        self.exhausted = False
        self.stats: EpochStats | None = None  # set by the loader
        self.progress: Any = None  # a tqdm bar, set by the loader when asked
        self.log_summary = False  # log the epoch's summary line when it ends

    def __iter__(self) -> _BaseIterator:
        return self

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("this loader's length is not known in advance")
        return self._length

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        started = time.perf_counter()
        try:
            batch = self._next_batch()
        except StopIteration:
            self.exhausted = True
            if self.stats is not None:
                self.stats.finish()
                self.stats.ray_data = self._execution_summary()
                if self.log_summary:
                    logger.info(self.stats.summary_line())
            self.close()
            if self._on_exhausted is not None:
                self._on_exhausted()
            raise
        except BaseException:
            self.close()
            raise
        if self._pin:
            batch = pin_structure(batch)
        self.num_yielded += 1
        if self.stats is not None:
            self.stats.record(batch, time.perf_counter() - started)
        if self.progress is not None:
            self.progress.update(1)
        return batch

    def _next_batch(self) -> Any:
        raise NotImplementedError

    def _execution_summary(self) -> str | None:
        """Ray Data's per-stage summary of the epoch, where there is one."""
        return None

    def close(self) -> None:
        """Release this epoch's Ray work; further ``next()`` calls raise ``StopIteration``."""
        # A running iterator keeps its loader alive (`for b in DataLoader(...)`); a closed
        # one must not, or a loader dropped after its epoch lives on in a reference cycle
        # (loader <-> iterator) with its early-started next epoch running.
        self.__dict__.pop("loader", None)
        if not self._closed:
            self._closed = True
            if self.stats is not None:
                self.stats.finish()
            if self.progress is not None:
                self.progress.close()
            self._stop_threads()
            if is_connected():  # after ray.shutdown() (e.g. at exit) there is nothing to release
                self._release()

    def _stop_threads(self) -> None:
        """Stop this epoch's own threads (whether or not Ray is still connected)."""

    def _release(self) -> None:
        raise NotImplementedError

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class _ThreadFed(_BaseIterator):
    """An epoch whose batches a fetch thread (see :mod:`~raydl._internal.stream.fetchers`) queues."""

    _thread: threading.Thread | None = None  # None until started
    _done = False  # the thread's DONE was taken: every later next() is StopIteration

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._stop = threading.Event()  # set by close(): the thread stops

    def _start_thread(self, target: Callable[[], None], name: str) -> None:
        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    def _take(self, results: queue.Queue[Any] | queue.SimpleQueue[Any]) -> Any:
        if self._done:
            raise StopIteration
        assert self._thread is not None
        item = take(results, self._thread, self._timeout, self._stop)
        if item is DONE:
            self._done = True
            raise StopIteration
        if isinstance(item, Failure):
            raise item.error
        return item

    def _stop_threads(self) -> None:
        # In-flight fetches are dropped, not ray.cancel()ed: cancelling queued tasks of
        # a (sequential) actor leaves a gap in its task sequence and stalls the actor's
        # next tasks for 30 s. They finish on their own; their results are discarded.
        # Stopped even after ray.shutdown(): the thread must not call into Ray then.
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)


class MapStyleIterator(_ThreadFed):
    """One epoch over a map-style dataset, fetched by a :class:`WorkerPool`.

    The sampler is iterated here, on the trainer's thread, as torch does: a request
    per batch taken (after the first ``num_workers * prefetch_factor``). A
    :class:`~raydl._internal.stream.fetchers.MapStyleFetcher` thread sends them to the
    workers and queues the converted results.
    """

    def __init__(
        self,
        pool: WorkerPool,
        index_iter: Iterator[Any],
        *,
        prefetch: int,
        in_order: bool,
        timeout: float,
        pin_memory: bool,
        length: int | None,
        on_close: Callable[[], None] | None = None,
        skip: int = 0,
    ) -> None:
        """``skip``: batches of this epoch already consumed (their indices were skipped)."""
        super().__init__(timeout=timeout, pin_memory=pin_memory, length=length)
        self.num_yielded = skip
        self._index_iter = index_iter
        self._sampler_done = False
        self._on_close = on_close
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for _ in range(max(1, prefetch * len(pool))):
            self._request()
        self._start_thread(
            MapStyleFetcher(
                pool,
                self._requests,
                self._results,
                self._stop,
                in_order=in_order,
            ).run,
            "raydl-map-style-fetcher",
        )

    def _request(self) -> None:
        """Draw the next batch of indices from the sampler and hand it to the fetch thread."""
        if self._sampler_done:
            return
        try:
            indices = next(self._index_iter)
        except StopIteration:
            self._sampler_done = True
            self._requests.put(END_OF_REQUESTS)
            return
        self._requests.put(indices)

    def _next_batch(self) -> Any:
        batch = self._take(self._results)
        self._request()  # torch draws the next indices once a batch has arrived
        return batch

    def _release(self) -> None:
        if self._on_close is not None:
            self._on_close()


class IterableIterator(_ThreadFed):
    """One epoch over an ``IterableDataset`` whose copies run in a :class:`WorkerPool`.

    An :class:`~raydl._internal.stream.fetchers.IterableFetcher` thread takes the workers'
    batches round-robin and queues them (``prefetch`` per worker in flight, plus
    up to two converted: one queued, one waiting to be).
    """

    def __init__(
        self,
        pool: WorkerPool,
        *,
        prefetch: int,
        timeout: float,
        pin_memory: bool,
        length: int | None,
        on_close: Callable[[], None] | None = None,
        skip: int = 0,
    ) -> None:
        """``skip``: batches to read and discard first (a resume; exact for deterministic datasets)."""
        import ray

        super().__init__(timeout=timeout, pin_memory=pin_memory, length=length)
        self._on_close = on_close
        ray.get([actor.start_iteration.remote() for actor in pool.actors])
        self._results: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._start_thread(
            IterableFetcher(pool, self._results, self._stop, prefetch=prefetch).run,
            "raydl-iterable-fetcher",
        )
        self._discard(skip)

    def _discard(self, count: int) -> None:
        for _ in range(count):
            try:
                self._next_batch()
            except StopIteration:
                break
        self.num_yielded = count

    def _next_batch(self) -> Any:
        return self._take(self._results)

    def _release(self) -> None:
        if self._on_close is not None:
            self._on_close()


class DirectIterator(_ThreadFed):
    """One epoch of a simple file pipeline run on raydl's own actors (see ``direct.py``).

    A :class:`~raydl._internal.stream.fetchers.DirectFetcher` thread sends the epoch's
    runs of files to the pool, cuts the blocks that come back into batches (the
    same code, local shuffle buffer included, as for Ray Data's blocks), converts
    them and queues up to ``prefetch`` of them.
    """

    def __init__(
        self,
        pool: WorkerPool,
        work: Any,
        runs: Sequence[Sequence[str]],
        *,
        batch_size: int,
        drop_last: bool,
        local_shuffle_buffer_size: int | None,
        local_shuffle_seed: int | None,
        collate_fn: Callable[[Any], Any] | None,
        prefetch: int,
        timeout: float,
        pin_memory: bool,
        length: int | None,
        epoch: int,
        summary: str,
        skip: int = 0,
        start_next: Callable[[], bool] | None = None,
    ) -> None:
        """``work``: the epoch's :class:`~raydl._internal.epochs.direct.EpochWork`, put in Ray.

        ``skip``, ``start_next``: as for :class:`RayDatasetIterator` (the next epoch
        is asked for once every run has been sent).
        """
        super().__init__(timeout=timeout, pin_memory=pin_memory, length=length)
        self.num_yielded = skip
        self._summary = summary
        self._results: queue.Queue[Any] = queue.Queue(maxsize=max(1, prefetch))

        def cut(blocks: Iterator[Any]) -> Iterator[Any]:
            return cut_batches(
                blocks,
                batch_size=batch_size,
                drop_last=drop_last,
                buffer=local_shuffle_buffer_size,
                seed=local_shuffle_seed,
            )

        # Nested in a list, the reference reaches the actors unresolved (they keep it).
        self._fetcher = DirectFetcher(
            pool,
            [([work], tuple(run)) for run in runs],
            self._results,
            self._stop,
            window=prefetch * len(pool),
            cut=cut,
            collate=collate_fn if collate_fn is not None else numpy_batch_to_tensors,
            skip=skip,
            start_next=start_next,
        )
        self._start_thread(self._fetcher.run, f"raydl-epoch-{epoch}-direct")

    def _next_batch(self) -> Any:
        return self._take(self._results)

    def _execution_summary(self) -> str | None:
        return f"{self._summary}: {self._fetcher.blocks} blocks"

    def _release(self) -> None:
        pass


def users_error(err: BaseException, stages: Sequence[str] = ()) -> BaseException:
    """The exception a user's Ray Data stage raised, rather than Ray's wrapper of it.

    torch re-raises a worker's exception with its own type, so raydl does too:
    epoch plans run with ``raise_original_map_exception`` (see ``plan.py``), so
    Ray's ``RayTaskError`` carries the user's exception as its ``cause``. The
    wrapper stays chained as the cause: its text names the stage and carries the
    worker-side traceback down to the user's frame.

    A worker process that died on every attempt (Ray's ``WorkerCrashedError`` /
    ``RayActorError`` once the bounded retries are spent) becomes a
    :class:`WorkerDiedError` naming the plan's ``stages``; Ray does not say which
    stage's task it was, only its log does.
    """
    from ray.exceptions import RayActorError, RayTaskError, WorkerCrashedError

    if isinstance(err, (WorkerCrashedError, RayActorError)):
        died = WorkerDiedError(
            f"a Ray worker process running this epoch's Ray Data stages "
            f"({' -> '.join(stages) or 'unknown'}) died on all {STAGE_RETRIES + 1} attempts "
            "of the same task (a crash, os._exit, a segfault or an out-of-memory kill). An "
            "input that kills its worker every time cannot be loaded: find it from the "
            "stage's logs (Ray's raylet log names the dead worker), fix or filter it out; "
            "set max_retries in the stage's ray_remote_args to retry more often"
        )
        died.__cause__ = err
        return died
    if not isinstance(err, RayTaskError):
        return err
    cause = err.cause
    if not isinstance(cause, Exception) or isinstance(cause, RayTaskError):
        return err
    cause.__cause__ = err
    return cause


class RayDatasetIterator(_BaseIterator):
    """One epoch of a Ray Data plan, driven by a background thread."""

    def __init__(
        self,
        source: Any,
        *,
        local_shuffle_buffer_size: int | None,
        local_shuffle_seed: int | None,
        batch_size: int,
        drop_last: bool,
        collate_fn: Callable[[Any], Any] | None,
        prefetch: int,
        timeout: float,
        pin_memory: bool,
        length: int | None,
        epoch: int,
        on_exhausted: Callable[[], None] | None = None,
        skip: int = 0,
        start_next: Callable[[], bool] | None = None,
        start_next_early: bool = False,
        stages: Sequence[str] = (),
    ) -> None:
        """``source`` is the epoch's ``ray.data.Dataset`` or this rank's ``DataIterator`` split.

        ``stages``: the names of the plan's stages, for an error that cannot say
        which one failed.

        ``skip``: batches to drop first (a resume). The epoch's order is a pure
        function of (seed, epoch), so the batches after them are exactly those an
        uninterrupted run would have delivered; the skipped ones still run through
        the pipeline (that is the cost of a resume).

        ``start_next``: called from the producer thread to start the next epoch
        early, as soon as one of these holds: Ray's executor has run every task
        (its outputs wait for the trainer, the cluster is idle); a batch of Ray's
        arrived and ``start_next_early`` (the plan has an all-to-all stage, so its
        execution is mostly done by then); Ray's iterator is exhausted. It returns
        ``False`` while it is too soon (this epoch was itself started early and
        its ``iter()`` has not come yet), and is asked again at the next batch.
        """
        super().__init__(
            timeout=timeout, pin_memory=pin_memory, length=length, on_exhausted=on_exhausted
        )
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        self._stalled = False  # a wait for a batch timed out
        self._stages = tuple(stages)
        self.num_yielded = skip
        # The thread runs a _Producer that does not refer to this iterator, so a
        # `break` that drops the iterator lets it be collected, and its __del__
        # stops the thread and Ray's executor, as torch's iterators do.
        self._ray = _RayIteration(source)
        self._producer = _Producer(
            source,
            self._ray,
            ray_batches(
                self._ray.iterator,
                batch_size=batch_size,
                drop_last=drop_last,
                buffer=local_shuffle_buffer_size,
                seed=local_shuffle_seed,
            ),
            self._queue,
            self._stop,
            collate=collate_fn if collate_fn is not None else numpy_batch_to_tensors,
            skip=skip,
            start_next=start_next,
            start_next_early=start_next_early,
        )
        self._thread = threading.Thread(
            target=self._producer.run, name=f"raydl-epoch-{epoch}-producer", daemon=True
        )
        self._thread.start()

    def _execution_summary(self) -> str | None:
        return self._producer.summary

    def _next_batch(self) -> Any:
        try:
            item = self._queue.get(timeout=self._timeout if self._timeout > 0 else None)
        except queue.Empty:
            self._stalled = True
            raise timeout_error(self._timeout) from None
        if item is DONE:
            raise StopIteration
        if isinstance(item, Failure):
            raise users_error(item.error, self._stages)
        return item

    def _release(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            # Wait for the producer to close Ray's iterator (its executor shuts down and
            # nothing touches Ray after a later ray.shutdown()). After a timeout the
            # producer is stuck inside Ray's iterator until the stage yields: its
            # executor is shut down from here, which cancels the stalled tasks.
            if self._stalled:
                self._ray.abort()
            self._thread.join(timeout=2 if self._stalled else 30)
            if self._stalled:
                self._ray.stop_prefetchers()


class _RayIteration:
    """One ``iter_batches`` of a Ray Data source, with handles on what it starts.

    Ray Data 2.60 leaves things behind when an iteration ends early: its block
    prefetcher's thread (stopped only when the blocks run out, so every ``break``
    leaks one parked thread); its batch threads (``iter_threaded``), which are
    only told to stop and may still be inside Ray a moment later, so a
    ``ray.shutdown()`` right after ``close()`` makes Ray's core worker end the
    process; and, when the consumer gives up on a stalled stage, the executor
    itself (the producer thread is stuck inside it and cannot close it). The
    :class:`~ray.data.DataIterator` is wrapped so raydl sees the executor, the
    prefetchers and the threads the iteration starts, and can stop or wait for
    them. Should Ray rename those hooks, iteration still works, without the
    clean-up.
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
        to_bundles = getattr(iterator, "_to_ref_bundle_iterator", None)
        create_batches = getattr(iterator, "_create_batch_iterator", None)
        if to_bundles is None or create_batches is None:  # pragma: no cover - Ray changed
            return

        def ref_bundles() -> Any:
            bundles, stats, executor = to_bundles()
            self._executor = executor  # None for a split: its executor runs in Ray's actor
            _refresh_limits_promptly(executor)
            return bundles, stats, executor

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
        """Shut the executor down from another thread: its running tasks are cancelled
        (``force``: their processes are killed) and its output ends, so a producer
        stuck waiting for the next block returns."""
        executor = self._executor
        if executor is not None:
            with contextlib.suppress(Exception):  # already shut down, or Ray is gone
                executor.shutdown(force=True)
        self.stop_prefetchers()


#: How often an epoch's executor re-reads the resources Ray Data lets it use (Ray: 1 s).
LIMITS_REFRESH_S = 0.05


def _refresh_limits_promptly(executor: Any) -> None:
    """Let a new execution learn its resources within ``LIMITS_REFRESH_S``, not 1 s.

    Ray Data 2.60's executor asks the cluster's autoscaling coordinator for its
    share of resources asynchronously, so its first answer is "none", and it asks
    again only a second later; until then each stage runs one task at a time.
    raydl starts an execution per epoch and an epoch often lasts about a second:
    on 2 CPUs the tabular benchmark's epochs ran about 1.3-1.5x faster with this. The
    executor's thread reads the interval at each step, so setting it after the
    start takes effect at the next refresh.
    """
    manager = getattr(executor, "_resource_manager", None)
    if manager is not None and hasattr(manager, "GLOBAL_LIMITS_UPDATE_INTERVAL_S"):
        manager.GLOBAL_LIMITS_UPDATE_INTERVAL_S = LIMITS_REFRESH_S


class _Producer:
    """The body of an epoch's producer thread: Ray's batches, converted, into the queue."""

    def __init__(
        self,
        source: Any,
        ray_iteration: _RayIteration,
        batches: Any,
        out: queue.Queue[Any],
        stop: threading.Event,
        *,
        collate: Callable[[Any], Any],
        skip: int,
        start_next: Callable[[], bool] | None,
        start_next_early: bool,
    ) -> None:
        self._source = source
        self._ray = ray_iteration
        self._batches = batches
        self._queue = out
        self._stop = stop
        self._collate = collate
        self._skip = skip
        self._start_next = start_next
        self._start_next_early = start_next_early
        self.summary: str | None = None  # Ray Data's per-stage summary, once exhausted

    def run(self) -> None:
        if self._stop.is_set():  # discarded before it began: start no Ray execution
            return
        batches = iter(self._batches)
        try:
            for position, batch in enumerate(batches):
                if self._stop.is_set():
                    return
                if self._start_next is not None and (
                    self._start_next_early or self._ray.execution_done()
                ):
                    self._next_epoch()
                if position < self._skip:
                    continue
                self._put(self._collate(batch))
            self._next_epoch()
            with contextlib.suppress(Exception):  # a summary is a nicety, never a failure
                self.summary = self._source.stats()
            self._put(DONE)
        except BaseException as err:
            self._put(Failure(err))
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # shuts Ray Data's streaming executor down
            self._ray.stop_prefetchers()
            if self._stop.is_set():  # closed early: Ray's threads may still be inside Ray
                self._ray.join_executor()
                self._ray.join_threads()

    def _next_epoch(self) -> None:
        start = self._start_next
        if start is not None and not self._stop.is_set() and start():
            self._start_next = None

    def _put(self, item: Any) -> None:
        put_until_stopped(self._queue, item, self._stop)
