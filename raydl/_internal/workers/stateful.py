"""torchdata's ``Stateful`` protocol in a worker: a dataset's (and its iterator's) own state.

A dataset, or the iterator an ``IterableDataset`` returns, may keep state of its
own (an RNG, an epoch counter, a position in a stream, HF ``datasets``'
``IterableDataset``) and expose it as ``state_dict()`` / ``load_state_dict()``.
torchdata's ``StatefulDataLoader`` captures that state in each worker and
restores it on the matching worker at resume; raydl does the same, with the same
order at the restore: the dataset's state, then ``iter()``, then the iterator's.

What a worker's state holds (``None`` when neither object is stateful)::

    {"dataset": dataset.state_dict(),     # a map-style dataset, or an iterable
                                          # one whose iterator is another object
     "iterator": iterator.state_dict()}   # an iterable dataset's iterator
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` has ``state_dict()`` and ``load_state_dict()`` (torchdata's ``Stateful``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def capture(
    dataset: Any, iterator: Iterator[Any] | None, *, iterable: bool, ended: bool = False
) -> dict[str, Any] | None:
    """A worker's state now, or ``None`` when nothing in it is stateful.

    ``ended``: the iterator is exhausted; the state says so (``"ended"``), so that a
    restore yields nothing more from it.
    """
    state: dict[str, Any] = {}
    if iterable:
        if iterator is not None and is_stateful(iterator):
            state["iterator"] = iterator.state_dict()  # type: ignore[attr-defined]
        if iterator is not dataset and is_stateful(dataset):
            state["dataset"] = dataset.state_dict()
    elif is_stateful(dataset):
        state["dataset"] = dataset.state_dict()
    if state and iterable and ended:
        state["ended"] = True
    return state or None


def before_iter(dataset: Any) -> dict[str, Any] | None:
    """An iterable dataset's state before ``iter()``, for :func:`at_start`.

    ``None`` when it has no state yet: a dataset that is its own iterator may make
    its state in ``__iter__`` (torchdata never asks it before), and its state is then
    the iterator's, taken after ``iter()``.
    """
    try:
        return capture(dataset, None, iterable=False)
    except Exception:
        return None


def at_start(
    before: dict[str, Any] | None, after: dict[str, Any] | None, own_iterator: bool
) -> dict[str, Any] | None:
    """The state a pass starts from: the dataset's before ``iter()``, the iterator's after it.

    ``before``/``after``: :func:`capture` before ``iter()`` (as a map-style dataset) and
    after it; ``own_iterator``: the dataset is its own iterator (its state is then the
    iterator's). Restoring this state and calling ``iter()`` starts the same pass: a
    dataset's state taken after ``iter()`` may already describe the pass under way
    (torchdata's convention: a dataset resets its position as a pass ends, so its state
    between passes describes the start of the next).
    """
    state: dict[str, Any] = {}
    if after is not None and "iterator" in after:
        state["iterator"] = after["iterator"]
    if before is not None and not own_iterator:
        state["dataset"] = before["dataset"]
    return state or None


def restore_dataset(dataset: Any, state: dict[str, Any] | None) -> None:
    """Load a captured dataset state (before an iterable dataset's ``iter()``)."""
    if state is not None and "dataset" in state:
        dataset.load_state_dict(state["dataset"])


def restore_iterator(iterator: Iterator[Any], state: dict[str, Any] | None) -> None:
    """Load a captured iterator state (after the ``iter()`` that made ``iterator``)."""
    if state is not None and "iterator" in state:
        iterator.load_state_dict(state["iterator"])  # type: ignore[attr-defined]


@dataclass(frozen=True)
class StateRequest:
    """A request whose reply carries the worker's state after it (a snapshot's request).

    ``arg``: the request itself (a map-style batch's indices; ``None`` for an
    iterable worker's next batch).
    """

    arg: Any = None


@dataclass(frozen=True)
class WithState:
    """A worker's reply (a batch, a failure or the end of its stream) and its state after it."""

    reply: Any
    state: dict[str, Any] | None
