"""Producers over raydl's own Ray actors: map-style, iterable and direct-run epochs.

A training loop that sleeps in its step (waiting on the GPU) and then asks for a
batch should find it ready, converted, in a queue: no Ray call on its critical
path. On a small VM every Ray call made right after such a pause wakes several
of Ray's threads and processes, and each wake-up costs (measured here after a
27 ms step: a ready ``ray.get`` 1.4-1.7 ms, an actor task submission 1.2-1.4 ms,
against ~0.1 ms back to back). So each epoch runs one named thread that submits
the workers' tasks, waits for their results, converts them to tensors and hands
them over; the trainer's ``next()`` takes the head of that hand-off.

What stays on the trainer's thread, as in torch: iterating the sampler (a sampler
that draws from torch's global RNG draws in the same order relative to the
training loop as under torch), and starting an iterable epoch.

Every reply these producers take was made by raydl's actors for this epoch's
consumer alone, so it is converted as *owned* (``workers/convert.py``): its
tensors are made over the object store's memory, without a copy.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from raydl._internal.stream.autotune import AutoTuner
from raydl._internal.stream.batching import skip_consumed
from raydl._internal.stream.dispatch import (
    FIRST_READY_WAIT_S,
    ActorStart,
    Calls,
    Dispatcher,
    Pool,
    RayCalls,
    get_sliced,
)
from raydl._internal.stream.epoch_iterator import Producer
from raydl._internal.stream.handoff import SLICE_S, Handoff, ItemError, Stopped
from raydl._internal.stream.in_process import LengthWatch
from raydl._internal.stream.worker_states import NO_STATE, Snapshot, StateTracker
from raydl._internal.workers.convert import numpy_to_tensors
from raydl._internal.workers.emulated import EmulatedWorkers
from raydl._internal.workers.failure import RemoteError
from raydl._internal.workers.stateful import StateRequest, WithState
from raydl._internal.workers.worker import EXHAUSTED, InitError, describe_indices, killed_by
from raydl.errors import WorkerDiedError

#: The trainer's message that the sampler is exhausted: no more requests will come.
END_OF_REQUESTS = object()


def unwrap(result: Any) -> Any:
    """A worker's reply as tensors, or the worker's exception raised (a ``RemoteError``).

    The reply is this consumer's alone: converted without a copy (``owned``).
    """
    if isinstance(result, RemoteError):
        result.reraise()
    return numpy_to_tensors(result, owned=True)


def in_torch_words(err: BaseException) -> BaseException:
    """A worker's death named as torch names it ("DataLoader worker (pid N) is killed by ...")."""
    if not isinstance(err, WorkerDiedError):
        return err
    words = killed_by(err.__cause__)
    if not words:
        return err
    named = type(err)(f"{words} {err}")
    named.__cause__ = err.__cause__
    return named


def batch_item(result: Any) -> Any:
    """A worker's reply to one batch as the item handed over: tensors, or an ``ItemError``.

    A user's exception in one batch travels as an item (``next()`` raises it and
    the epoch goes on, as in torch); a worker that failed to start
    (:class:`~raydl._internal.workers.worker.InitError`) can load nothing more, so
    its exception is raised here and ends the epoch.
    """
    if isinstance(result, InitError):
        result.reraise()
    if isinstance(result, RemoteError):
        return ItemError(result)
    return numpy_to_tensors(result, owned=True)  # this consumer's alone: no copy


class PoolProducer(Producer):
    """A producer whose pool is handed back (``on_close``) when the epoch ends."""

    def __init__(self, on_close: Callable[[], None] | None) -> None:
        self._on_close = on_close

    def _check_stop(self) -> None:
        if self.handoff.stopped:
            raise Stopped

    def release(self) -> None:
        if self._on_close is not None:
            self._on_close()


class _Taken:
    """The trainer's message that it took a batch after waiting ``waited`` s, at ``at``."""

    __slots__ = ("at", "waited")

    def __init__(self, waited: float, at: float) -> None:
        self.waited, self.at = waited, at


class _PoolReady:
    """The trainer's message that the epoch's pool exists now (its start ended), with its rule."""

    __slots__ = ("pool", "tuner")

    def __init__(self, pool: Pool, tuner: AutoTuner | None) -> None:
        self.pool, self.tuner = pool, tuner


#: Batches handed to the trainer to load and not loaded yet, at most: once the actors
#: answer, the trainer loads these before they take over.
HERE_AHEAD = 2


#: The trainer's message that it loaded one of the batches handed to it to load.
_LOADED_HERE = object()


class LoadHere:
    """A batch the trainer loads itself, as worker ``worker_id`` (its actors still start)."""

    __slots__ = ("indices", "worker_id")

    def __init__(self, indices: Any, worker_id: int) -> None:
        self.indices, self.worker_id = indices, worker_id


class MapStyleProducer(PoolProducer):
    """A map-style epoch: the trainer draws index batches, a fetch thread loads them.

    The sampler is iterated on the trainer's thread, as torch does: ``lookahead``
    requests first, then one per batch taken, so at most ``lookahead`` batches are
    in flight or waiting. ``index_iter`` yields ``(position, indices)``: each
    batch's place in the epoch (a resumed epoch's are not contiguous), which
    :attr:`handed` records in hand-over order. The fetch thread sends each request
    to the next worker as soon as it arrives and hands the converted replies over in
    request order; with ``in_order=False``, as they finish, each request going to
    the worker with the fewest in flight (torch's rule). A worker that dies is replaced and
    its requests re-sent (see :class:`~raydl._internal.stream.dispatch.Dispatcher`).
    A batch whose loading raised is handed over as an ``ItemError`` in its place.

    With a ``tuner`` (``num_workers="auto"`` / ``prefetch_factor="auto"``, see
    :mod:`~raydl._internal.stream.autotune`) the trainer draws ``tuner.max_depth``
    ahead and tells the fetch thread each wait (a :class:`_Taken` on the same
    queue as the requests). The fetch thread owns the rule: it feeds it the waits,
    sends a request only while fewer than ``tuner.depth`` are requested and not
    taken, starts the workers the rule asks for (``pool.add()``) and sends to a
    new one only once it answers ``ready``. Which worker loads a batch changes;
    which indices make the batch, and its place in the epoch, do not.

    With ``here`` (the pool's :class:`~raydl._internal.workers.emulated.EmulatedWorkers`)
    and ``start_of`` (a pool's :class:`ActorStart`), the first batches load in the trainer
    while the actors start: until the pool exists (``pool=None``: the trainer's
    ``acquire()`` returns it and its rule once the loader's start has made it; it may
    raise that start's error) and every actor answered ``ready``, the fetch thread
    hands the requests over in order, :data:`HERE_AHEAD` at a time, each as a
    :class:`LoadHere`, which :meth:`deliver` loads on the trainer's thread as worker
    ``k % num_workers`` would. Then it holds the requests until the trainer has loaded
    those, hands each worker's RNG states to its actor (``continue_from``) and sends
    the rest round-robin from the next worker on, so every batch comes from the
    worker torch would have used, with the same draws. With ``num_workers="auto"``
    the trainer stands in for the rule's first worker alone (worker 0: which worker
    loads a batch varies with the rule anyway); with a ``tuner`` the rule starts
    measuring at the hand-over.
    """

    def __init__(
        self,
        pool: Pool | None,
        index_iter: Iterator[Any],
        *,
        lookahead: int,
        in_order: bool,
        on_close: Callable[[], None] | None = None,
        calls: Calls | None = None,
        tuner: AutoTuner | None = None,
        epoch: int = 0,
        here: EmulatedWorkers | None = None,
        start_of: Callable[[Any], ActorStart] | None = None,
        acquire: Callable[[], tuple[Pool, AutoTuner | None] | None] | None = None,
        states: StateTracker | None = None,
    ) -> None:
        super().__init__(on_close)
        self.handoff = Handoff()  # bounded by the requests the trainer makes
        self.states = states  # a Stateful dataset's snapshots (no stand-ins then)
        self._index_iter = index_iter
        self._in_order = in_order
        self._sampler_done = False
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._requests_ended = False
        self._calls = calls or RayCalls()
        self._pool: Pool | None = None
        self._dispatch: Dispatcher | None = None
        self._here = here if start_of is not None else None  # the fetch thread's, once started
        self._stand_ins = self._here  # the trainer's
        self.loads_in_deliver = self._here is not None
        # The workers the trainer loads as, in turn: torch's round-robin over a fixed count,
        # or (num_workers="auto": which worker loads a batch varies) the rule's first alone.
        auto_workers = tuner is not None and tuner.auto_workers
        self._here_width = 1 if auto_workers or here is None else here.spec.num_workers
        self._start_of = start_of
        self.loaded_here = 0  # batches the trainer loaded (its thread)
        self._acquire = acquire
        self._handed_here = 0  # LoadHere items handed over (fetch thread)
        self._loaded_here = 0  # of which the trainer said it loaded (fetch thread)
        self._tuner = tuner  # the fetch thread's (the pool's own replaces it at _PoolReady)
        self._measured = tuner is not None  # the trainer's: tell the fetch thread each wait
        self._epoch = epoch
        self._held: deque[tuple[int, Any]] = deque()  # (position, indices) not sent yet
        #: The epoch positions of the batches handed over, in hand-over order (the fetch
        #: thread appends; the trainer reads the first ones it took: a state's record).
        self.handed: list[int] = []
        self._takes = 0  # batches the trainer took (the first `_handed_here` it loaded)
        self._sent = self._taken = 0  # requests sent to the actors, and of those taken
        self._extra = 0  # requests a device copy stage holds, on top of the tuner's depth
        self._starting: deque[tuple[int, Any]] = deque()  # (worker id, its `ready` reply)
        self._asked = 0
        if tuner is not None:
            self._extra = max(0, lookahead - tuner.depth)
            lookahead = tuner.max_depth + self._extra
        if pool is not None:
            self._set_pool(pool, tuner)
        # Batches loaded again and dropped (a resume of Stateful workers) take no place.
        for _ in range(max(1, lookahead) + (len(states.drop) if states is not None else 0)):
            self._request()
        self.handoff.start(
            self._loop, name="raydl-map-style-fetcher", describe_error=in_torch_words
        )

    def _set_pool(self, pool: Pool, tuner: AutoTuner | None) -> None:
        self._pool = pool
        if tuner is not None:
            assert self._measured, "a pool with a rule, for a producer built without one"
            self._tuner = tuner
        if self._here is None:
            base = self.states.base if self.states is not None else None
            self._start_dispatch(first_worker=base.next_worker if base is not None else 0)

    def _start_dispatch(self, first_worker: int) -> None:
        """Requests go to the actors from now on; the rule, if any, measures from here."""
        assert self._pool is not None
        if self.states is not None:
            self._start_states(first_worker)
        self._dispatch = Dispatcher(
            self._pool,
            self._calls,
            in_order=self._in_order,
            method="fetch",
            describe=describe_indices,
            between=self._between,
            first_worker=first_worker,
        )
        tuner = self._tuner
        if tuner is not None:
            tuner.start_epoch(self._epoch)
            self._dispatch.width = tuner.workers
            self._asked = tuner.workers  # the next worker to ask `ready` of, once wanted

    def _start_states(self, first_worker: int) -> None:
        """Restore a resumed epoch's worker states, or note a fresh epoch's as its base."""
        assert self._pool is not None and self.states is not None
        actors = self._pool.actors
        base = self.states.base
        if base is not None:  # queued before any fetch: each actor runs its calls in order
            for actor, state in zip(actors, base.states, strict=False):
                self._calls.submit(actor, "load_worker_state", state)
            return
        refs = [self._calls.submit(actor, "worker_state") for actor in actors]
        states = [
            get_sliced(
                self._calls,
                ref,
                between=self._check_stop,
                what=lambda: "its state",
                worker_id=worker_id,
                retries=0,
            )
            for worker_id, ref in enumerate(refs)
        ]
        self.states.base = Snapshot(0, first_worker, states)

    def summary(self) -> str | None:
        if not self.loaded_here:
            return None
        return f"{self.loaded_here} batches loaded in the training process while the actors started"

    # -- the trainer's thread ---------------------------------------------------------

    def deliver(self, item: Any) -> Any:
        if self._acquire is not None:
            acquired = self._acquire()  # raises the start's error
            if acquired is not None:
                self._acquire = None
                self._requests.put(_PoolReady(*acquired))
        if not isinstance(item, LoadHere):
            return item
        assert self._stand_ins is not None
        batch = self._stand_ins.fetch(item.indices, item.worker_id)
        self.loaded_here += 1
        self._requests.put(_LOADED_HERE)
        return ItemError(batch) if isinstance(batch, RemoteError) else batch

    def taken(self, waited: float) -> None:
        if self._measured:
            self._requests.put(_Taken(waited, time.perf_counter()))
        self._request()  # torch draws the next indices once a batch has arrived

    def _request(self) -> None:
        """Draw the next batch of indices from the sampler and hand it to the fetch thread."""
        if self._sampler_done:
            return
        try:
            request = next(self._index_iter)  # (position, indices)
        except StopIteration:
            self._sampler_done = True
            self._requests.put(END_OF_REQUESTS)
            return
        self._requests.put(request)

    # -- the fetch thread -----------------------------------------------------------

    def _loop(self) -> None:
        while True:
            self._take_requests(block=not self._dispatch)
            if not self._dispatch:
                # Every request handed over (to the trainer, or collected): done. Requests
                # held while the trainer loads its last ones wait for the actors.
                if self._requests_ended and not self._held:
                    return
                continue
            position, worker, reply = self._dispatch.collect_tagged(in_order=self._in_order)
            if self.states is not None:
                state = NO_STATE
                if isinstance(reply, WithState):
                    reply, state = reply.reply, reply.state
                self.states.loaded(position, worker, state)
                if position in self.states.drop:
                    self._taken += 1  # loaded again for the workers' states alone
                    continue
            self.handed.append(position)
            self.handoff.put(batch_item(reply))

    def _between(self) -> None:
        self._check_stop()
        self._take_requests(block=False)

    def _take_requests(self, *, block: bool) -> None:
        """Send every request waiting on the queue to a worker (waiting for one if ``block``)."""
        while True:
            self._check_stop()  # closing: start no more tasks
            self._tune()
            self._leave_here()
            self._hand_here()
            if self._dispatch:
                block = False  # requests in flight: the caller collects them
            if self._requests_ended and not self._held:
                block = False  # only the trainer's waits can still come: nothing to wait for
            try:
                message = (
                    self._requests.get(timeout=SLICE_S) if block else self._requests.get_nowait()
                )
            except queue.Empty:
                if block and not self._requests_ended:
                    continue  # the loop's head looks at stop
                if block and self._here is not None:
                    continue  # held requests wait for the trainer's loads
                return
            if isinstance(message, _Taken):
                self._takes += 1
                if self._takes > self._handed_here:  # not one the trainer loaded itself
                    self._taken += 1
                    assert self._tuner is not None
                    self._tuner.observe(waited=message.waited, at=message.at)
            elif isinstance(message, _PoolReady):
                self._set_pool(message.pool, message.tuner)
            elif message is _LOADED_HERE:
                self._loaded_here += 1
            elif message is END_OF_REQUESTS:
                self._requests_ended = True
            else:
                self._held.append(message)
            self._hand_here()
            self._send_held()
            block = False

    def _send_held(self) -> None:
        if self._dispatch is None:
            return  # still handing requests over to the trainer
        depth = self._tuner.depth + self._extra if self._tuner is not None else None
        while self._held and (depth is None or self._sent - self._taken < depth):
            position, indices = self._held.popleft()
            if self.states is not None and self.states.asks(position):
                indices = StateRequest(indices)
            self._dispatch.send(indices, tag=position)
            self._sent += 1

    # -- the first batches, loaded by the trainer -------------------------------------

    def _loads_here(self) -> bool:
        """Whether the next request goes to the trainer: the pool's actors still start."""
        if self._here is None:
            return False
        if self._pool is None:
            return True
        assert self._start_of is not None
        start = self._start_of(self._pool)
        return start.starting(self._pool, self._calls, first_wait=FIRST_READY_WAIT_S)

    def _leave_here(self) -> None:
        """Once the trainer loaded what it was handed and the actors are up, go to them."""
        here = self._here
        if here is None or self._pool is None or self._loads_here():
            return
        if self._loaded_here < self._handed_here:
            return  # its RNG states are final only once it loaded them all
        actors = self._pool.actors
        for worker_id, states in here.handover().items():
            if worker_id < len(actors):
                self._calls.submit(actors[worker_id], "continue_from", states)
        self._here = None
        self._start_dispatch(first_worker=self._handed_here % self._here_width)
        self._send_held()

    def _hand_here(self) -> None:
        """While the actors start, hand the held requests to the trainer, in order."""
        while (
            self._held and self._handed_here - self._loaded_here < HERE_AHEAD and self._loads_here()
        ):
            worker_id = self._handed_here % self._here_width
            self._handed_here += 1
            position, indices = self._held.popleft()
            self.handed.append(position)
            self.handoff.put(LoadHere(indices, worker_id))

    # -- num_workers="auto" -----------------------------------------------------------

    def _tune(self) -> None:
        """Start the workers the rule asks for; admit each one that answers, in id order."""
        tuner, pool, dispatch = self._tuner, self._pool, self._dispatch
        if tuner is None or dispatch is None:
            return  # no rule, or the trainer still loads the first batches
        assert pool is not None
        while len(pool.actors) < tuner.started:
            pool.add()  # type: ignore[attr-defined]  # a WorkerPool
        actors = pool.actors  # once: kill() may swap the list meanwhile
        while self._asked < min(tuner.want, len(actors)):
            actor = actors[self._asked]
            self._starting.append((self._asked, self._calls.submit(actor, "ready")))
            self._asked += 1
        while self._starting:
            worker_id, ref = self._starting[0]
            if worker_id >= tuner.want:  # the rule went back meanwhile
                self._starting.clear()
                self._asked = tuner.want
                break
            if not self._calls.wait([ref], 0):
                break
            self._starting.popleft()
            tuner.admitted(worker_id + 1, at=time.perf_counter())
        if dispatch.width != tuner.workers:
            dispatch.width = tuner.workers
        self._send_held()


class IterableProducer(PoolProducer):
    """An ``IterableDataset`` epoch: each actor iterates its own copy of the dataset.

    The fetch thread takes batches from the workers round-robin, skipping exhausted
    ones (torch's order), keeps ``prefetch`` ``next_batch`` calls in flight per
    worker and hands over the converted batches (one queued, one waiting to be).
    A worker that dies is reported at once: it held a position in a stream that a
    restart would lose. A batch whose iterator raised is handed over as an
    ``ItemError`` and that worker goes on with its iterator, as in torch.
    ``skip``: batches to read and drop first (a resume; exact for deterministic
    datasets). ``shared_seed``: the epoch's seed of a DataPipe's shufflers, sent
    to every worker. ``watch``: torch's warning past the reported length.
    """

    def __init__(
        self,
        pool: Pool,
        *,
        prefetch: int,
        skip: int = 0,
        on_close: Callable[[], None] | None = None,
        calls: Calls | None = None,
        shared_seed: int | None = None,
        watch: LengthWatch | None = None,
        states: StateTracker | None = None,
    ) -> None:
        super().__init__(on_close)
        self._pool = pool
        self._calls = calls or RayCalls()
        self._prefetch = max(1, prefetch)
        self._skip = skip
        self._watch = watch
        self.handoff = Handoff(maxsize=1)
        # Started on the trainer's thread, as torch starts its workers' iterators; a
        # resume of Stateful workers starts each from its saved state.
        base = states.base if states is not None else None
        restore = base.states if base is not None else [None] * len(pool.actors)
        refs = [
            self._calls.submit(actor, "start_iteration", shared_seed, state)
            for actor, state in zip(pool.actors, restore, strict=False)
        ]
        initial = [self._get(ref, worker_id, what=_start) for worker_id, ref in enumerate(refs)]
        if states is not None and base is None:
            if any(state is not None for state in initial):
                states.base = Snapshot(0, 0, initial)  # where each worker's pass started
            else:
                states = None  # nothing in these workers is Stateful
        self.states = states
        self.handoff.start(self._loop, name="raydl-iterable-fetcher", describe_error=in_torch_words)

    def taken(self, waited: float) -> None:
        if self._watch is not None:
            self._watch.count()

    def _get(self, ref: Any, worker_id: int, what: Callable[[], str] | None = None) -> Any:
        return get_sliced(
            self._calls,
            ref,
            between=self._check_stop,
            what=what or _next_batch,
            worker_id=worker_id,
            retries=0,
        )

    def _loop(self) -> None:
        for batch in skip_consumed(self._batches(), self._skip):
            self.handoff.put(batch)

    def _batches(self) -> Iterator[Any]:
        """The workers' batches round-robin (from ``states.base``'s worker on a resume)."""
        actors = self._pool.actors
        states = self.states
        base = states.base if states is not None else None
        position = first = base.step if base is not None else 0
        calls = [0] * len(actors)  # next_batch calls sent to each worker

        def submit(worker_id: int) -> Any:
            # The position its reply will most likely have (the round-robin goes on).
            ahead = (worker_id - (base.next_worker if base else 0)) % len(actors)
            expected = first + calls[worker_id] * len(active) + ahead
            calls[worker_id] += 1
            asks = states is not None and states.asks(expected)
            return self._calls.submit(actors[worker_id], "next_batch", asks)

        active = list(range(len(actors)))
        pending = [deque(submit(w) for _ in range(self._prefetch)) for w in range(len(actors))]
        cursor = active.index(base.next_worker) if base is not None else 0
        while active:
            cursor %= len(active)
            worker_id = active[cursor]
            result = self._get(pending[worker_id].popleft(), worker_id)
            state = NO_STATE
            if isinstance(result, WithState):
                result, state = result.reply, result.state
            if isinstance(result, str) and result == EXHAUSTED:
                pending[worker_id].clear()
                del active[cursor]
                continue
            pending[worker_id].append(submit(worker_id))
            cursor += 1
            if states is not None:
                states.loaded(position, worker_id, state)
            position += 1
            yield batch_item(result)


def _next_batch() -> str:
    return "the next batch"


def _start() -> str:
    return "the start of its iteration (unpickling the dataset, worker_init_fn)"
