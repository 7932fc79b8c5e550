"""The one hand-off between a producer thread and the thread that consumes its items.

Every background thread of an epoch (a fetch thread, Ray Data's producer, the
device copy, the builder of an early epoch) hands its items over a
:class:`Handoff`: a queue that also carries the end of the stream and a failure,
a stop flag the consumer sets, and the producer thread, whose death is noticed.

* The producer runs as ``handoff.start(body, name=...)``: ``body`` calls
  :meth:`Handoff.put` for each item. Returning ends the stream; raising puts the
  exception (as the consumer should see it, see ``describe_error``); a ``put``
  after :meth:`Handoff.stop` raises :class:`Stopped`, which unwinds ``body``
  quietly. A failure that does not end the stream (a user's exception in one
  batch: torch re-raises it and goes on with the next batch) travels as an
  ordinary item, an :class:`ItemError`, which the consumer raises.
* The consumer calls :meth:`Handoff.take`: the next item, ``StopIteration`` at
  the end or once stopped, the producer's exception re-raised, torch's timeout
  error after ``timeout`` seconds, or an error naming the thread if it died
  without a word.

Waits run in short slices, so a blocked side always notices the other's stop.

Each ``put`` also gives the trainer's freed memory back to the kernel, once a second
at most (``workers/allocator.release_freed_memory_now_and_then``): what the producers
allocated and the training loop freed would otherwise stay in their threads' arenas.

The queue is a ``deque``; a side about to wait raises its "I wait" flag, looks at the
deque once more, then waits on a lock of its own, which the other side releases when it
finds the flag up (a binary semaphore), so no wake-up is lost; a stale ``release`` only
makes the next wait return at once, and the loop looks again. A ``take`` whose item is
ready costs a ``popleft`` (0.25 us of CPU; ``queue.Queue.get`` took 1 us and handed its
``threading.Condition``'s lock over twice).

The consumer wakes a producer that waits for room only when it took the last item; else
the producer looks again by itself, after a quarter of the time it has waited so far
(:data:`ROOM_POLL_S` to :data:`ROOM_POLL_MAX_S`). Woken from the trainer's ``next()``,
the producer's work on the next batch (a local shuffle round: 1-3.5 ms) ran while that
``next()`` sat runnable but not running (run-queue delay, measured with ``perf sched``); most
likely the scheduler placed the freshly woken thread on the waker's core, ahead of it.
Measured on the tabular benchmark's loader at 0.5x the one-process rate (2 cores,
docs/benchmarks.md): calls to ``next()`` over 1 ms went from 7-16 to 0-2 per epoch and
the benchmark's stall from 4.5 % to 1.05-1.6 %; a producer polling costs 4.4 % of a core
every 1 ms, 1.2 % every 5 ms (measured; 10 ms was not).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from raydl._internal.workers import allocator
from raydl.errors import LoaderTimeoutError

if TYPE_CHECKING:
    from raydl._internal.workers.failure import RemoteError

#: How long one wait lasts before a blocked side looks again at the stop flag.
SLICE_S = 0.05
#: A producer waiting for room looks again after a quarter of the time it has waited so
#: far, within these bounds; the consumer wakes it only when it took the last item (see
#: the module's docstring).
ROOM_POLL_S = 0.001
ROOM_POLL_MAX_S = 0.01


class Stopped(Exception):
    """Raised by :meth:`Handoff.put` once the consumer stopped the hand-off."""


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()
_EMPTY = object()  # no item queued


def _signal() -> threading.Lock:
    """A side's wake-up: a lock held until the other side releases it (:func:`_wake`)."""
    lock = threading.Lock()
    lock.acquire()
    return lock


def _wake(signal: threading.Lock) -> None:
    """Wake the side waiting on ``signal``; a wake nobody waited for is dropped (or, if
    already released, the next wait returns at once and its loop looks again)."""
    with contextlib.suppress(RuntimeError):  # released already: a wake is pending
        signal.release()


class _Noted:
    """An item with what the producer's thread noted of it (see :meth:`Handoff.note_items`)."""

    __slots__ = ("item", "note")

    def __init__(self, item: Any, note: Any) -> None:
        self.item = item
        self.note = note


class ItemError:
    """One item that failed (a batch whose ``__getitem__`` raised); the stream goes on.

    It is queued like any item; the consumer calls :meth:`reraise`. ``error`` is
    a :class:`~raydl._internal.workers.failure.RemoteError` from a worker (re-raised
    as the original type, as torch does) or an exception caught in this process (raised as it is, with its
    traceback).

    Example:
        >>> item = ItemError(ValueError("bad sample"))
        >>> item.reraise()
        Traceback (most recent call last):
        ...
        ValueError: bad sample
    """

    __slots__ = ("error",)

    def __init__(self, error: BaseException | RemoteError) -> None:
        self.error = error

    def reraise(self) -> NoReturn:
        """Raise the item's exception."""
        error = self.error
        if isinstance(error, BaseException):
            raise error
        error.reraise()  # the original type, the worker's traceback in the text


def timeout_error(timeout: float) -> LoaderTimeoutError:
    """torch's wording for a loader that waited ``timeout`` seconds for a batch."""
    return LoaderTimeoutError(f"DataLoader timed out after {timeout} seconds")


class Handoff:
    """Items from one producer thread to one consumer, then the end or a failure.

    Args:
        maxsize: Items queued at most (``0``: unbounded); a full queue blocks ``put``.

    Example:
        >>> h = Handoff(maxsize=2)
        >>> h.start(lambda: [h.put(i) for i in range(3)], name="raydl-example")
        >>> [h.take(timeout=0) for _ in range(3)]
        [0, 1, 2]
    """

    def __init__(self, maxsize: int = 0) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._maxsize = max(0, maxsize)
        # Each side's wake-up: held while nobody signals it, released by the other side.
        self._room = _signal()  # the producer waits here for room
        self._ready = _signal()  # the consumer waits here for an item
        self._producer_waits = False
        self._consumer_waits = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ended = False  # the consumer took the end or a failure
        self._note: Callable[[Any], Any] | None = None
        #: What the producer's thread noted of the item :meth:`take` returned last (``None``:
        #: nothing, e.g. an item queued before :meth:`note_items`).
        self.last_note: Any = None

    # -- the producer's side ------------------------------------------------------------

    def start(
        self,
        body: Callable[[], None],
        *,
        name: str,
        describe_error: Callable[[BaseException], BaseException] | None = None,
    ) -> None:
        """Run ``body`` on a new daemon thread called ``name`` as this hand-off's producer.

        ``describe_error`` turns an exception of ``body`` into the one the
        consumer raises (e.g. a user's exception out of Ray's wrapper).
        """

        def run() -> None:
            try:
                body()
            except Stopped:
                return
            except BaseException as err:
                self._put_final(_Failure(describe_error(err) if describe_error else err))
                return
            self._put_final(_END)

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: Any) -> None:
        """Queue ``item``, waiting while the queue is full; :class:`Stopped` once stopped."""
        note = self._note
        if note is not None and not isinstance(item, ItemError):
            with contextlib.suppress(Exception):  # the consumer reads the item itself
                item = _Noted(item, note(item))
        self._enqueue(item)
        # The batches' memory, freed by the training loop, back to the kernel once a second.
        allocator.release_freed_memory_now_and_then()

    def _enqueue(self, item: Any) -> None:
        items, maxsize = self._items, self._maxsize
        full_since: float | None = None
        while True:
            if self._stop.is_set():
                raise Stopped
            if not maxsize or len(items) < maxsize:
                break
            self._producer_waits = True
            if len(items) < maxsize:  # the consumer took one before it could see the flag
                continue
            now = time.monotonic()
            full_since = now if full_since is None else full_since
            self._room.acquire(
                timeout=min(ROOM_POLL_MAX_S, max(ROOM_POLL_S, (now - full_since) / 4))
            )
        self._producer_waits = False
        items.append(item)
        if self._consumer_waits:
            _wake(self._ready)

    def _put_final(self, item: Any) -> None:
        with contextlib.suppress(Stopped):  # nobody is waiting for it any more
            self._enqueue(item)

    def note_items(self, note: Callable[[Any], Any]) -> None:
        """From now on, :meth:`put` also calls ``note(item)``, on the producer's thread.

        The consumer finds the result in :attr:`last_note` after :meth:`take` (work the
        consumer would otherwise do on its own thread: the trainer's ``next()``).
        """
        self._note = note

    @property
    def stopped(self) -> bool:
        """Whether the consumer stopped this hand-off (the producer should stop too)."""
        return self._stop.is_set()

    # -- the consumer's side ------------------------------------------------------------

    def take(self, timeout: float) -> Any:
        """The next item, waiting at most ``timeout`` seconds (``0``: no bound).

        Raises:
            StopIteration: The stream ended, or :meth:`stop` was called.
            LoaderTimeoutError: Nothing came within ``timeout`` seconds.
            RuntimeError: The producer thread ended without ending the stream.
            BaseException: Whatever the producer raised.
        """
        if self._ended:
            raise StopIteration
        item = self._next_item()
        if item is _EMPTY:
            item = self._wait_for_item(timeout)
        return self._unpack(item)

    def _next_item(self) -> Any:
        """The first queued item (``_EMPTY`` if none); wakes a producer waiting for room."""
        try:
            item = self._items.popleft()
        except IndexError:
            return _EMPTY
        if self._producer_waits and not self._items:
            _wake(self._room)
        return item

    def _wait_for_item(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout if timeout > 0 else None
        while True:
            wait = SLICE_S * 4
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.monotonic()))
            self._consumer_waits = True
            item = self._next_item()  # put before the flag was up: no wake-up for it
            if item is _EMPTY:
                self._ready.acquire(timeout=wait)
                item = self._next_item()
            self._consumer_waits = False
            if item is not _EMPTY:
                return item
            if self._stop.is_set():
                raise StopIteration
            thread = self._thread
            if thread is not None and not thread.is_alive():
                item = self._next_item()
                if item is not _EMPTY:
                    return item
                raise RuntimeError(
                    f"raydl's {thread.name} thread ended without a result; this is a bug "
                    "in raydl, please report it with the loader's arguments"
                )
            if deadline is not None and time.monotonic() >= deadline:
                raise timeout_error(timeout)

    def _unpack(self, item: Any) -> Any:
        if isinstance(item, _Noted):
            self.last_note = item.note
            return item.item
        self.last_note = None
        if item is _END:
            self._ended = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._ended = True
            raise item.error
        return item

    def stop(self, *, join_s: float = 10.0) -> None:
        """Stop the producer: its next ``put`` raises :class:`Stopped`; wait ``join_s`` for it."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and join_s > 0:
            thread.join(timeout=join_s)

    @property
    def thread(self) -> threading.Thread | None:
        """The producer thread, once started."""
        return self._thread


class InlineHandoff(Handoff):
    """A hand-off whose items are made by the consumer's own ``take`` (no thread).

    ``num_workers=0`` loads as torch does: in the training process, on the thread
    that asks for the batch, so a breakpoint in ``__getitem__`` stops the trainer.
    ``produce`` returns the next item or raises ``StopIteration`` at the end;
    ``timeout`` does not apply (a call on the caller's own thread cannot be cut
    short). A stage that takes from it on its own thread (the device copy) makes
    the items there.

    Example:
        >>> items = iter([1, 2])
        >>> h = InlineHandoff(lambda: next(items))
        >>> [h.take(timeout=0), h.take(timeout=0)]
        [1, 2]
    """

    def __init__(self, produce: Callable[[], Any]) -> None:
        super().__init__()
        self._produce = produce

    def take(self, timeout: float) -> Any:
        """The next item, made now; ``StopIteration`` at the end or once stopped."""
        if self._ended or self._stop.is_set():
            raise StopIteration
        try:
            return self._produce()
        except StopIteration:
            self._ended = True
            raise
