"""Requests to a pool of workers: round-robin sends, ordered collection, retries.

The logic runs over two small interfaces, so unit tests drive it without Ray:

* :class:`Calls`: submit a method call to an actor, get a result (in slices of
  at most a timeout), wait for the first of several results. :class:`RayCalls`
  is the real one; a worker's death surfaces as :class:`WorkerLost`, a task's
  exception as the exception itself.
* a pool: ``actors`` (a list, emptied by ``close()``), ``restart(worker_id,
  dead)`` returning the worker's new actor, and ``len()``
  (:class:`~raydl._internal.workers.pool.WorkerPool`).

A :class:`Dispatcher` sends each request to the next worker round-robin and
collects replies in request order (or the first one ready). A worker that dies
mid-request is replaced and the request re-sent on the new worker alone, at most
``retries`` times; the dead worker's other requests are held back until that retry
succeeds (a worker killed by request B may take the reply of the request before
B down with it: retried together, that request would fail each time and be
blamed for B). Requests are pure functions of their argument, so nothing is
lost or duplicated.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from raydl._internal.workers.pool import MAX_TASK_RETRIES, stopped_error
from raydl.errors import WorkerDiedError


class WorkerLost(Exception):
    """The actor running a call died (:class:`Calls` raises it from ``get``)."""


class ResultTimeout(Exception):
    """A ``get`` or ``wait`` slice ran out (:class:`Calls` raises it from ``get``)."""


class Calls(Protocol):
    """How work reaches the workers; :class:`RayCalls` in production, fakes in tests."""

    def submit(self, actor: Any, method: str, *args: Any) -> Any:
        """Start ``actor.method(*args)``; a reference to its result."""
        ...

    def get(self, ref: Any, timeout: float) -> Any:
        """The result of ``ref`` within ``timeout`` seconds.

        Raises:
            ResultTimeout: Not ready yet.
            WorkerLost: The actor died.
        """
        ...

    def wait(self, refs: Sequence[Any], timeout: float) -> list[Any]:
        """Those of ``refs`` that are ready (at least one, unless ``timeout`` ran out)."""
        ...


class Pool(Protocol):
    """The workers a :class:`Dispatcher` sends to."""

    actors: list[Any]

    def restart(self, worker_id: int, dead: Any) -> Any:
        """Replace ``dead``, worker ``worker_id``'s actor; that worker's actor now."""
        ...

    def __len__(self) -> int: ...


class RayCalls:
    """:class:`Calls` over Ray actors."""

    def submit(self, actor: Any, method: str, *args: Any) -> Any:
        return getattr(actor, method).remote(*args)

    def get(self, ref: Any, timeout: float) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(ref, timeout=timeout)
        except GetTimeoutError:
            raise ResultTimeout from None
        except RayActorError as err:
            raise WorkerLost(type(err).__name__) from err
        except RayTaskError as err:
            raise err.as_instanceof_cause() from None

    def wait(self, refs: Sequence[Any], timeout: float) -> list[Any]:
        import ray

        ready, _ = ray.wait(list(refs), num_returns=1, timeout=timeout)
        return list(ready)


class SplitCalls(RayCalls):
    """:class:`RayCalls` for calls that reply with ``num_returns`` Ray objects: a head, then the rest.

    ``get`` fetches the head only and returns ``(head, [references to the rest])``:
    the rest stays in the object store, owned by this process (it outlives the
    actor that made it).
    """

    def __init__(self, num_returns: int) -> None:
        self._num_returns = num_returns

    def submit(self, actor: Any, method: str, *args: Any) -> Any:
        return getattr(actor, method).options(num_returns=self._num_returns).remote(*args)

    def get(self, ref: Any, timeout: float) -> Any:
        return super().get(ref[0], timeout), list(ref[1:])

    def wait(self, refs: Sequence[Any], timeout: float) -> list[Any]:
        ready = super().wait([ref[0] for ref in refs], timeout)
        return [ref for ref in refs if ref[0] in ready]


class _Stream:
    """A streaming call in flight: its ``ObjectRefGenerator``, the parts taken so far."""

    __slots__ = ("generator", "parts", "taken")

    def __init__(self, generator: Any) -> None:
        self.generator = generator
        self.parts: list[Any] = []  # the reply so far: the parts' items, in order
        self.taken: Any = None  # a part's reference taken from the generator, not yet fetched


class StreamedCalls(RayCalls):
    """:class:`RayCalls` where ``method`` replies in parts (``num_returns="streaming"``).

    ``get`` joins the parts (lists) into the reply; a part that is not a list (a
    failed reply) is the reply. The parts are Ray objects this process owns, as a
    call's return is: they outlive the actor that made it. The actor sends each
    part before it makes the next, so it holds one part at a time, not the reply.
    While :attr:`stream` is false, ``method`` is called as ``whole`` instead, a plain
    call whose one return is the reply: each Ray object costs milliseconds of CPU, and
    a streaming call more than one, so replies known to fit in a part go whole.
    """

    def __init__(self, method: str, whole: str) -> None:
        self._method = method
        self._whole = whole
        self.stream = True

    def submit(self, actor: Any, method: str, *args: Any) -> Any:
        if method != self._method:
            return super().submit(actor, method, *args)
        if not self.stream:
            return super().submit(actor, self._whole, *args)
        return _Stream(getattr(actor, method).options(num_returns="streaming").remote(*args))

    def get(self, ref: Any, timeout: float) -> Any:
        if not isinstance(ref, _Stream):
            return super().get(ref, timeout)
        import ray
        from ray.exceptions import RayActorError

        deadline = time.monotonic() + timeout
        while True:
            if ref.taken is None:
                left = max(0.0, deadline - time.monotonic())
                if not ray.wait([ref.generator], num_returns=1, timeout=left)[0]:
                    raise ResultTimeout
                try:
                    ref.taken = next(ref.generator)
                except StopIteration:
                    return ref.parts
                except RayActorError as err:
                    raise WorkerLost(type(err).__name__) from err
            part = super().get(ref.taken, max(0.0, deadline - time.monotonic()))
            ref.taken = None
            if not isinstance(part, list):
                return part
            ref.parts.extend(part)

    def wait(self, refs: Sequence[Any], timeout: float) -> list[Any]:
        import ray

        plain = [ref.generator if isinstance(ref, _Stream) else ref for ref in refs]
        ready, _ = ray.wait(plain, num_returns=1, timeout=timeout)
        return [ref for ref, each in zip(refs, plain, strict=True) if any(each is r for r in ready)]


class _WorkerLostError(WorkerDiedError):
    """:class:`WorkerDiedError` for a lost worker, caused by Ray's own error (retryable)."""


#: How long one wait for a result lasts before the caller's ``between`` hook runs.
SLICE_S = 0.05


class _Request:
    """One request in flight: its argument, its worker, its attempts."""

    __slots__ = ("actor", "arg", "attempts", "ref", "tag", "worker_id")

    def __init__(self, ref: Any, arg: Any, worker_id: int, actor: Any, tag: Any = None) -> None:
        self.ref = ref  # None while held back
        self.arg = arg
        self.tag = tag  # the caller's name for it, returned with its reply
        self.worker_id = worker_id
        self.actor = actor  # the actor it was sent to (a restart replaces it)
        self.attempts = 0


def get_sliced(
    calls: Calls,
    ref: Any,
    *,
    between: Callable[[], None],
    what: Callable[[], str],
    worker_id: int,
    retries: int,
) -> Any:
    """``calls.get(ref)`` in slices, calling ``between`` after each; a named error on death.

    No overall timeout: torch's ``timeout`` bounds the trainer's wait in
    ``next()``, not how long a batch takes to load while the trainer is busy.
    """
    while True:
        try:
            return calls.get(ref, SLICE_S)
        except ResultTimeout:
            between()
        except WorkerLost as err:
            raise _WorkerLostError(
                f"Ray worker {worker_id} died while loading {what()} "
                f"(retried {retries} times on a fresh worker; {err}). If "
                "this input crashes the worker process every time (os._exit, a segfault "
                "in a decoder, out of memory), fix or remove it; the worker's own log is "
                "in Ray's session directory (/tmp/ray/session_latest/logs)."
            ) from (err.__cause__ or err)


class Dispatcher:
    """Sends requests to a pool's workers round-robin and collects their replies.

    With ``in_order=False`` a request goes to the worker with the fewest requests in
    flight (the first such from the round-robin's turn), as torch's ``in_order=False``
    does: a worker held up by a slow batch gets no more until it catches up.

    Args:
        pool: The workers (see the module docstring).
        calls: How calls reach them.
        method: The actor method each request calls with its argument.
        describe: Names a request's argument in an error ("indices [3, 4]").
        between: Called while a wait goes on (it may raise to stop the wait).
        retries: Times one request is re-sent after its worker died.
        first_worker: The worker of the first request (the epoch's earlier ones went
            elsewhere: the trainer loaded them while the actors started).
    """

    def __init__(
        self,
        pool: Pool,
        calls: Calls,
        *,
        in_order: bool = True,
        method: str,
        describe: Callable[[Any], str],
        between: Callable[[], None],
        retries: int = MAX_TASK_RETRIES,
        first_worker: int = 0,
    ) -> None:
        self._pool = pool
        self._calls = calls
        self._method = method
        self._describe = describe
        self._between = between
        self._retries = retries
        self._pending: deque[_Request] = deque()
        self._in_order = in_order
        self._next_worker = first_worker
        #: Send only to the first ``width`` workers (``None``: all); ``num_workers="auto"``
        #: widens it as new workers answer, or narrows it back (their requests still come).
        self.width: int | None = None

    def __len__(self) -> int:
        """Requests sent and not yet collected."""
        return len(self._pending)

    def top_up(self, requests: Iterator[Any], window: int) -> bool:
        """Send from ``requests`` until ``window`` are in flight; ``True`` once it is exhausted."""
        while len(self) < window:
            request = next(requests, None)
            if request is None:
                return True
            self.send(request)
        return False

    def send(self, arg: Any, *, tag: Any = None) -> None:
        """Send one request to the next worker (``tag``: returned by :meth:`collect_tagged`)."""
        actors = self._pool.actors
        if not actors:
            raise stopped_error()
        width = len(actors) if self.width is None else max(1, min(self.width, len(actors)))
        worker_id = self._next_worker % width
        if not self._in_order:
            load = [0] * width
            for request in self._pending:
                if request.worker_id < width:
                    load[request.worker_id] += 1
            turn = [(worker_id + k) % width for k in range(width)]
            worker_id = min(turn, key=lambda w: load[w])  # the first of the least loaded
        self._next_worker = (worker_id + 1) % width
        actor = actors[worker_id]
        self._pending.append(
            _Request(self._calls.submit(actor, self._method, arg), arg, worker_id, actor, tag)
        )

    def collect(self, *, in_order: bool = True) -> Any:
        """The reply to the oldest request (``in_order``) or to the first one ready."""
        return self.collect_tagged(in_order=in_order)[2]

    def collect_tagged(self, *, in_order: bool = True) -> tuple[Any, int, Any]:
        """``(tag, worker id, reply)`` of the oldest request (``in_order``) or the first one ready."""
        request = self._pending[0] if in_order else self._first_ready()
        while True:
            try:
                reply = get_sliced(
                    self._calls,
                    request.ref,
                    between=self._between,
                    what=lambda: self._describe(request.arg),
                    worker_id=request.worker_id,
                    retries=request.attempts,
                )
                break
            except _WorkerLostError:
                if request.attempts >= self._retries:
                    raise
                request.attempts += 1
                self._retry_alone(request)
        self._pending.remove(request)
        self._resend_held(request.worker_id)
        return request.tag, request.worker_id, reply

    def _retry_alone(self, failed: _Request) -> None:
        actor = self._pool.restart(failed.worker_id, failed.actor)
        for request in self._pending:
            if request.worker_id == failed.worker_id:
                request.ref = None
        failed.actor = actor
        failed.ref = self._calls.submit(actor, self._method, failed.arg)

    def _resend_held(self, worker_id: int) -> None:
        held = [r for r in self._pending if r.worker_id == worker_id and r.ref is None]
        if not held:
            return
        if not self._pool.actors:
            raise stopped_error()
        actor = self._pool.actors[worker_id]
        for request in held:
            request.actor = actor
            request.ref = self._calls.submit(actor, self._method, request.arg)

    def _first_ready(self) -> _Request:
        while True:
            refs = [request.ref for request in self._pending]
            ready = self._calls.wait([ref for ref in refs if ref is not None], SLICE_S)
            if ready:
                return self._pending[refs.index(ready[0])]
            self._between()


#: How long the first look at a pool's actors waits for their ``ready``: actors that are
#: up answer within milliseconds and should get the epoch's first requests.
FIRST_READY_WAIT_S = 0.05


class ActorStart:
    """Whether a pool's actors have all answered a first request, asked without waiting.

    Shared by the epochs of one pool, so that an epoch started while the actors
    still start (the next one, started early) loads here too, and the warm-ups
    go once: the first ask sends the warm-up call (``method(*args)``) to every actor.
    """

    def __init__(self, method: str, *args: Any) -> None:
        self._call = (method, *args)
        self._waiting: list[Any] | None = None  # warm-ups not answered yet
        self._lock = threading.Lock()

    def starting(self, pool: Pool, calls: Calls, *, first_wait: float = 0.0) -> bool:
        """Whether some actor of ``pool`` has not answered its warm-up (``method(*args)``) yet.

        ``first_wait``: at the first ask, wait that long for the answers (actors
        that are up answer within milliseconds; that should not count as starting).
        """
        with self._lock:
            if self._waiting is None:
                self._waiting = [calls.submit(a, *self._call) for a in pool.actors]
                deadline = time.perf_counter() + first_wait
                while self._waiting and time.perf_counter() < deadline:
                    calls.wait(
                        self._waiting, min(SLICE_S, max(0.0, deadline - time.perf_counter()))
                    )
                    self._waiting = [ref for ref in self._waiting if not _answered(calls, ref)]
            self._waiting = [ref for ref in self._waiting if not _answered(calls, ref)]
            return bool(self._waiting)


@dataclass(frozen=True)
class Actors:
    """Where a direct epoch sends its runs: the pool, a run's request to it, the pool's start.

    ``request(run)`` is what an actor's ``fetch`` takes for one of the epoch's runs;
    ``start`` (:class:`ActorStart`, shared by the pool's epochs) says whether the
    actors have answered their warm-up, ``None`` when runs never load here.
    """

    pool: Pool
    request: Callable[[Any], Any] = lambda run: run
    start: ActorStart | None = None


class LateActors:
    """An epoch's :class:`Actors`, made once Ray is up: an epoch may start while Ray starts.

    ``make`` makes them (starting the pool); it is called once, on the epoch's
    thread, when ``ray_up()`` first says Ray is up. Until then, and until every
    actor answered its warm-up (``Actors.start``, asked through ``calls``), the epoch
    may load its runs in the training process (:meth:`starting`).
    """

    def __init__(
        self,
        make: Actors | Callable[[], Actors],
        ray_up: Callable[[], bool] = lambda: True,
        calls: Calls | None = None,
    ) -> None:
        self._make = make if callable(make) else lambda: make
        self._ray_up = ray_up
        self._calls = calls or RayCalls()
        self.bound: Actors | None = None

    def bind(self, between: Callable[[], None] | None = None) -> Actors | None:
        """The :class:`Actors`, made once Ray is up; ``None`` before, unless ``between``.

        ``between``: wait for Ray, calling it (a stop check) every poll.
        """
        if self.bound is None:
            while not self._ray_up():
                if between is None:
                    return None
                between()
                time.sleep(RAY_UP_POLL_S)
            self.bound = self._make()
        return self.bound

    def starting(self) -> bool:
        """Whether Ray is not up yet, or some actor has not answered its warm-up.

        An epoch whose runs may load here (``Actors.start`` set) loads them here while
        this holds; runs go to the actors from the first run after all of them answered
        (or failed: their runs then meet the failure as usual).
        """
        actors = self.bind()
        return actors is None or (
            actors.start is not None and actors.start.starting(actors.pool, self._calls)
        )


#: Seconds between looks at whether Ray is up, while an epoch waits for it.
RAY_UP_POLL_S = 0.02


def _answered(calls: Calls, ref: Any) -> bool:
    """Whether a warm-up has its reply (a failure counts: the runs meet it on their own)."""
    try:
        calls.get(ref, 0.0)
    except ResultTimeout:
        return False
    except Exception:  # a dead actor, a failed start: the Dispatcher's to handle
        return True
    return True
