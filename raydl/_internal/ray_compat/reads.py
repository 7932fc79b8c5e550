"""Ray Data's file datasources that raydl builds on, their per-file hooks, the parquet switch.

Relies on these private parts of Ray Data (checked by :func:`check`):

* ``ImageDatasource`` (with its ``_FILE_EXTENSIONS``), ``ImageFileMetadataProvider``
  and ``BinaryDatasource`` in ``ray.data._internal.datasource``;
* ``FileBasedDatasource``'s per-file hooks ``_open_input_source(filesystem, path,
  **open_args)`` and ``_read_stream(f, path)``, and its ``_data_context`` (the
  ``DataContext`` the datasource was built under);
* ``DataContext.use_datasource_v2``, which picks the parquet reader ``read_parquet``
  builds;
* what ``ray.data.read_datasource`` does to build its plan (:func:`plan_read`):
  ``read_api._resolve_read_remote_args`` and ``_get_datasource_or_legacy_reader``,
  ``_internal.util.get_compute_strategy_for_read_api``, the logical operator
  ``Read``, ``LogicalPlan``, ``DatasetStats`` and ``Dataset(logical_plan, context,
  in_stats)``; ``auto_init_hook.auto_init_ray``, Ray's implicit start
  (:func:`before_read_tasks`).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ray.data._internal.datasource.binary_datasource import BinaryDatasource
from ray.data._internal.datasource.image_datasource import (
    ImageDatasource,
    ImageFileMetadataProvider,
)
from ray.data.datasource import Datasource

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs
    from ray.data.block import Block

__all__ = [
    "IMAGE_EXTENSIONS",
    "BinaryDatasource",
    "ImageDatasource",
    "ImageFileMetadataProvider",
    "RayFileRuns",
    "WholeFileGuard",
    "before_read_tasks",
    "check",
    "parquet_reader_v1",
    "plan_read",
    "read_datasource",
    "without_ray",
]

#: The file extensions ``ray.data.read_images`` reads by default.
IMAGE_EXTENSIONS: list[str] = list(ImageDatasource._FILE_EXTENSIONS)


class RayFileRuns(Datasource):
    """One of raydl's file sources (``io/files.py``, no Ray Data in it) as Ray Data's ``Datasource``.

    Ray Data plans and runs it as any datasource; raydl finds its source again
    (:attr:`raydl_source`, ``io.files.own_source``) to run the plan on its own actors
    or to reorder its files.
    """

    def __init__(self, source: Any) -> None:
        super().__init__()
        self.raydl_source = source

    def get_name(self) -> str:
        name: str = self.raydl_source.get_name()
        return name

    def estimate_inmemory_data_size(self) -> int | None:
        size: int | None = self.raydl_source.estimate_inmemory_data_size()
        return size

    def get_read_tasks(self, parallelism: int, *args: Any, **kwargs: Any) -> list[Any]:
        tasks: list[Any] = self.raydl_source.get_read_tasks(parallelism)
        return tasks

    def permuted(self, seed: int) -> RayFileRuns:
        """The same files in an order drawn from ``seed`` (``shuffle_mode="files"``)."""
        return RayFileRuns(self.raydl_source.permuted(seed))


class _Unreadable:
    """Stands in for a file that could not be opened, so the per-file read can leave it out."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __enter__(self) -> _Unreadable:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class WholeFileGuard:
    """Mixin for a subclass of one of Ray's ``FileBasedDatasource`` s: one file at a time.

    Each file is decoded whole before any of its blocks is yielded. A file that
    fails to open or decode is offered to :meth:`_may_leave_out`; if that says yes,
    :meth:`_left_out` is told and the file yields nothing (none of its rows, never
    part of them), else the error propagates. Put it before Ray's class in the
    bases: ``class Mine(WholeFileGuard, ImageDatasource)``.

    Overrides ``_open_input_source`` and ``_read_stream`` and reads ``_data_context``.
    """

    _data_context: Any

    def _may_leave_out(self, err: BaseException, retried_patterns: Sequence[str]) -> bool:
        """Whether the file that raised ``err`` may be left out (``retried_patterns``:
        the ``DataContext.retried_io_errors`` of the read)."""
        raise NotImplementedError

    def _left_out(self, path: str, err: BaseException) -> None:
        """``path`` was left out for ``err``."""
        raise NotImplementedError

    def _open_input_source(
        self, filesystem: pafs.FileSystem, path: str, **open_args: Any
    ) -> pa.NativeFile | _Unreadable:
        try:
            return super()._open_input_source(filesystem, path, **open_args)  # type: ignore[misc]
        except Exception as err:
            if not self._guards(err):
                raise
            return _Unreadable(err)

    def _read_stream(self, f: pa.NativeFile | _Unreadable, path: str) -> Iterator[Block]:
        if isinstance(f, _Unreadable):
            self._left_out(path, f.error)
            return
        read: Callable[[Any, str], Iterator[Block]] = super()._read_stream  # type: ignore[misc]
        try:
            blocks = list(read(f, path))
        except Exception as err:
            if not self._guards(err):
                raise
            self._left_out(path, err)
            return
        yield from blocks

    def _guards(self, err: BaseException) -> bool:
        return self._may_leave_out(err, self._data_context.retried_io_errors or ())


@contextlib.contextmanager
def parquet_reader_v1() -> Iterator[None]:
    """Build ``ray.data.read_parquet`` plans with Ray's first parquet reader, then restore.

    Ray 2.60's default (V2) parquet reader lists the files and reads every footer
    again at each execution, on 32 freshly started ``FooterReader`` actors, and
    packs up to 128 MiB into one read task: each epoch waits ~2-5 s before its
    first row and a small table is read by a single task. The V1 reader reads
    the metadata once, when the plan is built, and makes ``override_num_blocks``
    read tasks, so an epoch starts in ~0.1-0.3 s. Measured on a 2-core machine: an
    epoch of 1M rows in 16 files (filter + downsampling + global shuffle) took
    1.7-2.1 s this way, 8-9 s with the V2 reader, and 24-29 s with V1's default of
    200 read tasks.

    Sets ``DataContext.use_datasource_v2`` of the current context meanwhile.
    """
    from raydl._internal.ray_compat import context as data_context

    context = data_context.get_current()
    saved = context.use_datasource_v2
    context.use_datasource_v2 = False
    try:
        yield
    finally:
        context.use_datasource_v2 = saved


_planning = threading.local()  # raydl builds or inspects a plan on this thread, Ray or not


@contextlib.contextmanager
def without_ray() -> Iterator[None]:
    """While in it, raydl's datasources give their read tasks on this thread without Ray.

    For raydl's own look at a plan while Ray may still start: :func:`plan_read`, a
    plan's row count (``datasets.known_row_count``; Ray Data asks the datasource).
    """
    saved = getattr(_planning, "active", False)
    _planning.active = True
    try:
        yield
    finally:
        _planning.active = saved


def before_read_tasks() -> None:
    """What a raydl datasource's ``get_read_tasks`` does first: connect as Ray's API calls do.

    Ray Data asks a plan's datasource for its read tasks when it executes the plan
    or infers its metadata, and when it executes it then looks at the cluster's
    resources without connecting first (a plan built by Ray's readers was built
    connected). A plan built by :func:`plan_read` may be used by the script
    (``ds.count()``, ``ds.schema()``) before raydl's start ends: this makes Ray's
    implicit start happen there, which waits for raydl's start
    (``cluster.hold_auto_init``) and then finds its instance. Not within
    :func:`without_ray` (raydl's own look at a plan, which needs no Ray).

    Relies on ``ray._private.auto_init_hook.auto_init_ray``.
    """
    if getattr(_planning, "active", False):
        return
    from ray._private import auto_init_hook

    auto_init_hook.auto_init_ray()


def read_datasource(datasource: Any, *, cpus: int, **options: Any) -> Any:
    """``ray.data.read_datasource(datasource, **options)`` when Ray is up, else :func:`plan_read`.

    Never starts Ray (Ray's function would, or would wait for raydl's start).
    """
    import ray
    import ray.data

    from raydl._internal.ray_compat import context as data_context

    data_context.get_current()  # made first here, without Ray's state API (context.py)
    if ray.is_initialized():
        return ray.data.read_datasource(datasource, **options)
    return plan_read(datasource, cpus=cpus, **options)


def plan_read(datasource: Any, *, cpus: int, **options: Any) -> Any:
    """``ray.data.read_datasource(datasource, **options)``, built without Ray.

    Ray's function builds the same plan but first connects to Ray, starting it if
    it is down (``wrap_auto_init``, and the placement group it looks up). Nothing
    else of the plan depends on the cluster but its CPU count (the read tasks Ray
    makes without ``override_num_blocks``: ``cpus`` stands for it), so this builds
    it as Ray does, with Ray down: raydl's readers return while Ray starts in the
    background. The plan runs on Ray as any other; an executing call made before
    Ray is up waits for raydl's start (``cluster.hold_auto_init``).

    Relies on the steps of ``ray.data.read_datasource`` (module docstring); the plan
    is checked against Ray's own in ``tests/integration/test_sources.py``.

    Args:
        datasource: A Ray Data ``Datasource``.
        cpus: The CPUs of the cluster the plan will run on.
        **options: ``override_num_blocks``, ``concurrency``, ``num_cpus``, ``memory``,
            ``ray_remote_args`` and the other named arguments of
            ``ray.data.read_datasource``; the rest go to a legacy reader.
    """
    from ray.data import read_api
    from ray.data._internal.logical.interfaces import LogicalPlan
    from ray.data._internal.logical.operators.read_operator import Read
    from ray.data._internal.stats import DatasetStats
    from ray.data._internal.util import _autodetect_parallelism, get_compute_strategy_for_read_api
    from ray.data.dataset import Dataset
    from ray.util.placement_group import PlacementGroup

    from raydl._internal.ray_compat import context as data_context

    blocks = options.pop("override_num_blocks", None)
    parallelism = -1 if blocks is None else int(blocks)
    compute = options.pop("compute", None)
    concurrency = options.pop("concurrency", None)
    named = {
        name: options.pop(name, None)
        for name in (
            "num_cpus", "num_gpus", "memory", "label_selector", "fallback_strategy",
            "max_calls", "resources", "accelerator_type", "runtime_env", "ray_remote_args",
        )
    }  # fmt: skip
    ctx = data_context.get_current()
    remote_args = read_api._resolve_read_remote_args(datasource, ctx=ctx, **named)
    reader = read_api._get_datasource_or_legacy_reader(datasource, ctx, options)
    requested, _, _ = _autodetect_parallelism(
        parallelism,
        ctx.target_max_block_size,
        ctx,
        reader,
        placement_group=PlacementGroup.empty(),  # a driver's: none (Ray would look it up)
        avail_cpus=cpus,
    )
    with without_ray():
        tasks = reader.get_read_tasks(requested)
    stats = DatasetStats(
        metadata={"Read": [replace(task.metadata, input_files=None) for task in tasks]},
        parent=None,
    )
    read_op = Read(
        datasource,
        reader,
        parallelism=parallelism,
        num_outputs=len(tasks) if tasks else 0,
        ray_remote_args=remote_args,
        compute=get_compute_strategy_for_read_api(compute, concurrency),
    )
    context = ctx.copy()
    return Dataset(LogicalPlan(read_op, context), context, stats)


def check() -> None:
    """Fail if this Ray lacks the datasource internals used here (no cluster needed)."""
    import ray.data
    from ray.data.datasource import FileBasedDatasource

    for cls in (ImageDatasource, BinaryDatasource):
        if not issubclass(cls, FileBasedDatasource):
            raise TypeError(f"Ray's {cls.__name__} is no longer a FileBasedDatasource")
    if not IMAGE_EXTENSIONS or not all(isinstance(e, str) for e in IMAGE_EXTENSIONS):
        raise TypeError(f"Ray's ImageDatasource._FILE_EXTENSIONS is {IMAGE_EXTENSIONS!r}")
    hooks = {
        "_open_input_source": ["self", "filesystem", "path", "open_args"],
        "_read_stream": ["self", "f", "path"],
    }
    for name, params in hooks.items():
        found = list(inspect.signature(getattr(FileBasedDatasource, name)).parameters)
        if found != params:
            raise TypeError(f"Ray's FileBasedDatasource.{name} takes {found}, not {params}")
    if "_data_context" not in FileBasedDatasource.__init__.__code__.co_names:
        raise AttributeError("Ray's FileBasedDatasource no longer sets _data_context")
    if not isinstance(ray.data.DataContext.get_current().use_datasource_v2, bool):
        raise AttributeError("ray.data.DataContext has no use_datasource_v2 switch")
    from ray.data import read_api
    from ray.data._internal import util
    from ray.data._internal.logical.operators.read_operator import Read

    for module, name in (
        (read_api, "_resolve_read_remote_args"),
        (read_api, "_get_datasource_or_legacy_reader"),
        (util, "_autodetect_parallelism"),
        (util, "get_compute_strategy_for_read_api"),
    ):
        if not callable(getattr(module, name, None)):
            raise AttributeError(f"{module.__name__} has no {name} (plan_read needs it)")
    from ray._private import auto_init_hook

    if not callable(getattr(auto_init_hook, "auto_init_ray", None)):
        raise AttributeError("ray._private.auto_init_hook has no auto_init_ray")
    read_params = set(inspect.signature(Read.__init__).parameters)
    wanted = {"datasource", "datasource_or_legacy_reader", "parallelism", "num_outputs"}
    if not wanted <= read_params:
        raise TypeError(f"Ray's Read operator takes {sorted(read_params)}, not {sorted(wanted)}")
