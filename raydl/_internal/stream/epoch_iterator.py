"""The one iterator type of an epoch, over whichever producer feeds it.

A :class:`Producer` fills a :class:`~raydl._internal.stream.handoff.Handoff` from
its own thread (map-style and iterable fetch threads, raydl's direct runs, Ray
Data's producer, or a copy stage over any of these: to the device, or into
pinned memory). The
:class:`EpochIterator` is what ``iter(loader)`` returns. On the trainer's thread,
it alone:

* counts the batches delivered, from a resumed epoch's offset (``skip``);
* times the trainer's wait inside ``next()`` and updates the progress bar;
* applies torch's ``timeout`` to that wait;
* raises a failed batch (an :class:`~raydl._internal.stream.handoff.ItemError`)
  and goes on with the next one, as torch does;
* closes the producer on exhaustion, any other exception, ``close()`` or
  collection.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from raydl._internal.runtime.cluster import is_connected
from raydl._internal.stream.handoff import Handoff, ItemError
from raydl._internal.stream.metrics import EpochStats, logger, note_batch
from raydl.errors import LoaderTimeoutError


class Producer:
    """What feeds an epoch: a thread filling :attr:`handoff`, and its Ray work.

    Subclasses start their thread in ``__init__`` (``self.handoff.start(...)``)
    and override the hooks they need. A producer never refers to its
    iterator, so a dropped iterator is collected and its ``close()`` runs.
    """

    handoff: Handoff
    #: ``deliver`` may load a batch itself (the trainer's stand-ins for workers still
    #: starting): the epoch's items must then be taken on the trainer's thread.
    loads_in_deliver = False
    #: The items of :attr:`handoff` are the batches the trainer gets (``deliver`` passes
    #: them on), so the producer's thread may read them for the epoch's statistics.
    delivers_items = True

    def taken(self, waited: float) -> None:
        """Called on the trainer's thread after each batch it took, ``waited`` s after asking.

        Map-style: draw the next indices (and, with ``num_workers="auto"``, pass the
        wait on to the fetch thread's rule).
        """

    def deliver(self, item: Any) -> Any:
        """The batch for an item taken from :attr:`handoff` (on the trainer's thread)."""
        return item

    def summary(self) -> str | None:
        """A one-line account of the epoch's execution, once it is exhausted."""
        return None

    def close(self, *, stalled: bool = False) -> None:
        """Stop the thread and, while Ray is connected, release this epoch's Ray work.

        ``stalled``: the trainer gave up waiting (a timeout), so the thread may be
        stuck inside Ray; stop what it waits for rather than waiting long for it.
        Called once.
        """
        self.handoff.stop()
        if is_connected():  # after ray.shutdown() (e.g. at exit) there is nothing to release
            self.release()

    def release(self) -> None:
        """Release this epoch's Ray work (actors back to their owner, executors shut down)."""


class EpochIterator(Iterator[Any]):
    """One epoch's batches, as ``iter(loader)`` returns them.

    Args:
        producer: What feeds the epoch.
        epoch: The epoch's number.
        skip: Batches of this epoch consumed before a resume (the count starts there).
        length: Batches of the epoch, when known (``len()``).
        timeout: torch's ``timeout``: seconds ``next()`` may wait, ``0`` for no bound.
        on_exhausted: Called once the epoch's last batch was taken (a rank's barrier).
        workers: The loader's ``num_workers``: :attr:`_workers` has one handle each.
    """

    def __init__(
        self,
        producer: Producer,
        *,
        epoch: int,
        skip: int = 0,
        length: int | None = None,
        timeout: float = 0,
        on_exhausted: Callable[[], None] | None = None,
        workers: int = 0,
    ) -> None:
        self._producer = producer
        self._closed_event = threading.Event()
        self._workers = [EpochWorker(self._closed_event) for _ in range(workers)]
        self._handoff = producer.handoff
        if producer.delivers_items:
            self._handoff.note_items(note_batch)  # read on the producer's thread, not here
        self._length = length
        self._timeout = timeout
        self._on_exhausted = on_exhausted
        self._closed = False
        self._stalled = False  # a wait timed out
        self.epoch = epoch
        self.skipped = skip  # consumed before this run of the epoch (a resume)
        self.num_yielded = skip
        self.exhausted = False
        self.stats = EpochStats(epoch=epoch)
        self.progress: Any = None  # a tqdm bar, when the loader asks for one
        self.log_summary = False  # log the epoch's summary line when it ends
        self.loader: Any = (
            None  # a running epoch keeps its loader alive (`for b in DataLoader(...)`)
        )

    def __iter__(self) -> EpochIterator:
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
            item = self._handoff.take(self._timeout)
            batch = self._producer.deliver(item)
            self._producer.taken(time.perf_counter() - started)
        except StopIteration:
            self._end()
            raise
        except LoaderTimeoutError:
            self._stalled = True
            self.close()
            raise
        except BaseException:
            self.close()
            raise
        if isinstance(batch, ItemError):
            # One batch failed (its __getitem__ raised): torch re-raises it and the
            # epoch goes on. It holds its place in the epoch (a resume skips it).
            self.num_yielded += 1
            batch.reraise()
        self.num_yielded += 1
        note = self._handoff.last_note if batch is item else None
        self.stats.record(batch, time.perf_counter() - started, note)
        if self.progress is not None:
            self.progress.update(1)
        return batch

    def _end(self) -> None:
        if self._closed:
            return
        self.exhausted = True
        self.stats.finish()
        self.stats.ray_data = self._producer.summary()
        if self.log_summary:
            logger.info(self.stats.summary_line())
        self.close()
        if self._on_exhausted is not None:
            self._on_exhausted()

    def close(self) -> None:
        """Release this epoch's work; further ``next()`` calls raise ``StopIteration``."""
        # A closed epoch must not keep its loader alive, or a loader dropped after its
        # epoch lives on in a reference cycle (loader <-> iterator) with its next epoch.
        self.loader = None
        if self._closed:
            return
        self._closed = True
        self._closed_event.set()
        self.stats.finish()
        if self.progress is not None:
            self.progress.close()
        self._producer.close(stalled=self._stalled)

    # torch's iterators have this name; scripts (and torch's own tests) call it to stop
    # the workers of ``loader._iterator``.
    _shutdown_workers = close

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class EpochWorker:
    """One worker of an epoch, as torch's iterator lists its processes in ``_workers``.

    A handle on the epoch's part of a Ray actor: alive while the epoch runs, ended
    (``exitcode`` 0) once its iterator is closed, exhausted or dropped. Scripts and
    torch's own tests join these after ``del``-ing the iterator.
    """

    pid = None  # the actors are Ray's processes, shared by epochs

    def __init__(self, closed: threading.Event) -> None:
        self._closed = closed

    def is_alive(self) -> bool:
        """Whether the epoch still runs."""
        return not self._closed.is_set()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the epoch to end (its iterator closed), at most ``timeout`` seconds.

        A running iterator and its loader refer to each other, so one the script
        dropped (``del it; w.join()``, as torch's tests do) is closed by the garbage
        collector's cycle pass: run it first.
        """
        if not self._closed.is_set():
            gc.collect()
        self._closed.wait(timeout)

    @property
    def exitcode(self) -> int | None:
        """``0`` once the epoch ended, ``None`` while it runs (as a live process's)."""
        return 0 if self._closed.is_set() else None

    def terminate(self) -> None:
        """Nothing to end here: closing the iterator ends the epoch's work."""
