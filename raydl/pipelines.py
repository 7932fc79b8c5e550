"""Ray Data pipelines that change with the epoch.

A ``ray.data.Dataset`` is a fixed plan: it has no epoch input, so last-mile work
that must differ per epoch (a new random draw of negatives to keep, a new
augmentation seed) cannot live in it. :class:`PerEpoch` wraps a function that
builds the epoch's plan; :class:`raydl.RayDataLoader` calls it once per epoch
with the epoch number, so the whole epoch stays a pure function of
(seed, epoch) and can be planned ahead, resumed and split across ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ray.data

    from raydl._internal.io.file_dataset import FileDataset

__all__ = ["PerEpoch"]


@dataclass(frozen=True)
class PerEpoch:
    """A Ray Data pipeline built anew for each epoch by ``build(epoch)``.

    ``build`` must be a pure function of ``epoch`` (derive any randomness from
    it): raydl may call it ahead of time to start the next epoch early, on rank 0
    only under torchrun, and again for the same epoch when a run resumes.

    Attributes:
        build: ``epoch -> ray.data.Dataset`` (or the plan of a raydl reader, a
            :class:`~raydl.FileDataset`); cheap to call (it builds a lazy plan).

    Example:
        >>> import raydl
        >>> table = raydl.read_parquet("s3://bucket/events/")  # doctest: +SKIP
        >>> def downsample(batch, epoch):  # keep 10% of negatives, a new draw each epoch
        ...     ...
        >>> pipeline = raydl.PerEpoch(  # doctest: +SKIP
        ...     lambda epoch: table.map_batches(downsample, fn_kwargs={"epoch": epoch})
        ... )
        >>> loader = raydl.RayDataLoader(pipeline, batch_size=1024, shuffle=True)  # doctest: +SKIP
    """

    build: Callable[[int], FileDataset | ray.data.Dataset]

    def __post_init__(self) -> None:
        if not callable(self.build):
            raise TypeError(
                "PerEpoch needs a function epoch -> ray.data.Dataset, "
                f"got {type(self.build).__name__}"
            )

    def dataset(self, epoch: int) -> FileDataset | ray.data.Dataset:
        """The epoch's plan; a clear error if ``build`` returned something else."""
        from raydl._internal.io.file_dataset import FileDataset

        dataset = self.build(epoch)
        if isinstance(dataset, FileDataset):  # raydl's own plan of a raydl read
            return dataset
        from ray.data import Dataset

        if not isinstance(dataset, Dataset):
            raise TypeError(
                f"PerEpoch's build({epoch}) should return a ray.data.Dataset or a raydl "
                "reader's plan (raydl.FileDataset), "
                f"got {type(dataset).__name__}"
            )
        return dataset
