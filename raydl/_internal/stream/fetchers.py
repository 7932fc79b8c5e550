"""The fetch threads of map-style and iterable epochs.

A training loop that sleeps in its step (waiting on the GPU) and then asks for a batch
should find it ready, converted, in a queue: no Ray call on its critical path. On a
small VM every Ray call made right after such a pause wakes several of Ray's threads
and processes, and each wake-up costs (measured here after a 27 ms step: a ready
``ray.get`` 1.4-1.7 ms, an actor task submission 1.2-1.4 ms, against ~0.1 ms
back to back). So each epoch runs one named thread that submits the workers' tasks,
waits for their results, converts them to tensors and queues them; the trainer's
``next()`` takes the head of that queue.

What stays on the trainer's thread, as in torch: iterating the sampler (a sampler
that draws from torch's global RNG draws in the same order relative to the training
loop as under torch), and starting an iterable epoch. The thread never refers to
its iterator, so a dropped iterator is collected and its ``close()`` stops the
thread. Failures (a user's exception, a dead worker) are carried to the
trainer and raised there.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data._utils import ExceptionWrapper

from raydl._internal.epochs.direct import WINDOW_BYTES, describe_run, loaded_bytes
from raydl._internal.stream.threads import put_until_stopped
from raydl._internal.workers.convert import numpy_to_tensors
from raydl._internal.workers.pool import MAX_TASK_RETRIES, WorkerPool, stopped_error
from raydl._internal.workers.worker import EXHAUSTED, describe_indices
from raydl.errors import LoaderTimeoutError, WorkerDiedError

#: How long one wait inside Ray lasts before the thread looks at ``stop`` (and at new requests).
WAIT_SLICE_S = 0.05

#: The trainer's message that the sampler is exhausted: no more requests will come.
END_OF_REQUESTS = object()


class Failure:
    """An exception raised in a background thread, carried to the consumer."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


#: The last item of an epoch's queue.
DONE = object()


class _Stopped(Exception):
    """Unwinds a fetch thread whose iterator was closed."""


def timeout_error(timeout: float) -> LoaderTimeoutError:
    """torch's wording for a loader that waited ``timeout`` seconds for a batch."""
    return LoaderTimeoutError(f"DataLoader timed out after {timeout} seconds")


def unwrap(result: Any) -> Any:
    """A worker's reply as tensors, or the worker's exception raised (torch's ``ExceptionWrapper``)."""
    if isinstance(result, ExceptionWrapper):
        result.reraise()
    return numpy_to_tensors(result)


class _Fetch:
    """One batch in flight: its indices, the worker loading it and how often it was retried."""

    __slots__ = ("actor", "attempts", "indices", "ref", "worker_id")

    def __init__(self, ref: Any, indices: Any, worker_id: int, actor: Any) -> None:
        self.ref = ref
        self.indices = indices
        self.worker_id = worker_id
        self.actor = actor  # the actor it was sent to (a restart replaces it)
        self.attempts = 0


class _FetchLoop:
    """What both fetch threads share: sliced waits that notice ``stop``, failures carried over."""

    def __init__(self, pool: WorkerPool, stop: threading.Event) -> None:
        self._pool = pool
        self._stop = stop

    def run(self) -> None:
        try:
            self._loop()
        except _Stopped:
            pass
        except BaseException as err:
            with contextlib.suppress(_Stopped):  # closed meanwhile: nobody is waiting for it
                self._put(Failure(err))

    def _loop(self) -> None:
        raise NotImplementedError

    def _put(self, item: Any) -> None:
        raise NotImplementedError

    def _between_slices(self) -> None:
        """Called while a wait goes on; raises :class:`_Stopped` once the iterator is closed."""
        if self._stop.is_set():
            raise _Stopped

    def _get(self, ref: Any, what: Callable[[], str], worker_id: int, retries: int) -> Any:
        """``ray.get`` in slices, with readable errors for dead workers.

        ``what`` describes the batch (called only for an error message). No
        timeout here: torch's ``timeout`` bounds how long the trainer waits in
        ``next()`` (see :func:`take`), not how long a batch takes to load while
        the trainer is busy.
        """
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        while True:
            try:
                return ray.get(ref, timeout=WAIT_SLICE_S)
            except GetTimeoutError:
                self._between_slices()
            except RayActorError as err:
                raise WorkerDiedError(
                    f"Ray worker {worker_id} died while loading {what()} "
                    f"(retried {retries} times on a fresh worker; {type(err).__name__}). If "
                    "this input crashes the worker process every time (os._exit, a segfault "
                    "in a decoder, out of memory), fix or remove it; the worker's own log is "
                    "in Ray's session directory (/tmp/ray/session_latest/logs)."
                ) from err
            except RayTaskError as err:
                raise err.as_instanceof_cause() from None


class MapStyleFetcher(_FetchLoop):
    """The body of a map-style epoch's fetch thread.

    The trainer puts each batch's indices on ``requests`` (and
    :data:`END_OF_REQUESTS` once its sampler is exhausted). The thread sends each to
    the next worker round-robin as soon as it arrives, and puts the converted
    results on ``results`` in request order (or as they finish, ``in_order=False``),
    then :data:`DONE`. The trainer sends a request per batch it takes, so at most
    ``num_workers * prefetch_factor`` batches are in flight or waiting, as in torch.

    A worker that dies mid-epoch (SIGKILL, OOM) is replaced and its fetches are sent
    again (a fetch is a pure function of its indices), at most
    :data:`~raydl._internal.workers.pool.MAX_TASK_RETRIES` times per batch.
    """

    def __init__(
        self,
        pool: WorkerPool,
        requests: queue.SimpleQueue[Any],
        results: queue.SimpleQueue[Any],
        stop: threading.Event,
        *,
        in_order: bool,
    ) -> None:
        super().__init__(pool, stop)
        self._requests = requests
        self._results = results
        self._in_order = in_order
        self._pending: deque[_Fetch] = deque()
        self._next_worker = 0
        self._requests_ended = False

    def _put(self, item: Any) -> None:
        self._results.put(item)

    def _loop(self) -> None:
        while True:
            self._take_requests(block=not self._pending)
            if not self._pending:
                if self._requests_ended:
                    self._put(DONE)
                    return
                continue
            fetch = self._pending[0] if self._in_order else self._first_ready()
            result = self._collect(fetch)
            self._pending.remove(fetch)
            self._resubmit_held(fetch.worker_id)
            self._put(unwrap(result))

    def _between_slices(self) -> None:
        super()._between_slices()
        self._take_requests(block=False)

    def _take_requests(self, *, block: bool) -> None:
        """Send every request waiting on the queue to a worker (waiting for one if ``block``)."""
        while not self._requests_ended:
            if self._stop.is_set():  # closing: start no more tasks
                raise _Stopped
            try:
                if block:
                    indices = self._requests.get(timeout=WAIT_SLICE_S)
                else:
                    indices = self._requests.get_nowait()
            except queue.Empty:
                if block:
                    continue  # the loop's head looks at stop
                return
            if indices is END_OF_REQUESTS:
                self._requests_ended = True
                return
            self._send(indices)
            block = False

    def _describe(self, indices: Any) -> str:
        return describe_indices(indices)

    def _send(self, indices: Any) -> None:
        """Send one request to the next worker, round-robin."""
        if not self._pool.actors:
            raise stopped_error()
        worker_id = self._next_worker
        self._next_worker = (self._next_worker + 1) % len(self._pool)
        actor = self._pool.actors[worker_id]
        self._pending.append(_Fetch(actor.fetch.remote(indices), indices, worker_id, actor))

    def _collect(self, fetch: _Fetch) -> Any:
        from ray.exceptions import RayActorError

        while True:
            try:
                return self._get(
                    fetch.ref,
                    lambda: self._describe(fetch.indices),
                    fetch.worker_id,
                    fetch.attempts,
                )
            except WorkerDiedError as err:
                dead = err.__cause__
                if not isinstance(dead, RayActorError) or fetch.attempts >= MAX_TASK_RETRIES:
                    raise
                fetch.attempts += 1
                self._replace_worker(fetch)

    def _replace_worker(self, failed: _Fetch) -> None:
        """Start a fresh worker and retry ``failed`` on it alone.

        The dead worker's other batches are held back until the retry succeeds. A
        worker killed by batch B may take the already computed reply of the batch
        before B down with it; retried together, that batch would fail again each
        time and be blamed for B. Alone, it succeeds, and B is retried by itself.
        """
        actor = self._pool.restart(failed.worker_id, failed.actor)
        for fetch in self._pending:
            if fetch.worker_id == failed.worker_id:
                fetch.ref = None
        failed.actor = actor
        failed.ref = actor.fetch.remote(failed.indices)

    def _resubmit_held(self, worker_id: int) -> None:
        actor = self._pool.actors[worker_id]
        for fetch in self._pending:
            if fetch.worker_id == worker_id and fetch.ref is None:
                fetch.actor = actor
                fetch.ref = actor.fetch.remote(fetch.indices)

    def _first_ready(self) -> _Fetch:
        import ray

        while True:
            refs = [fetch.ref for fetch in self._pending]
            waiting = [ref for ref in refs if ref is not None]
            ready, _ = ray.wait(waiting, num_returns=1, timeout=WAIT_SLICE_S)
            if ready:
                return self._pending[refs.index(ready[0])]
            self._between_slices()


class DirectFetcher(MapStyleFetcher):
    """The body of a direct epoch's thread (see :mod:`~raydl._internal.epochs.direct`).

    Sends the epoch's runs of files to the pool's actors, ``window`` in flight,
    takes their blocks in order, cuts them into batches with ``cut``, drops the
    first ``skip`` (a resume), converts the rest with ``collate`` and puts them
    on the bounded ``results`` queue, then :data:`DONE`. Worker deaths are
    handled as for map-style batches (a run is a pure function of its files).
    Once every run is sent, ``start_next`` is asked to start the next epoch
    (and asked again at each block while it answers ``False``: too soon). Fewer
    runs are in flight when loaded runs are large: at most
    :data:`~raydl._internal.epochs.direct.WINDOW_BYTES` by the largest run seen so far.
    """

    def __init__(
        self,
        pool: WorkerPool,
        runs: Sequence[Any],
        results: queue.Queue[Any],
        stop: threading.Event,
        *,
        window: int,
        cut: Callable[[Iterator[Any]], Iterator[Any]],
        collate: Callable[[Any], Any],
        skip: int,
        start_next: Callable[[], bool] | None,
    ) -> None:
        super().__init__(pool, queue.SimpleQueue(), queue.SimpleQueue(), stop, in_order=True)
        self._runs = runs
        self._out = results
        self._window = max(1, window)
        self._cut = cut
        self._collate = collate
        self._skip = skip
        self._start_next = start_next
        self.blocks = 0  # blocks received so far (for the epoch's summary)
        self._largest = 0  # bytes of the largest loaded run so far

    def _put(self, item: Any) -> None:
        if not put_until_stopped(self._out, item, self._stop):
            raise _Stopped

    def _describe(self, indices: Any) -> str:
        return describe_run(indices[1])

    def _loop(self) -> None:
        for position, batch in enumerate(self._cut(self._blocks())):
            if position >= self._skip:
                self._put(self._collate(batch))
        self._put(DONE)

    def _blocks(self) -> Iterator[Any]:
        runs = iter(self._runs)
        sent_all = False
        window = self._window
        while True:
            while not sent_all and len(self._pending) < window:
                run = next(runs, None)
                if run is None:
                    sent_all = True
                else:
                    self._send(run)
            start = self._start_next
            if sent_all and start is not None and not self._stop.is_set() and start():
                self._start_next = None
            if not self._pending:
                return
            fetch = self._pending[0]
            result = self._collect(fetch)
            self._pending.popleft()
            self._resubmit_held(fetch.worker_id)
            blocks = unwrap(result)
            self.blocks += len(blocks)
            self._largest = max(self._largest, loaded_bytes(blocks))
            window = max(1, min(self._window, WINDOW_BYTES // max(1, self._largest)))
            yield from blocks


class IterableFetcher(_FetchLoop):
    """The body of an iterable epoch's fetch thread.

    Takes batches from the workers round-robin, skipping exhausted ones (torch's
    order), keeps ``prefetch`` ``next_batch`` calls in flight per worker and puts the
    converted batches on the bounded ``results`` queue, then :data:`DONE`. A worker
    that dies is reported at once: it held a position in a stream a restart would lose.
    """

    def __init__(
        self,
        pool: WorkerPool,
        results: queue.Queue[Any],
        stop: threading.Event,
        *,
        prefetch: int,
    ) -> None:
        super().__init__(pool, stop)
        self._results = results
        self._prefetch = max(1, prefetch)

    def _put(self, item: Any) -> None:
        if not put_until_stopped(self._results, item, self._stop):
            raise _Stopped

    def _loop(self) -> None:
        actors = self._pool.actors
        pending = [
            deque(actor.next_batch.remote() for _ in range(self._prefetch)) for actor in actors
        ]
        active = list(range(len(actors)))
        cursor = 0
        while active:
            cursor %= len(active)
            worker_id = active[cursor]
            result = self._get(pending[worker_id].popleft(), _next_batch, worker_id, 0)
            if isinstance(result, str) and result == EXHAUSTED:
                pending[worker_id].clear()
                del active[cursor]
                continue
            pending[worker_id].append(actors[worker_id].next_batch.remote())
            cursor += 1
            self._put(unwrap(result))
        self._put(DONE)


def _next_batch() -> str:
    return "the next batch"


def take(
    results: queue.Queue[Any] | queue.SimpleQueue[Any],
    thread: threading.Thread,
    timeout: float,
    stop: threading.Event,
) -> Any:
    """The next item a fetch thread queued, waiting at most ``timeout`` seconds (0: no bound).

    Raises torch's timeout error when the wait runs out, ``StopIteration`` once
    ``stop`` is set (the iterator was closed from another thread), and an error if
    the thread ended without queueing anything.
    """
    deadline = time.monotonic() + timeout if timeout > 0 else None
    wait = WAIT_SLICE_S * 4  # between looks at stop and at the thread
    while True:
        if deadline is not None:
            wait = min(wait, max(0.0, deadline - time.monotonic()))
        try:
            return results.get(timeout=wait)
        except queue.Empty:
            pass
        if stop.is_set():
            raise StopIteration
        if not thread.is_alive():
            try:
                return results.get_nowait()
            except queue.Empty:
                raise RuntimeError(
                    f"raydl's {thread.name} thread ended without a result; this is a bug "
                    "in raydl, please report it with the loader's arguments"
                ) from None
        if deadline is not None and time.monotonic() >= deadline:
            raise timeout_error(timeout)
