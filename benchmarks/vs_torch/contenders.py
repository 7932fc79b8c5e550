"""The contenders: one class each, registered in ``REGISTRY``.

A contender builds a ``Loader`` for each kind of workload (``tabular``, ``images``,
``mapstyle``). Every contender gets the same CPU budget, ``NUM_CPUS``: torch
``num_workers``, Ray ``num_cpus``. To add a contender, write a ``Contender`` subclass
and add an instance to ``REGISTRY``; its position there is its place in the run order.

Under ``torch.distributed`` (``bench_vs_torch.py --ranks``: one process per rank) the
budget is the node's, shared by its ranks: torch ``num_workers=NUM_CPUS // world_size``
per rank, one Ray instance of ``num_cpus=NUM_CPUS`` that rank 0 starts and every rank joins.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from .config import NUM_CPUS, SEED, Batch, epoch_seed
from .lastmile import decode_stage, select_rows, select_stage
from .workloads import ImageData, MapStyleData, TabularData, WorkloadData
from .workloads.mapstyle import getitems_batch
from .workloads.tabular import (
    SHUFFLE_BUFFER,
    ParquetStream,
    ShuffleBuffer,
    to_torch,
)


class Loader:
    """One way to load one workload: ``epoch(e)`` returns the batches of epoch ``e``."""

    def epoch(self, epoch: int) -> Iterable[Batch]:
        """The batches of ``epoch``.

        Args:
            epoch: The epoch.

        Returns:
            An iterable over the epoch's batches.
        """
        raise NotImplementedError

    def close(self) -> None:
        """Release the loader's workers, if it has any."""


class EpochFn(Loader):
    """A loader that is a function of the epoch."""

    def __init__(self, fn: Callable[[int], Iterable[Batch]]) -> None:
        """Wrap ``fn``.

        Args:
            fn: Epoch -> its batches.
        """
        self.fn = fn

    def epoch(self, epoch: int) -> Iterable[Batch]:
        return self.fn(epoch)


class TorchLoader(Loader):
    """A torch-style loader (torch or raydl) reused across epochs."""

    def __init__(self, loader: Any, before_epoch: Callable[[int], None] | None = None) -> None:
        """Wrap ``loader``.

        Args:
            loader: A ``DataLoader`` or a ``RayDataLoader``.
            before_epoch: Called with the epoch before each ``iter()`` (``set_epoch``).
        """
        self.loader = loader
        self.before_epoch = before_epoch

    def epoch(self, epoch: int) -> Iterable[Batch]:
        if self.before_epoch is not None:
            self.before_epoch(epoch)
        return self.loader

    def close(self) -> None:
        close = getattr(self.loader, "close", None)
        if close is not None:
            close()


def world() -> tuple[int, int]:
    """This process's rank and the world size: the process group's, else a single process.

    Returns:
        ``(rank, world_size)``.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def start_ray(by_raydl: bool) -> None:
    """Start a local Ray limited to NUM_CPUS, quiet.

    ``by_raydl``: as raydl starts its embedded instance (``raydl.init``: lean, with token
    authentication), which is what a raydl user gets; else as a Ray Data user would.
    Under ``torch.distributed`` it is always ``raydl.init``, a collective call: rank 0
    starts the instance, the other ranks join it.
    """
    import ray
    from ray.data import DataContext

    if by_raydl or (dist.is_available() and dist.is_initialized()):
        import raydl

        raydl.init(num_cpus=NUM_CPUS)
    else:
        # address="local": always a fresh instance of our own, never another user's cluster.
        ray.init(
            address="local",
            num_cpus=NUM_CPUS,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.ERROR)


def tabular_workers(world_size: int) -> int:
    """The torch contender's ``num_workers`` per rank: its share of the node's ``NUM_CPUS``.

    Args:
        world_size: How many ranks share the node.

    Returns:
        The worker count (at least 1).
    """
    return max(1, NUM_CPUS // world_size)


def map_style_args(batch_size: int, num_workers: int = NUM_CPUS) -> dict[str, Any]:
    """A training script's map-style ``DataLoader`` call, identical for torch and raydl.

    Args:
        batch_size: Samples per batch.
        num_workers: The loader's workers (the CPU budget unless swept).

    Returns:
        The loader's keyword arguments.
    """
    return {
        "batch_size": batch_size,
        "shuffle": True,
        "num_workers": num_workers,
        "persistent_workers": True,
        "generator": torch.Generator().manual_seed(SEED),
    }


class Contender:
    """One contender: builds its ``Loader`` for each kind of workload."""

    #: The name on the command line and in the results.
    name: ClassVar[str]
    #: The workloads it runs; ``None``: all of them.
    workloads: ClassVar[frozenset[str] | None] = None
    #: Start a local Ray (``start_ray``) before building a loader.
    uses_ray: ClassVar[bool] = False
    #: Whether its Ray starts as raydl's embedded instance (``raydl.init``).
    raydl_starts_ray: ClassVar[bool] = False
    #: Runs one loader per rank under ``torch.distributed`` (``--ranks``; tabular only).
    multirank: ClassVar[bool] = False
    #: Its bars' colour in ``results.png`` (a matplotlib colour).
    colour: ClassVar[str] = "tab:purple"
    #: Seconds the script spends between building the loader and its first ``iter()``.
    pause_s: float = 0.0

    def runs(self, workload: str) -> bool:
        """Whether this contender runs ``workload``.

        Args:
            workload: The workload's name.

        Returns:
            Whether it is one of ``workloads``.
        """
        return self.workloads is None or workload in self.workloads

    def loader(self, data: WorkloadData) -> Loader:
        """This contender's loader for ``data``.

        Args:
            data: The loaded workload.

        Returns:
            The loader.
        """
        # A raydl user's script only calls raydl's readers or builds its loader, which start
        # the embedded Ray in the background (all of this machine's CPUs; its actors ask for
        # none): the cold start is measured as that user gets it. Ray Data's own contenders,
        # and every rank under torch.distributed (raydl.init, a collective), start Ray first.
        distributed = dist.is_available() and dist.is_initialized()
        if self.uses_ray and (not self.raydl_starts_ray or distributed):
            start_ray(self.raydl_starts_ray)
        if isinstance(data, TabularData):
            return self.tabular(data)
        if isinstance(data, ImageData):
            return self.images(data)
        return self.mapstyle(data)

    def tabular(self, data: TabularData) -> Loader:
        """The loader for the tabular workload.

        Args:
            data: The loaded workload.

        Returns:
            The loader.
        """
        raise NotImplementedError

    def images(self, data: ImageData) -> Loader:
        """The loader for an image workload.

        Args:
            data: The loaded workload.

        Returns:
            The loader.
        """
        raise NotImplementedError

    def mapstyle(self, data: MapStyleData) -> Loader:
        """The loader for a map-style workload.

        Args:
            data: The loaded workload.

        Returns:
            The loader.
        """
        raise NotImplementedError


def collated(dataset: Dataset, n: int, batch_size: int) -> Loader:
    """One process indexing ``dataset`` in each epoch's random order and collating batches.

    Args:
        dataset: A map-style dataset.
        n: Its length.
        batch_size: Samples per batch.

    Returns:
        The loader.
    """

    def limit_epoch(epoch: int) -> Iterator[Batch]:
        order = np.random.default_rng(epoch_seed(epoch, 1)).permutation(n)
        for start in range(0, n, batch_size):
            yield default_collate([dataset[int(i)] for i in order[start : start + batch_size]])

    return EpochFn(limit_epoch)


class Limit(Contender):
    """``limit``: one process doing the same work, no IPC."""

    name = "limit"
    colour = "tab:gray"

    def tabular(self, data: TabularData) -> Loader:
        files, spam = data.files, data.spam

        def limit_epoch(epoch: int) -> Iterator[dict[str, torch.Tensor]]:
            order = np.random.default_rng(epoch_seed(epoch, 1)).permutation(len(files))
            buffer = ShuffleBuffer(
                SHUFFLE_BUFFER, data.batch_size, np.random.default_rng(epoch_seed(epoch, 10))
            )
            for index in order:
                for batch in buffer.push(select_rows(pq.read_table(files[index]), epoch, spam)):
                    yield to_torch(batch)
            for batch in buffer.drain():
                yield to_torch(batch)

        return EpochFn(limit_epoch)

    def images(self, data: ImageData) -> Loader:
        return collated(data.dataset, len(data.paths), data.batch_size)

    def mapstyle(self, data: MapStyleData) -> Loader:
        return collated(data.dataset, data.n, data.batch_size)


class Torch(Contender):
    """``torch``: the idiomatic ``DataLoader``."""

    name = "torch"
    colour = "tab:orange"
    multirank = True

    def tabular(self, data: TabularData) -> Loader:
        # Under torch.distributed each rank reads its share of the files, as a
        # DistributedSampler would, with its share of the node's CPUs.
        rank, world_size = world()
        stream = ParquetStream(data.files, data.spam, rank=rank, world_size=world_size)
        loader = DataLoader(
            stream,
            batch_size=None,
            num_workers=tabular_workers(world_size),
            persistent_workers=True,
        )
        return TorchLoader(loader, before_epoch=stream.set_epoch)

    def images(self, data: ImageData) -> Loader:
        return TorchLoader(DataLoader(data.dataset, **map_style_args(data.batch_size)))

    def mapstyle(self, data: MapStyleData) -> Loader:
        return TorchLoader(DataLoader(data.dataset, **map_style_args(data.batch_size)))


class PlainRay(Contender):
    """``ray``: plain Ray Data ``iter_torch_batches`` over the same pipeline."""

    name = "ray"
    colour = "tab:green"
    uses_ray = True

    def tabular(self, data: TabularData) -> Loader:
        import ray
        from ray.data import FileShuffleConfig

        def ray_epoch(epoch: int) -> Iterable[Batch]:
            # Ray's own file shuffle: a new file order per epoch, streaming (no barrier).
            order = FileShuffleConfig(seed=epoch_seed(epoch, 1), reseed_after_execution=False)
            ds = select_stage(ray.data.read_parquet(data.files, shuffle=order), epoch, data.spam)
            return ds.iter_torch_batches(
                batch_size=data.batch_size,
                local_shuffle_buffer_size=SHUFFLE_BUFFER,
                local_shuffle_seed=epoch_seed(epoch, 10),
            )

        return EpochFn(ray_epoch)

    def images(self, data: ImageData) -> Loader:
        import ray
        from ray.data import FileShuffleConfig

        filesystem = data.arrow_filesystem()

        def ray_epoch(epoch: int) -> Iterable[Batch]:
            # Ray's own file shuffle (a new file order per epoch) + its local buffer.
            files = ray.data.read_binary_files(
                data.paths,
                include_paths=True,
                filesystem=filesystem,
                shuffle=FileShuffleConfig(seed=epoch_seed(epoch, 1), reseed_after_execution=False),
            )
            return decode_stage(files, data.batch_size).iter_torch_batches(
                batch_size=data.batch_size,
                local_shuffle_buffer_size=data.shuffle_buffer,
                local_shuffle_seed=epoch_seed(epoch, 10),
            )

        return EpochFn(ray_epoch)

    def mapstyle(self, data: MapStyleData) -> Loader:
        import ray

        def ray_epoch(epoch: int) -> Iterable[Batch]:
            ds = ray.data.range(data.n).random_shuffle(seed=epoch_seed(epoch, 1))
            ds = ds.map_batches(
                getitems_batch,  # type: ignore[arg-type]  # Ray's stub has no room for fn_kwargs
                batch_size=data.batch_size,
                batch_format="numpy",
                fn_kwargs={"dataset": data.dataset},
            )
            return ds.iter_torch_batches(batch_size=data.batch_size)

        return EpochFn(ray_epoch)


class RayDL(Contender):
    """``raydl``: ``RayDataLoader``."""

    name = "raydl"
    colour = "tab:blue"
    uses_ray = True
    raydl_starts_ray = True
    multirank = True  # the loader splits every epoch across the ranks itself
    #: The tabular workload's ``shuffle_mode``.
    tabular_shuffle_mode: ClassVar[str] = "files"

    def tabular(self, data: TabularData) -> Loader:
        import raydl

        # raydl's own reader, and the per-epoch draw as a PerEpoch pipeline: one loader for
        # the whole run, so it can start each epoch while the previous one drains.
        table, spam = raydl.read_parquet(data.files), data.spam
        loader = raydl.RayDataLoader(
            raydl.PerEpoch(lambda epoch: select_stage(table, epoch, spam)),
            batch_size=data.batch_size,
            shuffle=True,
            shuffle_mode=self.tabular_shuffle_mode,
            local_shuffle_buffer_size=SHUFFLE_BUFFER,
            seed=SEED,
        )
        return TorchLoader(loader, before_epoch=loader.set_epoch)

    def images(self, data: ImageData) -> Loader:
        import raydl

        # raydl's own file reader (many files per task), the same decode stage.
        files = raydl.read_binary_files(
            data.paths, include_paths=True, filesystem=data.arrow_filesystem()
        )
        loader = raydl.RayDataLoader(
            decode_stage(files, data.batch_size),
            batch_size=data.batch_size,
            shuffle=True,
            shuffle_mode="files",
            local_shuffle_buffer_size=data.shuffle_buffer,
            seed=SEED,
        )
        return TorchLoader(loader, before_epoch=loader.set_epoch)

    def mapstyle(self, data: MapStyleData) -> Loader:
        from raydl import RayDataLoader

        return TorchLoader(RayDataLoader(data.dataset, **map_style_args(data.batch_size)))


class RayDLGlobal(RayDL):
    """``raydl_global``: ``RayDataLoader`` with a global shuffle (tabular only)."""

    name = "raydl_global"
    colour = "tab:cyan"
    workloads = frozenset({"tabular"})
    tabular_shuffle_mode = "global"


#: The workloads a sweep covers: a torch map-style ``Dataset`` (images: its ``dataset``).
SWEPT_WORKLOADS = frozenset({"mapstyle", "mapstyle_decode", "images", "images_rgb224"})


class RayDLAuto(Contender):
    """``raydl_auto``: the map-style call with ``num_workers="auto"``, ``prefetch_factor="auto"``.

    Within the benchmark's CPU budget (``cpu_budget=NUM_CPUS``, as every contender
    gets ``NUM_CPUS``); the image workloads through their map-style ``Dataset``, as
    the sweep's ``raydl_wN`` do, so that the table compares it with their best.
    """

    name = "raydl_auto"
    colour = "tab:olive"
    uses_ray = True
    raydl_starts_ray = True
    workloads = SWEPT_WORKLOADS

    def images(self, data: ImageData) -> Loader:
        return self._auto(data.dataset, data.batch_size)

    def mapstyle(self, data: MapStyleData) -> Loader:
        return self._auto(data.dataset, data.batch_size)

    def _auto(self, dataset: Dataset, batch_size: int) -> Loader:
        from raydl import RayDataLoader

        args: dict[str, Any] = {**map_style_args(batch_size), "num_workers": "auto"}
        loader = RayDataLoader(dataset, **args, prefetch_factor="auto", cpu_budget=NUM_CPUS)
        return TorchLoader(loader)


REGISTRY: dict[str, Contender] = {
    c.name: c for c in (Limit(), Torch(), PlainRay(), RayDL(), RayDLGlobal(), RayDLAuto())
}

#: The contenders ``--sweep-workers`` runs at each ``num_workers`` (``torch_w4``, ``raydl_w4``);
#: ``raydl_auto`` is compared with their best.
SWEPT = ("torch", "raydl")

_VARIANT = re.compile(r"^(?P<base>[a-z_]+?)(?:_w(?P<workers>\d+))?(?:_pause(?P<pause>\d+))?$")


class Variant(Contender):
    """A registered contender at another ``num_workers`` and/or with a pause before ``iter()``.

    ``torch_w4``: torch's map-style ``DataLoader`` with ``num_workers=4``; ``raydl_w4``: the
    same call on ``RayDataLoader`` (on the image workloads too: their map-style ``Dataset``,
    the drop-in path, not raydl's file reader). ``raydl_pause3``: ``raydl`` built, then 3 s
    of the script's own work, then ``iter()`` (a cold start; issue 18).
    """

    def __init__(self, name: str, base: Contender, workers: int | None, pause_s: float) -> None:
        self.name = name  # type: ignore[misc]  # an instance's name, not the class's
        self.base = base
        self.workers = workers
        self.pause_s = pause_s
        self.uses_ray = base.uses_ray  # type: ignore[misc]
        self.raydl_starts_ray = base.raydl_starts_ray  # type: ignore[misc]
        self.colour = base.colour  # type: ignore[misc]
        self.workloads = (  # type: ignore[misc]
            base.workloads if workers is None else frozenset(SWEPT_WORKLOADS)
        )

    def tabular(self, data: TabularData) -> Loader:
        return self.base.tabular(data)

    def images(self, data: ImageData) -> Loader:
        if self.workers is None:
            return self.base.images(data)
        return self._map_style(data.dataset, data.batch_size)

    def mapstyle(self, data: MapStyleData) -> Loader:
        if self.workers is None:
            return self.base.mapstyle(data)
        return self._map_style(data.dataset, data.batch_size)

    def _map_style(self, dataset: Dataset, batch_size: int) -> Loader:
        assert self.workers is not None
        if self.base.name == "torch":
            return TorchLoader(DataLoader(dataset, **map_style_args(batch_size, self.workers)))
        from raydl import RayDataLoader

        return TorchLoader(RayDataLoader(dataset, **map_style_args(batch_size, self.workers)))


def contender(name: str) -> Contender:
    """The contender called ``name``: a ``REGISTRY`` entry or a :class:`Variant` of one.

    Args:
        name: ``raydl``, ``torch_w4``, ``raydl_pause3``, ``raydl_w4_pause3``, ...

    Returns:
        The contender.

    Raises:
        KeyError: No such contender.
    """
    if name in REGISTRY:
        return REGISTRY[name]
    match = _VARIANT.match(name)
    if match is None or match["base"] not in REGISTRY or name == match["base"]:
        raise KeyError(f"no contender {name!r}; known: {', '.join(REGISTRY)} and their variants")
    workers = int(match["workers"]) if match["workers"] else None
    if workers is not None and match["base"] not in SWEPT:
        raise KeyError(f"{name!r}: only {', '.join(SWEPT)} take a worker count")
    return Variant(name, REGISTRY[match["base"]], workers, float(match["pause"] or 0))


def contenders_for(workload: str) -> list[str]:
    """The contenders that run ``workload``, in run order.

    Args:
        workload: The workload's name.

    Returns:
        The contenders' names.
    """
    return [name for name, contender in REGISTRY.items() if contender.runs(workload)]
