"""Private facts about a ``ray.data.Dataset`` and its splits that raydl reads.

Relies on ``Dataset._meta_count`` (the row count known without executing the
plan) and on the ``_coord_actor`` of ``streaming_split``'s iterators (the split
coordinator, which rank 0 stops once every rank has left the epoch); checked by
:func:`check`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def known_row_count(dataset: Any) -> int | None:
    """``dataset``'s rows if its plan knows them without executing, else ``None``.

    Needs no Ray (a raydl read's plan may be inspected while Ray starts); raydl's own
    plan (``io/file_dataset.py``) answers without Ray Data.
    """
    from raydl._internal.io.file_dataset import FileDataset

    if isinstance(dataset, FileDataset):
        return dataset.known_row_count()
    from raydl._internal.ray_compat import reads

    with reads.without_ray():
        count: int | None = dataset._meta_count()
    return count


def split_coordinator(splits: Sequence[Any]) -> Any:
    """The actor that coordinates ``streaming_split``'s iterators ``splits`` (or ``None``)."""
    return getattr(splits[0], "_coord_actor", None) if splits else None


def check() -> None:
    """Fail if this Ray lacks the dataset internals used here."""
    import ray.data
    from ray.data._internal.iterator.stream_split_iterator import StreamSplitDataIterator

    if not callable(getattr(ray.data.Dataset, "_meta_count", None)):
        raise AttributeError("ray.data.Dataset has no _meta_count()")
    if "_coord_actor" not in StreamSplitDataIterator.__init__.__code__.co_names:
        raise AttributeError("Ray's StreamSplitDataIterator no longer sets _coord_actor")
