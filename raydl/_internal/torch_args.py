"""torch's ``DataLoader`` arguments: its checks, its errors and its sampler defaults.

:func:`check` and :func:`with_defaults` follow ``torch.utils.data.DataLoader.__init__`` line by line, so
a script that torch rejects is rejected here with torch's message, and one that
torch accepts gets the same sampler, batch sampler and collate function. The one
raydl addition: under several ranks a map-style dataset without a sampler is
sharded with a ``DistributedSampler``, as if the script had passed one.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    IterableDataset,
    IterDataPipe,
    RandomSampler,
    Sampler,
    SequentialSampler,
)
from torch.utils.data._utils.collate import default_collate, default_convert
from torch.utils.data.dataloader import _InfiniteConstantSampler
from torch.utils.data.graph_settings import apply_shuffle_settings

from raydl._internal.runtime.world import World
from raydl.pipelines import PerEpoch

#: The kinds of dataset, as a saved state names them.
MAP, ITERABLE, RAY = "map", "iterable", "ray"

#: ``num_workers`` / ``prefetch_factor``: tuned by the loader (``stream/autotune.py``).
AUTO = "auto"


def is_auto(value: Any, option: str) -> bool:
    """Whether ``value`` is ``"auto"``; any other string is an error naming ``option``.

    Ints (and whatever else torch accepts) go on to torch's own checks unchanged.
    """
    if not isinstance(value, str):
        return False
    if value == AUTO:
        return True
    raise ValueError(
        f"{option} option should be a non-negative int or 'auto', got {option}={value!r}; "
        f"use {option}='auto' to let the loader tune it"
    )


def dataset_kind(obj: object) -> str:
    """``"ray"`` for a ``ray.data.Dataset``, a raydl read's plan or :class:`PerEpoch`, else
    torch's two kinds."""
    plans = sys.modules.get("raydl._internal.io.file_dataset")  # imported if obj is one
    if isinstance(obj, PerEpoch) or (plans is not None and isinstance(obj, plans.FileDataset)):
        return RAY
    if any(
        c.__module__.startswith("ray.data") and c.__name__ == "Dataset" for c in type(obj).__mro__
    ):
        return RAY
    return ITERABLE if isinstance(obj, IterableDataset) else MAP


@dataclass(frozen=True)
class TorchArgs:
    """torch's arguments after torch's checks and defaults.

    Attributes:
        kind: ``"map"``, ``"iterable"`` or ``"ray"``.
        shuffle: Reshuffle every epoch.
        batch_size: ``None`` when a ``batch_sampler`` batches (or batching is off).
        drop_last: Drop the last incomplete batch.
        sampler: The index sampler (``None`` for Ray Data sources).
        batch_sampler: The batch sampler, when batching is automatic.
        collate_fn: The collate function (torch's default for the kind).
        prefetch_factor: ``None`` without workers, as in torch.
        auto_sharded: ``sampler`` is the ``DistributedSampler`` raydl added.
        multiprocessing_context: torch's context object (a start method's name
            resolved), or ``None``; checked as torch checks it, not used.
        auto_workers: ``num_workers="auto"`` (then checked as torch checks ``1``).
        auto_prefetch: ``prefetch_factor="auto"`` (``prefetch_factor`` is then 2, the start).
    """

    kind: str
    shuffle: bool
    batch_size: int | None
    drop_last: bool
    sampler: Any
    batch_sampler: Any
    collate_fn: Callable[[Any], Any] | None
    prefetch_factor: int | None
    auto_sharded: bool
    multiprocessing_context: Any = None
    auto_workers: bool = False
    auto_prefetch: bool = False


def check(
    dataset: Any,
    *,
    batch_size: int | None,
    shuffle: bool | None,
    sampler: Sampler[Any] | Iterable[Any] | None,
    batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None,
    num_workers: int | str,
    collate_fn: Callable[[Any], Any] | None,
    drop_last: bool,
    timeout: float,
    prefetch_factor: int | str | None,
    persistent_workers: bool,
    multiprocessing_context: Any = None,
) -> TorchArgs:
    """Check torch's arguments as torch does, in torch's order, with torch's errors.

    The result holds the arguments as given (after torch's rewrites of
    ``batch_size``, ``drop_last`` and ``prefetch_factor``); :func:`with_defaults`
    adds torch's samplers and collate function. An ``IterDataPipe``'s shufflers
    are switched on or off by ``shuffle`` (torch's ``apply_shuffle_settings``,
    in place), as torch's ``DataLoader`` does.

    ``num_workers="auto"`` is checked as torch checks ``num_workers=1`` (it starts
    there), ``prefetch_factor="auto"`` as ``2``; both need a map-style dataset
    (for a ``ray.data.Dataset`` they are ignored, as ``num_workers`` is).
    """
    auto_workers = is_auto(num_workers, "num_workers")
    auto_prefetch = is_auto(prefetch_factor, "prefetch_factor")
    kind = dataset_kind(dataset)
    if kind == ITERABLE and (auto_workers or auto_prefetch):
        option = "num_workers" if auto_workers else "prefetch_factor"
        raise ValueError(
            f"{option}='auto' needs a map-style dataset, but got an IterableDataset: its "
            "batches come round-robin from its workers and its sharding reads "
            "get_worker_info().num_workers, so its order depends on the worker count, "
            f"which 'auto' would change while it runs; pass an int (e.g. {option}=2)"
        )
    if auto_workers:
        num_workers = 1
    if auto_prefetch:
        prefetch_factor = 2
    assert not isinstance(num_workers, str) and not isinstance(prefetch_factor, str)
    if num_workers < 0:
        raise ValueError(
            "num_workers option should be non-negative; "
            "use num_workers=0 to disable multiprocessing."
        )
    if timeout < 0:
        raise ValueError("timeout option should be non-negative")
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError(
            "prefetch_factor option could only be specified in multiprocessing."
            "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None."
        )
    if num_workers > 0 and prefetch_factor is None:
        prefetch_factor = 2
    elif prefetch_factor is not None and prefetch_factor < 0:
        raise ValueError("prefetch_factor option should be non-negative")
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers option needs num_workers > 0")

    if kind != RAY and num_workers == 0 and timeout > 0:
        raise ValueError(
            f"timeout option needs num_workers > 0, but got timeout={timeout!r} with "
            "num_workers=0: without workers the batches load in this process (as in torch), "
            "where a wait cannot be bounded; use num_workers=1 to load on a Ray actor with a "
            "timeout, or timeout=0"
        )
    if kind != RAY:
        multiprocessing_context = check_multiprocessing_context(
            multiprocessing_context, num_workers
        )
    if kind != MAP:
        name = "IterableDataset" if kind == ITERABLE else "ray.data.Dataset"
        if isinstance(dataset, IterDataPipe):
            if shuffle is not None:
                apply_shuffle_settings(dataset, shuffle=shuffle)
            shuffle = None  # the pipe's shufflers shuffle; the loader draws no order
        elif kind == ITERABLE and shuffle not in {False, None}:
            raise ValueError(
                f"DataLoader with IterableDataset: expected unspecified shuffle option, but got shuffle={shuffle}"
            )
        if sampler is not None:
            raise ValueError(
                f"DataLoader with {name}: expected unspecified sampler option, but got sampler={sampler}"
            )
        if batch_sampler is not None:
            raise ValueError(
                f"DataLoader with {name}: expected unspecified "
                f"batch_sampler option, but got batch_sampler={batch_sampler}"
            )
        if kind == RAY and batch_size is None:
            raise ValueError(
                "DataLoader with ray.data.Dataset: batch_size=None (no automatic batching) "
                "is not supported; use batch_size=1 for one row per batch."
            )
    shuffle = bool(shuffle)
    if sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle")
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ValueError(
                "batch_sampler option is mutually exclusive "
                "with batch_size, shuffle, sampler, and "
                "drop_last"
            )
        batch_size = None
        drop_last = False
    elif batch_size is None and drop_last:
        raise ValueError(
            "batch_size=None option disables auto-batching and is mutually exclusive with drop_last"
        )

    return TorchArgs(
        kind=kind,
        shuffle=shuffle,
        batch_size=batch_size,
        drop_last=drop_last,
        sampler=sampler,
        batch_sampler=batch_sampler,
        collate_fn=collate_fn,
        prefetch_factor=prefetch_factor,
        auto_sharded=False,
        multiprocessing_context=multiprocessing_context,
        auto_workers=auto_workers and kind == MAP,
        auto_prefetch=auto_prefetch and kind == MAP,
    )


def check_snapshot_every(every: Any) -> None:
    """torchdata's ``snapshot_every_n_steps``: ``None`` or an int of at least 0."""
    if every is None:
        return
    if not isinstance(every, int) or isinstance(every, bool):
        raise TypeError(
            f"snapshot_every_n_steps should be an int or None, got {every!r}; pass e.g. "
            "snapshot_every_n_steps=1 (every batch) or None (only at each epoch's start)"
        )
    if every < 0:
        raise ValueError(
            f"snapshot_every_n_steps should be non-negative, got {every!r}; use 0 or None "
            "to capture the workers' states only at each epoch's start"
        )


def check_multiprocessing_context(context: Any, num_workers: int) -> Any:
    """torch's check of ``multiprocessing_context``; a start method's name becomes its context.

    raydl starts no subprocesses (its workers are Ray actors), so the context is
    not used; it is still refused where torch refuses it, with torch's errors.
    """
    if context is None:
        return None
    if num_workers == 0:
        raise ValueError(
            "multiprocessing_context can only be used with multi-process loading "
            f"(num_workers > 0), but got num_workers={num_workers}"
        )
    if isinstance(context, str):
        valid_start_methods = torch.multiprocessing.get_all_start_methods()
        if context not in valid_start_methods:
            raise ValueError(
                "multiprocessing_context option should specify a valid start method in "
                f"{valid_start_methods!r}, but got multiprocessing_context={context!r}"
            )
        context = torch.multiprocessing.get_context(context)
    if not isinstance(context, multiprocessing.context.BaseContext):
        raise TypeError(
            "multiprocessing_context option should be a valid context object or a string "
            f"specifying the start method, but got multiprocessing_context={context}"
        )
    return context


def local_cpu_count() -> int | None:
    """The CPUs this process may use (its affinity mask where known), as torch counts them."""
    if hasattr(os, "sched_getaffinity"):
        try:
            return len(os.sched_getaffinity(0))
        except OSError:
            pass
    return os.cpu_count()


def warn_excessive_workers(num_workers: int, cpus: float | None, where: str) -> None:
    """torch's warning when a loader starts more workers than there are CPUs for them.

    ``cpus``: the CPUs the loader's actors may use (``None``: unknown); ``where``
    names them ("the Ray cluster", "this machine").
    """
    if num_workers == 0 or (cpus is not None and num_workers <= cpus):
        return
    suggestion = (
        f"Our suggested max number of worker in current system is {int(cpus)} (the CPUs of "
        f"{where}), which is smaller than what this DataLoader is going to create."
        if cpus is not None
        else "DataLoader is not able to compute a suggested max number of worker in current system."
    )
    warnings.warn(
        f"This DataLoader will create {num_workers} worker processes (Ray actors) in total. "
        f"{suggestion} Please be aware that excessive worker creation might get DataLoader "
        "running slow or even freeze, lower the worker number to avoid potential "
        "slowness/freeze if necessary.",
        UserWarning,
        stacklevel=4,
    )


def with_defaults(
    args: TorchArgs,
    dataset: Any,
    *,
    generator: torch.Generator | None,
    seed: int | None,
    world: World,
) -> TorchArgs:
    """``args`` with torch's default sampler, batch sampler and collate function filled in.

    Under several ranks a map-style dataset without a sampler gets a
    ``DistributedSampler`` (``seed`` or 0), as if the script had passed one.
    """
    kind, shuffle, sampler = args.kind, args.shuffle, args.sampler
    batch_size, batch_sampler, collate_fn = args.batch_size, args.batch_sampler, args.collate_fn
    auto_sharded = False
    if kind == ITERABLE:
        sampler = _InfiniteConstantSampler()
    elif kind == MAP and sampler is None and batch_sampler is None and world.is_distributed:
        sampler = DistributedSampler(
            dataset,
            num_replicas=world.world_size,
            rank=world.rank,
            shuffle=shuffle,
            seed=seed or 0,
        )
        auto_sharded = True
    elif kind == MAP and sampler is None:
        sampler = (
            RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
        )
    if batch_size is not None and batch_sampler is None and sampler is not None:
        batch_sampler = BatchSampler(sampler, batch_size, args.drop_last)
    if collate_fn is None and kind != RAY:
        collate_fn = default_collate if batch_sampler is not None else default_convert
    return replace(
        args,
        sampler=sampler,
        batch_sampler=batch_sampler,
        collate_fn=collate_fn,
        auto_sharded=auto_sharded,
    )
