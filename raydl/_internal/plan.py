"""Per-epoch plans for ``ray.data.Dataset`` sources.

The user's dataset is a lazy Ray Data plan (reads, ``map_batches`` stages with
their own resources, filters). For each epoch raydl derives a new plan from it
(never mutating the user's object):

* ``shuffle_mode="global"``: ``random_shuffle(seed=epoch_seed(seed, epoch))``, a
  true all-to-all shuffle, different each epoch and reproducible;
* ``shuffle_mode="blocks"``: ``randomize_block_order`` plus a local shuffle
  buffer while batching: cheaper, only approximately uniform;
* no shuffle: the plan as given.

With ``deterministic=True`` the epoch plan runs with Ray Data's
``preserve_order``, so the row order is a pure function of (seed, epoch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from raydl._internal.shuffle import epoch_seed

if TYPE_CHECKING:
    import ray.data

SHUFFLE_MODES = ("global", "blocks")

_BLOCK_ORDER_STREAM = 1
_LOCAL_BUFFER_STREAM = 2


@dataclass(frozen=True)
class EpochPlan:
    """The dataset to execute for one epoch and the batching options that go with it."""

    dataset: ray.data.Dataset
    local_shuffle_buffer_size: int | None
    local_shuffle_seed: int | None
    all_to_all: bool  # the plan has a barrier stage: nothing comes out before its map phase


def plan_epoch(
    dataset: ray.data.Dataset,
    *,
    shuffle: bool,
    shuffle_mode: str,
    local_shuffle_buffer_size: int | None,
    seed: int,
    epoch: int,
    deterministic: bool,
) -> EpochPlan:
    """Derive the epoch's Ray Data plan from the user's dataset (pure: nothing executes)."""
    from ray.data import Dataset

    ds = Dataset.copy(dataset, _deep_copy=True)  # own DataContext: the user's stays untouched
    ds.context.execution_options.preserve_order = deterministic
    # A stage's exception reaches the trainer with its own type, as torch's workers' do.
    ds.context.raise_original_map_exception = True
    ds.context.enable_progress_bars = False
    buffer = None
    buffer_seed = None
    if shuffle:
        if shuffle_mode == "global":
            ds = ds.random_shuffle(seed=epoch_seed(seed, epoch))
        else:
            ds = ds.randomize_block_order(seed=epoch_seed(seed, epoch, _BLOCK_ORDER_STREAM))
            buffer = local_shuffle_buffer_size
            buffer_seed = epoch_seed(seed, epoch, _LOCAL_BUFFER_STREAM)
    return EpochPlan(ds, buffer, buffer_seed, all_to_all=has_all_to_all(ds))


def has_all_to_all(dataset: ray.data.Dataset) -> bool:
    """Whether the plan has an all-to-all stage (shuffle, sort, repartition, ...)."""
    try:
        from ray.data._internal.logical.operators.all_to_all_operator import AbstractAllToAll

        ops = dataset._logical_plan.dag.post_order_iter()
        return any(isinstance(op, AbstractAllToAll) for op in ops)
    except (ImportError, AttributeError):  # Ray moved its internals: assume a streaming plan
        return False
