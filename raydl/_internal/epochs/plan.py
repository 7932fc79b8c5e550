"""Per-epoch plans for ``ray.data.Dataset`` sources.

The user's dataset is a lazy Ray Data plan (reads, ``map_batches`` stages with
their own resources, filters). For each epoch raydl derives a new plan from it
(never mutating the user's object):

* ``shuffle_mode="global"``: ``random_shuffle(seed=epoch_seed(seed, epoch))``, a
  true all-to-all shuffle, different each epoch and reproducible;
* ``shuffle_mode="blocks"``: ``randomize_block_order`` plus a local shuffle
  buffer while batching: cheaper, only approximately uniform;
* ``shuffle_mode="files"``: the plan's read tasks (one per file for raydl's
  readers) in a new random order each epoch, plus the local buffer: what torch's
  file-based loaders do. No all-to-all stage, so the epoch streams from its
  first read (``"blocks"`` must read everything before its first batch);
* no shuffle: the plan as given.

raydl's own plan of a raydl read (a :class:`~raydl._internal.io.file_dataset.FileDataset`)
stays raydl's for no shuffle and ``"files"`` (its files permuted): the direct path
runs it without Ray Data. Every other epoch of it (``"global"`` and ``"blocks"``,
whose shuffles are Ray Data's stages, or ``ray_data=True``) is planned on its Ray Data
plan (``FileDataset.to_ray``); the direct path's global shuffle plans the unshuffled
epoch and adds raydl's own exchange.

Every stage's Ray tasks are retried at most :data:`STAGE_RETRIES` times when
their process dies (Ray Data's default is forever, so an input that kills its
worker every time would hang the trainer); a stage that sets ``max_retries`` /
``max_task_retries`` itself keeps its own.

With ``deterministic=True`` the epoch plan runs with Ray Data's
``preserve_order``, so the row order is a pure function of (seed, epoch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raydl._internal.epochs.shuffle import epoch_seed
from raydl._internal.io.file_dataset import FileDataset
from raydl._internal.io.files import own_source
from raydl._internal.ray_compat import plans

if TYPE_CHECKING:
    import ray.data

SHUFFLE_MODES = ("global", "blocks", "files")

#: How often a stage's task is retried after its worker process died (Ray Data: forever).
STAGE_RETRIES = 3

_BLOCK_ORDER_STREAM = 1
_LOCAL_BUFFER_STREAM = 2
_EXCHANGE_STREAM = 3


@dataclass(frozen=True)
class EpochPlan:
    """The dataset to execute for one epoch and the batching options that go with it."""

    dataset: FileDataset | ray.data.Dataset  # raydl's own plan only on the direct path
    local_shuffle_buffer_size: int | None
    local_shuffle_seed: int | None
    all_to_all: bool  # the plan has a barrier stage: nothing comes out before its map phase

    @property
    def context(self) -> Any:
        """The epoch's ``DataContext`` (:func:`plan_context`)."""
        return plan_context(self.dataset)


def plan_context(dataset: FileDataset | ray.data.Dataset) -> Any:
    """The ``DataContext`` a plan runs under; ``None`` (Ray Data's defaults) for raydl's own
    plan in a process without Ray Data (``FileDataset.data_context``)."""
    if isinstance(dataset, FileDataset):
        return dataset.data_context()
    return dataset.context


def plan_epoch(
    dataset: FileDataset | ray.data.Dataset,
    *,
    shuffle: bool,
    shuffle_mode: str,
    local_shuffle_buffer_size: int | None,
    seed: int,
    epoch: int,
    deterministic: bool,
    ray_data: bool = False,
) -> EpochPlan:
    """Derive the epoch's plan from the user's dataset (pure: nothing executes).

    ``ray_data``: a Ray Data plan even for raydl's own plan of a read (module docstring).
    """
    if isinstance(dataset, FileDataset) and not ray_data:
        if not shuffle:
            return EpochPlan(dataset, None, None, all_to_all=False)
        if shuffle_mode == "files":  # the same files order Ray's plan gets (permute_reads)
            return EpochPlan(
                dataset.permuted(epoch_seed(seed, epoch, _BLOCK_ORDER_STREAM)),
                local_shuffle_buffer_size,
                epoch_seed(seed, epoch, _LOCAL_BUFFER_STREAM),
                all_to_all=False,
            )
    if isinstance(dataset, FileDataset):
        dataset = dataset.to_ray()
    ds = plans.own_copy(dataset)  # own DataContext: the user's stays untouched
    ds.context.execution_options.preserve_order = deterministic
    # A stage's exception reaches the trainer with its own type, as torch's workers' do.
    ds.context.raise_original_map_exception = True
    ds.context.enable_progress_bars = False
    ds.context.print_on_execution_start = False
    ds = bound_retries(ds, STAGE_RETRIES)
    ds = fuse_reads(ds)
    buffer = None
    buffer_seed = None
    if shuffle:
        if shuffle_mode == "global":
            ds = ds.random_shuffle(seed=epoch_seed(seed, epoch))
        else:
            order_seed = epoch_seed(seed, epoch, _BLOCK_ORDER_STREAM)
            if shuffle_mode == "files":
                ds = permute_reads(ds, order_seed)
            else:
                ds = ds.randomize_block_order(seed=order_seed)
            buffer = local_shuffle_buffer_size
            buffer_seed = epoch_seed(seed, epoch, _LOCAL_BUFFER_STREAM)
    return EpochPlan(ds, buffer, buffer_seed, all_to_all=has_all_to_all(ds))


def exchange_seed(seed: int, epoch: int) -> int:
    """The seed of the epoch's global shuffle on raydl's actors (``exchange.py``)."""
    return epoch_seed(seed, epoch, _EXCHANGE_STREAM)


def bound_retries(dataset: ray.data.Dataset, retries: int) -> ray.data.Dataset:
    """The same plan with every stage retrying a dead worker's task at most ``retries`` times.

    Ray Data retries map and read tasks forever (``max_retries=-1``) and actor-pool
    tasks on restarted actors forever (``max_task_retries=-1``). The operators of
    the user's plan are shared with the user's dataset, so the stages are copied,
    never changed in place (:func:`raydl._internal.ray_compat.plans.bound_retries`).
    A stage whose ``ray_remote_args`` already say how often to retry keeps them.
    """
    return plans.bound_retries(dataset, retries)


def fuse_reads(dataset: ray.data.Dataset) -> ray.data.Dataset:
    """The same plan with a stage right after one of raydl's file reads fed one read task at a time.

    A ``map_batches(batch_size=B)`` asks Ray to bundle its input up to ``B``
    rows; Ray therefore does not fuse it into a read (a read "could modify the
    number of rows"), and the stage runs as tasks of its own, with its own share
    of the CPU budget and an object-store hop in between. Fusing it anyway would
    be worse: Ray counts each read task as one row, so it would bundle ``B`` read
    tasks into one (the images benchmark's ten read tasks became one task on one
    CPU). raydl's file reads are already cut into tasks of a useful size, so the
    stage after one of them is told not to bundle: Ray fuses read and stage, one
    read task per task, and the stage still gets batches of at most ``B`` rows
    (the last one of each read task may be smaller, as at the end of any Ray
    bundle). Stages Ray could not fuse with the read (other resources, a
    ``ray_remote_args_fn``) keep their bundling.
    """
    return plans.unbundle_after_reads(dataset, lambda source: own_source(source) is not None)


def permute_reads(dataset: ray.data.Dataset, seed: int) -> ray.data.Dataset:
    """The same plan with every read's files (or read tasks) in an order drawn from ``seed``.

    Ray's file-based readers list their files in a ``ListFiles`` source whose
    file shuffle is set to ``seed``; raydl's file readers (binary files, parquet)
    permute their files before cutting them into tasks; other reads (Ray's V1
    parquet reader, ``range``) get their read tasks permuted
    (:func:`raydl._internal.ray_compat.plans.permute_reads`).

    Raises:
        ValueError: a source of the plan is not a read (``from_numpy``,
            ``from_arrow``, a materialized dataset): it has no files to reorder.
    """
    others = plans.non_read_sources(dataset)
    if others:
        raise ValueError(
            f'shuffle_mode="files" reorders the files a plan reads, but a source of this '
            f"plan, {others[0]}, is not a read; use shuffle_mode='blocks' or 'global', "
            "or read the data with raydl.read_parquet / read_images / ray.data.read_*"
        )
    return plans.permute_reads(dataset, seed)


def stage_names(dataset: FileDataset | ray.data.Dataset) -> tuple[str, ...]:
    """The names of the plan's stages, sources first (``ReadParquet``, ``MapBatches(decode)``)."""
    if isinstance(dataset, FileDataset):
        return dataset.stage_names()
    return plans.stage_names(dataset)


def has_all_to_all(dataset: ray.data.Dataset) -> bool:
    """Whether the plan has an all-to-all stage (shuffle, sort, repartition, ...)."""
    return plans.has_all_to_all(dataset)
