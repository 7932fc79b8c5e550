"""raydl's own plan of a file read and its ``map_batches`` stages, kept without Ray Data.

``raydl.read_parquet`` and ``raydl.read_binary_files`` return a :class:`FileDataset`
where raydl's own source reads the files (``io/files.py``, ``io/parquet.py``). It
records the read and each plain ``map_batches`` call as given, and is what the
loader's direct path runs (``epochs/direct.py``): nothing of it imports Ray Data, so
neither does the training process of such a loader (Ray Data and the pandas it
imports are about 60 MB of a trainer's memory and 0.5 s of its start;
docs/design/direct-execution.md, "The floor").

Everything else a ``ray.data.Dataset`` does is forwarded: :meth:`FileDataset.to_ray`
builds the same read and stages as a Ray Data plan (once), and any other attribute
(``filter``, ``random_shuffle``, ``take``, ``count``, ``schema``, ...) is that
plan's. A ``map_batches`` call raydl does not record (an actor class, ``compute``,
``concurrency``, resources other than ``num_cpus``, Ray's remote arguments) returns
Ray Data's plan with the stage added, as Ray Data's own ``map_batches`` would.
``isinstance(..., ray.data.Dataset)`` is false for it.

The stage views (:meth:`FileDataset.plain_plan`) are what Ray Data's ``map_batches``
would have put in its plan for the same call (``MapBatches`` fields after Ray's
defaults); ``tests/unit/test_file_dataset.py`` checks them against Ray's.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from raydl._internal.io.files import FileRunsDatasource
from raydl._internal.ray_compat.context import DEFAULT_SCHEDULING_STRATEGY
from raydl._internal.ray_compat.plans import MapBatchesView, ReadView

if TYPE_CHECKING:
    import ray.data

__all__ = ["FileDataset", "plan_of"]

#: The ``map_batches`` arguments a recorded stage may have; any other hands the call to Ray.
RECORDED_ARGS = frozenset(
    {"batch_size", "batch_format", "zero_copy_batch", "fn_args", "fn_kwargs", "num_cpus"}
)
#: Ray Data's batch formats (``ray.data.block.VALID_BATCH_FORMATS`` without ``cudf``),
#: and what its ``"default"`` means.
BATCH_FORMATS = ("numpy", "pandas", "pyarrow", None)
DEFAULT_BATCH_FORMAT = "numpy"
#: The read options a plan without Ray Data honours: the block count of Ray's read tasks
#: (the direct path cuts its own runs). Any other (resources, ``concurrency``) is Ray's.
PLAIN_READ_OPTIONS = frozenset({"override_num_blocks"})


class FileDataset:
    """A lazy read of listed files by raydl's own source, with its ``map_batches`` stages.

    Returned by :func:`raydl.read_parquet` and :func:`raydl.read_binary_files`; pass
    it to :class:`raydl.RayDataLoader`. It behaves as the ``ray.data.Dataset`` of the
    same read: any method other than a plain ``map_batches`` (``filter``,
    ``random_shuffle``, ``take``, ``count``, ...) builds that Ray Data plan
    (:meth:`to_ray`) and is called there.

    Example:
        >>> import raydl
        >>> ds = raydl.read_parquet("s3://bucket/events/")  # doctest: +SKIP
        >>> ds = ds.map_batches(featurize, batch_size=512)  # doctest: +SKIP
        >>> loader = raydl.RayDataLoader(ds, batch_size=256, shuffle=True)  # doctest: +SKIP
    """

    def __init__(
        self,
        source: FileRunsDatasource,
        *,
        read_options: Mapping[str, Any],
        cpus: int,
        stages: tuple[tuple[Callable[..., Any], dict[str, Any]], ...] = (),
        origin: FileDataset | None = None,
    ) -> None:
        """A plan of ``source``'s read (``read_options``: :data:`PLAIN_READ_OPTIONS`;
        ``cpus``: the cluster's, for Ray's read tasks) and the recorded ``stages``;
        ``origin``: the plan it was derived from (its Ray Data plan and context come first).

        Raises:
            ValueError: A read option raydl's plan does not take (the readers give such a
                read to Ray Data at once), or ``override_num_blocks`` is not a positive int.
        """
        unknown = set(read_options) - PLAIN_READ_OPTIONS
        if unknown:
            raise ValueError(f"FileDataset takes no read options {sorted(unknown)}")
        blocks = read_options.get("override_num_blocks")
        if blocks is not None and (type(blocks) is not int or blocks < 1):
            raise ValueError(
                f"override_num_blocks should be a positive int, got {blocks!r}; "
                "leave it out to let Ray choose"
            )
        self._source = source
        self._read_options = dict(read_options)
        self._cpus = cpus
        self._stages = stages
        self._origin = origin
        self._ray: Any = None  # the Ray Data plan, once built
        self._lock = threading.Lock()

    # -- what raydl reads ----------------------------------------------------------------

    @property
    def source(self) -> FileRunsDatasource:
        """The files and how a run of them is read (``io/files.py``)."""
        return self._source

    def data_context(self) -> Any:
        """The ``DataContext`` this plan's epochs run under, without importing Ray Data.

        The Ray Data plan's own (``ds.context``, a copy a user may have changed) once it is
        built, here or in the plan this one derives from; else the process's current one
        where Ray Data is imported (made without Ray's state API, ``ray_compat.context``);
        else ``None``: Ray Data's defaults.
        """
        if self._ray is not None:
            return self._ray.context
        if self._origin is not None:
            return self._origin.data_context()
        if "ray.data" not in sys.modules:
            return None
        from raydl._internal.ray_compat import context as data_context

        return data_context.get_current()

    def map_batches(self, fn: Any, **kwargs: Any) -> FileDataset | ray.data.Dataset:
        """The plan with ``fn`` applied to batches, as ``ray.data.Dataset.map_batches``.

        A function (not a class) with only ``batch_size`` (an int or ``None``),
        ``batch_format``, ``zero_copy_batch``, ``fn_args``, ``fn_kwargs`` and
        ``num_cpus`` is recorded here; any other call is Ray Data's, on :meth:`to_ray`.
        """
        if not _recordable(fn, kwargs):
            return self.to_ray().map_batches(fn, **kwargs)
        return FileDataset(
            self._source,
            read_options=self._read_options,
            cpus=self._cpus,
            stages=(*self._stages, (fn, dict(kwargs))),
            origin=self,
        )

    def permuted(self, seed: int) -> FileDataset:
        """The same plan reading the files in an order drawn from ``seed`` (``shuffle_mode="files"``)."""
        return FileDataset(
            self._source.permuted(seed),
            read_options=self._read_options,
            cpus=self._cpus,
            stages=self._stages,
            origin=self,
        )

    def plain_plan(self) -> tuple[ReadView, list[MapBatchesView]]:
        """The read and the stages as Ray Data's plan would show them."""
        context = self.data_context()
        strategy = DEFAULT_SCHEDULING_STRATEGY if context is None else context.scheduling_strategy
        read = ReadView(
            name=f"Read{self._source.get_name()}",
            datasource=self._source,
            ray_remote_args={"scheduling_strategy": strategy},  # as Ray's read_datasource
            concurrency=None,
        )
        return read, [_view(fn, kwargs) for fn, kwargs in self._stages]

    def stage_names(self) -> tuple[str, ...]:
        """The names of the read and the stages (``ReadParquet``, ``MapBatches(decode)``)."""
        return (f"Read{self._source.get_name()}", *(_name(fn) for fn, _ in self._stages))

    def known_row_count(self) -> int | None:
        """The rows the plan yields, where known without running it: a read without stages
        (a ``map_batches`` stage may change the count, as Ray Data assumes)."""
        return None if self._stages else self._source.row_count()

    # -- Ray Data ------------------------------------------------------------------------

    def to_ray(self) -> ray.data.Dataset:
        """The same read and stages as a ``ray.data.Dataset`` (built once; imports Ray Data).

        Built without starting Ray where it is down (``ray_compat.reads.read_datasource``).
        A ``map_batches`` of a plan is that plan's Ray Data plan with the stage added, as in
        Ray Data: they share its context.
        """
        origin = self._origin
        with self._lock:
            if self._ray is None:
                if origin is not None and origin._source is self._source:  # one more stage
                    fn, kwargs = self._stages[-1]
                    self._ray = origin.to_ray().map_batches(fn, **kwargs)  # its context, too
                else:
                    from raydl._internal.io.files import as_ray_datasource
                    from raydl._internal.ray_compat import reads

                    dataset = reads.read_datasource(
                        as_ray_datasource(self._source), cpus=self._cpus, **self._read_options
                    )
                    for fn, kwargs in self._stages:
                        dataset = dataset.map_batches(fn, **kwargs)
                    self._ray = dataset
            return self._ray

    def __getattr__(self, name: str) -> Any:
        """Any other public attribute is the Ray Data plan's (:meth:`to_ray`), and so are the
        few private ones raydl's tests and Ray's users read (:data:`FORWARDED_PRIVATE`)."""
        if name.startswith("_") and name not in FORWARDED_PRIVATE:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.to_ray(), name)

    def __bool__(self) -> bool:  # as Ray's: a plan is never empty-looking (no __len__)
        return True

    def __len__(self) -> int:
        """Refused, with Ray Data's message (a plan's length is only known by running it)."""
        raise AttributeError(
            "Use `ds.count()` to compute the length of a distributed Dataset. "
            "This may be an expensive operation."
        )

    def __iter__(self) -> Any:
        """Refused, with Ray Data's message."""
        raise TypeError(
            "`Dataset` objects aren't iterable. To iterate records, call "
            "`ds.iter_rows()` or `ds.iter_batches()`; to load it as a torch DataLoader "
            "would, pass it to raydl.RayDataLoader."
        )

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ray": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def __repr__(self) -> str:
        files = len(self._source.files)
        return f"FileDataset({' -> '.join(self.stage_names())}, {files} files)"


def plan_of(
    source: FileRunsDatasource, read_options: Mapping[str, Any], cpus: int
) -> FileDataset | ray.data.Dataset:
    """A raydl reader's plan of ``source``: a :class:`FileDataset`, or, with a read option
    it does not take (resources, ``concurrency``), Ray Data's plan of the read, built now
    so that Ray's checks of those options run at the read."""
    if set(read_options) <= PLAIN_READ_OPTIONS:
        return FileDataset(source, read_options=read_options, cpus=cpus)
    from raydl._internal.io.files import as_ray_datasource
    from raydl._internal.ray_compat import reads

    return reads.read_datasource(as_ray_datasource(source), cpus=cpus, **read_options)


#: The private attributes of a ``ray.data.Dataset`` a :class:`FileDataset` forwards; any
#: other (a notebook's ``_repr_mimebundle_``, a ``hasattr`` probe) is not there, rather
#: than building the Ray Data plan.
FORWARDED_PRIVATE = frozenset({"_logical_plan", "_plan", "_meta_count"})


def _recordable(fn: Any, kwargs: Mapping[str, Any]) -> bool:
    """Whether a ``map_batches(fn, **kwargs)`` call is one raydl records (see :meth:`FileDataset.map_batches`)."""
    if not callable(fn) or inspect.isclass(fn) or not set(kwargs) <= RECORDED_ARGS:
        return False
    if inspect.ismethod(fn) and "ray.data" in sys.modules:
        from ray.data.preprocessor import Preprocessor

        if isinstance(fn.__self__, Preprocessor):
            return False  # a preprocessor's method: Ray names the stage after its class
    size = kwargs.get("batch_size")
    if size is not None and (type(size) is not int or size < 1):
        return False  # "auto", or a value Ray's own call refuses with its message
    if kwargs.get("batch_format", "default") not in ("default", *BATCH_FORMATS):
        return False
    cpus = kwargs.get("num_cpus")
    if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, (int, float))):
        return False
    return isinstance(kwargs.get("zero_copy_batch", True), bool)


def _view(fn: Any, kwargs: Mapping[str, Any]) -> MapBatchesView:
    """What Ray Data's ``MapBatches`` operator holds for ``map_batches(fn, **kwargs)``."""
    batch_format = kwargs.get("batch_format", "default")
    cpus = kwargs.get("num_cpus")
    return MapBatchesView(
        name=_name(fn),
        fn=fn,
        fn_args=tuple(kwargs.get("fn_args") or ()),
        fn_kwargs=dict(kwargs.get("fn_kwargs") or {}),
        has_constructor_args=False,
        batch_size=kwargs.get("batch_size"),
        batch_format=DEFAULT_BATCH_FORMAT if batch_format == "default" else batch_format,
        zero_copy_batch=kwargs.get("zero_copy_batch", True),
        ray_remote_args={} if cpus is None else {"num_cpus": cpus},
        has_remote_args_fn=False,
        on_tasks=True,
        concurrency=None,
        per_block_limit=None,
    )


def _name(fn: Any) -> str:
    """Ray Data's name of a ``map_batches`` stage of ``fn`` (``MapBatches(decode)``)."""
    try:
        if inspect.ismethod(fn):
            return f"MapBatches({type(fn.__self__).__name__}.{fn.__name__})"
        if inspect.isfunction(fn):
            return f"MapBatches({fn.__name__})"
        if isinstance(fn, functools.partial):
            return f"MapBatches({fn.func.__name__})"
        return f"MapBatches({type(fn).__name__})"
    except AttributeError:
        return "<unknown>"
