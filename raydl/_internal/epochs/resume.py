"""Rebuilding an interrupted epoch at another world size (see :mod:`.elastic`).

* Map-style datasets: the epoch's index order is rebuilt from the saved sampler
  description (torch's ``RandomSampler``/``SequentialSampler``/``DistributedSampler``
  with the RNG state or sampler epoch of the epoch start), per old rank; the
  indices left are dealt to the new ranks. Nothing is fetched twice.
* Ray Data: rank 0 runs the epoch's plan split as it was (``streaming_split``
  at the old world size, same seeds; or, for an epoch that ran on raydl's actors,
  its runs loaded again in this process and dealt or shared as the old ranks had
  them), drops each old rank's consumed batches,
  and deals the remaining rows to the new ranks as small in-memory datasets.
  The cost: one pass of the epoch through the pipeline (the shuffle included)
  before the first batch, and the rest of the epoch held in the object store.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

from raydl._internal.epochs import elastic
from raydl._internal.epochs.direct import DirectPlan
from raydl._internal.epochs.local_runs import LocalRuns
from raydl._internal.epochs.plan import plan_context
from raydl._internal.epochs.shuffle import rank_seed
from raydl._internal.epochs.state import LoaderState, decode_rng
from raydl._internal.stream.batching import ray_batches

if TYPE_CHECKING:
    import pyarrow as pa
    import ray.data

    from raydl._internal.io.file_dataset import FileDataset


def sampler_spec(sampler: Any, batch_sampler: Any) -> dict[str, Any]:
    """How to rebuild an epoch's index order elsewhere, or ``{"sampler": "other"}``."""
    if batch_sampler is not None and not (
        type(batch_sampler) is BatchSampler and batch_sampler.sampler is sampler
    ):
        return {"sampler": "other"}
    if type(sampler) is DistributedSampler:
        return {
            "sampler": "distributed",
            "seed": sampler.seed,
            "shuffle": sampler.shuffle,
            "drop_last": sampler.drop_last,
        }
    if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        return {"sampler": "random"}
    if type(sampler) is SequentialSampler:
        return {"sampler": "sequential"}
    return {"sampler": "other"}


def can_rebuild(state: LoaderState) -> bool:
    """Whether :func:`map_style_share` can rebuild this state's epoch."""
    order = state.order or {}
    return order.get("sampler") in {"random", "sequential", "distributed"} and (
        order.get("sampler") != "random" or state.rng is not None
    )


def _old_rank_indices(state: LoaderState, world: int, rank: int) -> list[int]:
    order = state.order or {}
    length = state.dataset_len or 0
    kind = order.get("sampler")
    if kind == "distributed":
        sampler: DistributedSampler[int] = DistributedSampler(
            range(length),  # type: ignore[arg-type]  # any sized object works
            num_replicas=world,
            rank=rank,
            shuffle=bool(order["shuffle"]),
            seed=int(order["seed"]),
            drop_last=bool(order["drop_last"]),
        )
        sampler.set_epoch(state.sampler_epoch or 0)
        return list(sampler)
    if kind == "sequential":
        return list(range(length))
    if kind == "random" and state.rng is not None:
        rng = decode_rng(state.rng["state"])
        generator = None
        if state.rng["source"] == "generator":
            generator = torch.Generator()
            generator.set_state(rng)
        else:
            torch.set_rng_state(rng)  # as a same-size resume restores it
        indices = iter(RandomSampler(range(length), generator=generator))
        if order.get("worker_seed_drawn"):
            # torch draws the workers' base seed between iter(sampler) and the
            # sampler's first (lazy) draw of the permutation: replay that draw.
            torch.empty((), dtype=torch.int64).random_(generator=generator)
        return list(indices)
    raise ValueError(f"cannot rebuild the order of sampler {kind!r}")


def map_style_share(
    state: LoaderState, world: int, rank: int, batch_size: int | None, drop_last: bool
) -> list[Any]:
    """This rank's index batches (or indices, without batching) for the rest of the epoch."""
    segments = state.segments
    old_world, consumed = segments[0]
    first = [
        elastic.batched(_old_rank_indices(state, old_world, r), batch_size, drop_last)
        for r in range(old_world)
    ]
    rest = elastic.advance(elastic.remaining(first, consumed), segments[1:], batch_size, drop_last)
    mine = elastic.my_share(rest, world, rank, batch_size, drop_last)
    if batch_size is None:
        return mine
    return elastic.batched(mine, batch_size, drop_last)


def ray_shares(
    plan_dataset: FileDataset | ray.data.Dataset,  # raydl's own plan only with ``direct``
    state: LoaderState,
    world: int,
    *,
    batch_size: int,
    drop_last: bool,
    buffer: int | None,
    buffer_seed: int | None,
    direct: DirectPlan | None,
) -> list[pa.Table]:
    """Per new rank: its rows of the rest of the epoch, as a table.

    ``direct``: the epoch ran on raydl's own actors as this plan (``direct.py``), so
    its streams are rebuilt the same way: the same runs (and exchange), loaded here.
    """
    import pyarrow as pa

    segments = state.segments
    old_world, consumed = segments[0]
    streams: Sequence[Any]
    if direct is not None:
        # The epoch ran on raydl's actors: its runs are loaded again here, and with
        # several ranks cut into what each rank had (its share of a global shuffle,
        # or the rows dealt to it, ``deal.py``).
        local = LocalRuns(direct, plan_context(plan_dataset))
        if old_world == 1:
            streams = [local]
        elif direct.exchange is not None:
            streams = local.shares(old_world)
        else:
            streams = local.dealt(old_world)
    elif old_world == 1:
        streams = [plan_dataset]
    else:
        streams = plan_dataset.streaming_split(old_world, equal=True)
    tables = _rest_of_streams(streams, consumed, batch_size, drop_last, buffer, buffer_seed)
    if not tables:
        return [pa.table({}) for _ in range(world)]
    rest = pa.concat_tables(tables)
    rows = elastic.advance(range(rest.num_rows), segments[1:], batch_size, drop_last)
    rest = rest.take(pa.array(rows, type=pa.int64()))
    return [
        rest.take(pa.array(elastic.take(range(rest.num_rows), start, stop), type=pa.int64()))
        for start, stop in elastic.shares(rest.num_rows, world, batch_size, drop_last)
    ]


class ShareHolder:
    """A Ray actor (``num_cpus=0``) holding each new rank's share until it fetched it.

    The shares go from rank 0 to the other ranks through Ray, not through the
    process group: Ray object references cannot travel through plain pickling
    (their owner would be unknown), actor handles can.
    """

    def __init__(self, shares: list[pa.Table]) -> None:
        self._shares = shares

    def share(self, rank: int) -> pa.Table:
        """Rank ``rank``'s rows."""
        return self._shares[rank]


def _rest_of_streams(
    streams: Sequence[Any],
    consumed: int,
    batch_size: int,
    drop_last: bool,
    buffer: int | None,
    buffer_seed: int | None,
) -> list[pa.Table]:
    """Each old rank's batches after ``consumed``, as tables, rank by rank.

    The old ranks' splits are read concurrently (``streaming_split`` serves its
    readers together), each with the local shuffle seed that rank used, and cut
    into batches by the same code as the loader's (``batching.ray_batches``).
    """
    from ray.data.block import BlockAccessor  # numpy batch -> Arrow, as map_batches does

    per_rank: list[list[pa.Table]] = [[] for _ in streams]
    errors: list[BaseException] = []

    def read(rank: int) -> None:
        seed = rank_seed(buffer_seed, rank) if len(streams) > 1 else buffer_seed
        try:
            batches = ray_batches(
                streams[rank],
                batch_size=batch_size,
                drop_last=drop_last,
                buffer=buffer,
                seed=seed,
            )
            for position, batch in enumerate(batches):
                if position >= consumed:
                    per_rank[rank].append(BlockAccessor.batch_to_block(batch))
        except BaseException as err:
            errors.append(err)

    threads = [
        threading.Thread(target=read, args=(r,), name=f"raydl-resume-split-{r}", daemon=True)
        for r in range(len(streams))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [table for tables in per_rank for table in tables]
