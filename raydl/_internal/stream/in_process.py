"""``num_workers=0``: an epoch loaded in the training process, as torch loads it.

torch's ``DataLoader`` without workers fetches each batch inside ``next()``, on
the caller's thread: no pickling (a dataset holding a generator or a lock
works), a breakpoint in ``__getitem__`` stops the training script, and
``get_worker_info()`` is ``None``. :class:`InProcessProducer` does the same with
torch's own fetchers (``_MapDatasetFetcher``, ``_IterableDatasetFetcher``), over
an :class:`~raydl._internal.stream.handoff.InlineHandoff`: no thread, no Ray.

:class:`LengthWatch` is torch's warning for an ``IterableDataset`` that yields
more than the ``len()`` it reported (shared with the workers' iterable epochs).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from torch.utils.data.dataloader import _DatasetKind

from raydl._internal.stream.epoch_iterator import Producer
from raydl._internal.stream.handoff import InlineHandoff, ItemError
from raydl._internal.stream.worker_states import Snapshot
from raydl._internal.workers import stateful


class LengthWatch:
    """torch's warning once an ``IterableDataset`` epoch goes past the length ``len()`` gave.

    torch compares the batches yielded with ``len(dataset)`` as the loader's
    ``__len__`` last reported it (``reported``; ``None``: ``len()`` was not
    called before the epoch started, so nothing is checked), with torch's words.

    Example:
        >>> import warnings
        >>> watch = LengthWatch("data", reported=1, num_workers=0)
        >>> watch.count()
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     watch.count()
        >>> "but 2 samples have been fetched" in str(seen[0].message)
        True
    """

    def __init__(self, dataset: Any, *, reported: int | None, num_workers: int, start: int = 0):
        self._dataset = dataset
        self._reported = reported
        self._num_workers = num_workers
        self.fetched = start

    def count(self) -> None:
        """One more batch was yielded; warn (torch's message) past the reported length."""
        self.fetched += 1
        if self._reported is None or self.fetched <= self._reported:
            return
        message = (
            f"Length of IterableDataset {self._dataset} was reported to be {self._reported}"
            f"(when accessing len(dataloader)), but {self.fetched} samples have been fetched. "
        )
        if self._num_workers > 0:
            message += (
                "For multiprocessing data-loading, this could be caused by not properly "
                "configuring the IterableDataset replica at each worker. Please see "
                "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                "for examples."
            )
        warnings.warn(message, UserWarning, stacklevel=4)


class InProcessProducer(Producer):
    """One epoch fetched in this process, batch by batch, when the trainer asks.

    Args:
        dataset: The map-style or iterable dataset.
        index_iter: The epoch's iterator over the index sampler (torch's
            ``_index_sampler``: the batch sampler when batching, else the sampler;
            for an ``IterableDataset`` its infinite constant sampler).
        iterable: ``dataset`` is an ``IterableDataset``: its iterator is started
            here (torch starts it when the epoch's iterator is made), and an
            exception from ``__iter__`` is raised here.
        auto_collation: Batches come from a batch sampler.
        collate_fn: torch's collate (or convert) function.
        drop_last: Drop the last incomplete batch (iterable datasets).
        skip: Batches to produce and drop first (a resume: an iterable epoch's consumed
            batches, or those after a ``Stateful`` dataset's snapshot; map-style resumes
            skip the other indices before this producer sees them).
        watch: Counts batches for torch's length warning (iterable datasets).
        resume: A ``Stateful`` dataset's snapshot to go on from (its ``step``: the
            batches of the epoch before the first this producer fetches).
        every: ``snapshot_every_n_steps``: the dataset's state is taken after every
            ``every``-th batch (and at the epoch's start).

    A batch whose fetch raises is handed over as an
    :class:`~raydl._internal.stream.handoff.ItemError`: ``next()`` raises it, with
    its traceback, and the following ``next()`` goes on, as in torch.

    A ``Stateful`` map-style dataset may hold torch's global RNG, which the sampler
    draws the epoch's order from at its first ``next()``: its state is taken, and
    restored, at the same moments relative to that draw: at the epoch's start
    (``"at_start"``) before it, after a batch after it.
    """

    def __init__(
        self,
        dataset: Any,
        index_iter: Iterator[Any],
        *,
        iterable: bool,
        auto_collation: bool,
        collate_fn: Any,
        drop_last: bool,
        skip: int = 0,
        watch: LengthWatch | None = None,
        resume: Snapshot | None = None,
        every: int | None = 1,
    ) -> None:
        kind = _DatasetKind.Iterable if iterable else _DatasetKind.Map
        state = resume.states[0] if resume is not None else None
        self._restore: dict[str, Any] | None = None  # a map-style state restored at a batch
        if iterable or (state is not None and state.get("at_start")):
            stateful.restore_dataset(dataset, state)
        else:
            self._restore = state
        before = (
            stateful.before_iter(dataset)
            if iterable
            else stateful.capture(dataset, None, iterable=False)
        )
        self._fetcher = _DatasetKind.create_fetcher(
            kind, dataset, auto_collation, collate_fn, drop_last
        )
        iterator = getattr(self._fetcher, "dataset_iter", None)
        if iterable:
            stateful.restore_iterator(iterator, state)  # type: ignore[arg-type]
            if state is not None and state.get("ended"):
                self._fetcher.ended = True
        self._dataset, self._iterable = dataset, iterable
        self._index_iter = index_iter
        self._skip = skip
        self._watch = watch
        self._every = every
        self._position = resume.step if resume is not None else 0
        self._latest = resume  # the latest snapshot taken (or resumed from)
        if resume is None:
            start = (
                stateful.at_start(before, self._state(), iterator is dataset)
                if iterable
                else (None if before is None else {**before, "at_start": True})
            )
            self._latest = None if start is None else Snapshot(0, 0, [start])
        self.handoff = InlineHandoff(self._next)

    def _next(self) -> Any:
        while self._skip:
            self._skip -= 1
            self._fetch()
        return self._fetch()

    def _fetch(self) -> Any:
        index = next(self._index_iter)  # StopIteration: the epoch ends
        restore, self._restore = self._restore, None
        if restore is not None:
            stateful.restore_dataset(self._dataset, restore)
        try:
            batch = self._fetcher.fetch(index)  # an IterableDataset's end: StopIteration
        except StopIteration:
            raise
        except Exception as err:
            batch = ItemError(err)
        self._position += 1
        if self._latest is not None and self._every and self._position % self._every == 0:
            self._latest = Snapshot(self._position, 0, [self._state()])
        return batch

    def taken(self, waited: float) -> None:
        if self._watch is not None:
            self._watch.count()

    def snapshot(self, delivered: int) -> Snapshot | None:
        """The latest snapshot of the dataset's state (``None``: the dataset is not ``Stateful``)."""
        return self._latest

    def _state(self) -> dict[str, Any] | None:
        """The dataset's (and its iterator's) state now."""
        return stateful.capture(
            self._dataset,
            getattr(self._fetcher, "dataset_iter", None),
            iterable=self._iterable,
            ended=getattr(self._fetcher, "ended", False),
        )
