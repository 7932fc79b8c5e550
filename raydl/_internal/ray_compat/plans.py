"""Ray Data's logical plans: reading their operators and rewriting them copy-on-write.

Relies on these private parts of Ray Data (checked by :func:`check` and
:func:`check_live`):

* ``Dataset._logical_plan`` (a ``LogicalPlan`` with ``dag``, ``context`` and
  ``sources()``), ``Dataset._from_parent(dataset, logical_plan)`` and
  ``Dataset.copy(dataset, _deep_copy=True)``;
* ``LogicalOperator.post_order_iter()``, ``.input_dependencies``, ``.name`` and
  ``._apply_transform(fn)``, which rebuilds the DAG above every operator ``fn``
  replaced and returns the same DAG when ``fn`` replaced none;
* the operator classes ``Read``, ``ListFiles``, ``AbstractMap``, ``MapBatches``
  and ``AbstractAllToAll`` (``ray.data._internal.logical.operators``), frozen
  dataclasses whose fields are read here and set on copies with
  ``object.__setattr__``: ``Read.datasource``, ``.datasource_or_legacy_reader``,
  ``.ray_remote_args``, ``.compute``; ``AbstractMap.ray_remote_args``,
  ``.ray_remote_args_fn``, ``.compute``, ``.min_rows_per_bundled_input``,
  ``.per_block_limit``; ``MapBatches.fn``, ``.fn_args``, ``.fn_kwargs``,
  ``.fn_constructor_args``, ``.fn_constructor_kwargs``, ``.batch_size``,
  ``.batch_format``, ``.zero_copy_batch``; ``ListFiles.shuffle_config_factory``;
* ``are_op_remote_args_compatible`` of Ray's operator fusion rule.

The operators of a user's plan are shared with the user's dataset: a rewrite
copies the operators it changes and never changes one in place.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import ray.data

__all__ = [
    "MapBatchesView",
    "ReadView",
    "bound_retries",
    "check",
    "check_live",
    "has_all_to_all",
    "non_read_sources",
    "own_copy",
    "permute_reads",
    "read_then_map_batches",
    "stage_names",
    "unbundle_after_reads",
]


@dataclass(frozen=True)
class ReadView:
    """What raydl reads of a plan's ``Read`` operator."""

    name: str
    datasource: Any  # the datasource, or Ray's legacy reader
    ray_remote_args: dict[str, Any]
    concurrency: int | None  # the read's task cap (``concurrency=N``), if any


@dataclass(frozen=True)
class MapBatchesView:
    """What raydl reads of a plan's ``MapBatches`` operator (a ``map_batches`` stage)."""

    name: str
    fn: Any
    fn_args: tuple[Any, ...]
    fn_kwargs: dict[str, Any]
    has_constructor_args: bool  # fn_constructor_args or fn_constructor_kwargs given
    batch_size: Any  # an int, None, or Ray's "auto"
    batch_format: Any  # Ray's resolved format: "numpy", "pandas", "pyarrow" or None
    zero_copy_batch: bool
    ray_remote_args: dict[str, Any]
    has_remote_args_fn: bool  # ray_remote_args_fn given
    on_tasks: bool  # its compute is a TaskPoolStrategy (not an actor pool)
    concurrency: int | None  # its task cap (``concurrency=N``), if any
    per_block_limit: int | None


def own_copy(dataset: ray.data.Dataset) -> ray.data.Dataset:
    """A copy of ``dataset`` with its own ``DataContext`` (changing it leaves the user's alone).

    Relies on ``Dataset.copy(dataset, _deep_copy=True)``.
    """
    from ray.data import Dataset

    return Dataset.copy(dataset, _deep_copy=True)


def _operators(dataset: ray.data.Dataset) -> list[Any]:
    """The plan's operators, each after its inputs (sources first)."""
    return list(dataset._logical_plan.dag.post_order_iter())


def stage_names(dataset: ray.data.Dataset) -> tuple[str, ...]:
    """The names of the plan's stages, sources first (``ReadParquet``, ``MapBatches(decode)``).

    Relies on ``Dataset._logical_plan`` and ``LogicalOperator.name``.
    """
    return tuple(op.name for op in _operators(dataset))


def has_all_to_all(dataset: ray.data.Dataset) -> bool:
    """Whether the plan has an all-to-all stage (shuffle, sort, repartition, ...).

    Relies on ``Dataset._logical_plan`` and the ``AbstractAllToAll`` operator class.
    """
    from ray.data._internal.logical.operators.all_to_all_operator import AbstractAllToAll

    return any(isinstance(op, AbstractAllToAll) for op in _operators(dataset))


def read_then_map_batches(
    dataset: ray.data.Dataset,
) -> tuple[ReadView, list[MapBatchesView]] | None:
    """The plan as one read followed only by ``map_batches`` stages, or ``None``.

    ``None`` for any other shape: another source, several sources, or a stage other
    than ``map_batches`` (exactly Ray's ``Read`` and ``MapBatches`` operators).

    Relies on ``Dataset._logical_plan`` and the fields of ``Read`` and ``MapBatches``
    (see the module docstring).
    """
    from ray.data import TaskPoolStrategy
    from ray.data._internal.logical.operators.map_operator import MapBatches
    from ray.data._internal.logical.operators.read_operator import Read

    ops = _operators(dataset)
    if not ops or type(ops[0]) is not Read or any(type(op) is not MapBatches for op in ops[1:]):
        return None
    read: Any = ops[0]  # Ray sets an operator's fields dynamically: mypy cannot see them
    view = ReadView(
        name=read.name,
        datasource=read.datasource_or_legacy_reader,
        ray_remote_args=read.ray_remote_args,
        concurrency=getattr(read.compute, "size", None),  # an actor pool has no size
    )
    stages = []
    for op in ops[1:]:
        stage: Any = op
        stages.append(
            MapBatchesView(
                name=stage.name,
                fn=stage.fn,
                fn_args=tuple(stage.fn_args or ()),
                fn_kwargs=dict(stage.fn_kwargs or {}),
                has_constructor_args=bool(stage.fn_constructor_args or stage.fn_constructor_kwargs),
                batch_size=stage.batch_size,
                batch_format=stage.batch_format,
                zero_copy_batch=stage.zero_copy_batch,
                ray_remote_args=stage.ray_remote_args,
                has_remote_args_fn=stage.ray_remote_args_fn is not None,
                on_tasks=isinstance(stage.compute, TaskPoolStrategy),
                concurrency=stage.compute.size
                if isinstance(stage.compute, TaskPoolStrategy)
                else None,
                per_block_limit=stage.per_block_limit,
            )
        )
    return view, stages


def non_read_sources(dataset: ray.data.Dataset) -> list[str]:
    """The names of the plan's sources that are not file or datasource reads.

    ``from_numpy``, ``from_arrow``, a materialized dataset: sources with no files
    or read tasks to reorder. Relies on ``LogicalPlan.sources()`` and the ``Read``
    and ``ListFiles`` operator classes.
    """
    from ray.data._internal.logical.operators.read_operator import ListFiles, Read

    sources = dataset._logical_plan.sources()
    return [source.name for source in sources if not isinstance(source, (Read, ListFiles))]


def rewritten(dataset: ray.data.Dataset, rewrite: Callable[[Any], Any]) -> ray.data.Dataset:
    """``dataset`` with ``rewrite`` applied to each operator (Ray's copy-on-write transform).

    ``rewrite`` returns its operator unchanged or a changed copy, never changing it in
    place: the operators are shared with the user's dataset. No copy, same dataset.
    Relies on ``LogicalOperator._apply_transform``, ``LogicalPlan(dag, context)`` and
    ``Dataset._from_parent``.
    """
    from ray.data._internal.logical.interfaces import LogicalPlan

    plan = dataset._logical_plan
    dag = plan.dag._apply_transform(rewrite)
    if dag is plan.dag:
        return dataset
    return type(dataset)._from_parent(dataset, LogicalPlan(dag, plan.context))


def _with(op: Any, **fields: Any) -> Any:
    """A shallow copy of the frozen operator ``op`` with ``fields`` set."""
    changed = copy.copy(op)
    for name, value in fields.items():
        object.__setattr__(changed, name, value)
    return changed


def bound_retries(dataset: ray.data.Dataset, retries: int) -> ray.data.Dataset:
    """The same plan with every map stage and read retrying a dead worker's task ``retries`` times.

    Sets ``max_retries`` (task stages) or ``max_task_retries`` (actor-pool stages)
    in the ``ray_remote_args`` of every ``AbstractMap`` operator (reads included)
    whose ``ray_remote_args`` do not set it already. Relies on ``AbstractMap``'s
    ``compute`` and ``ray_remote_args`` fields and :func:`rewritten`.
    """
    from ray.data import ActorPoolStrategy
    from ray.data._internal.logical.operators.map_operator import AbstractMap

    def bounded(op: Any) -> Any:
        if not isinstance(op, AbstractMap):
            return op
        given: Any = op  # Ray sets an operator's fields dynamically: mypy cannot see them
        key = "max_task_retries" if isinstance(given.compute, ActorPoolStrategy) else "max_retries"
        if key in given.ray_remote_args:
            return op
        return _with(op, ray_remote_args={**given.ray_remote_args, key: retries})

    return rewritten(dataset, bounded)


def unbundle_after_reads(
    dataset: ray.data.Dataset, is_cut_read: Callable[[Any], bool]
) -> ray.data.Dataset:
    """The same plan with a stage right after a read whose datasource passes ``is_cut_read``
    fed one read task at a time (its ``min_rows_per_bundled_input`` cleared).

    Only stages Ray could fuse with the read (compatible remote args, no
    ``ray_remote_args_fn``) and that ask for bundles at all are changed. Relies on
    ``AbstractMap.min_rows_per_bundled_input``, ``.input_dependencies``,
    ``Read.datasource``, Ray's ``are_op_remote_args_compatible`` and :func:`rewritten`.
    """
    from ray.data._internal.logical.operators.map_operator import AbstractMap
    from ray.data._internal.logical.operators.read_operator import Read
    from ray.data._internal.logical.rules.operator_fusion import are_op_remote_args_compatible

    def unbundled(op: Any) -> Any:
        given: Any = op  # Ray sets an operator's fields dynamically: mypy cannot see them
        if (
            not isinstance(op, AbstractMap)
            or isinstance(op, Read)
            or given.min_rows_per_bundled_input is None
            or len(op.input_dependencies) != 1
        ):
            return op
        read: Any = op.input_dependencies[0]
        if not (
            isinstance(read, Read)
            and is_cut_read(read.datasource)
            and are_op_remote_args_compatible(read, given)
        ):
            return op
        return _with(op, min_rows_per_bundled_input=None)

    return rewritten(dataset, unbundled)


class _PermutedReads:
    """A datasource (or legacy reader) whose read tasks come in a seeded random order."""

    def __init__(self, inner: Any, seed: int) -> None:
        self._inner = inner
        self._seed = seed

    def get_read_tasks(self, parallelism: int, *args: Any, **kwargs: Any) -> list[Any]:
        tasks = list(self._inner.get_read_tasks(parallelism, *args, **kwargs))
        order = np.random.default_rng(self._seed).permutation(len(tasks))
        return [tasks[i] for i in order]

    def __getattr__(self, name: str) -> Any:  # everything else is the inner datasource's
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.__dict__["_inner"], name)


class _FixedFileShuffle:
    """A ``ListFiles`` shuffle-config factory: the same file order for every execution."""

    def __init__(self, seed: int) -> None:
        self._seed = seed

    def __call__(self) -> Any:
        from ray.data import FileShuffleConfig

        return FileShuffleConfig(seed=self._seed, reseed_after_execution=False)


def permute_reads(dataset: ray.data.Dataset, seed: int) -> ray.data.Dataset:
    """The same plan with every read's files (or read tasks) in an order drawn from ``seed``.

    A ``ListFiles`` source gets a fixed file shuffle seeded with ``seed``; a ``Read``
    whose datasource has ``permuted(seed)`` (raydl's file sources) reads that
    permuted datasource; any other ``Read`` gets its read tasks permuted. Other
    operators are kept. Relies on ``ListFiles.shuffle_config_factory``,
    ``Read.datasource``/``.datasource_or_legacy_reader`` and :func:`rewritten`.
    """
    from ray.data._internal.logical.operators.read_operator import ListFiles, Read

    def permuted(op: Any) -> Any:
        if isinstance(op, ListFiles):
            return _with(op, shuffle_config_factory=_FixedFileShuffle(seed))
        if isinstance(op, Read):
            given: Any = op  # Ray sets an operator's fields dynamically: mypy cannot see them
            inner = given.datasource_or_legacy_reader
            if hasattr(inner, "permuted"):  # raydl's file readers: permuted per file
                source = inner.permuted(seed)
                return _with(op, datasource=source, datasource_or_legacy_reader=source)
            return _with(op, datasource_or_legacy_reader=_PermutedReads(inner, seed))
        return op

    return rewritten(dataset, permuted)


def _fields(cls: type, names: set[str]) -> None:
    """Raise unless the dataclass ``cls`` has the fields ``names``."""
    missing = names - {f.name for f in dataclasses.fields(cls)}
    if missing:
        raise AttributeError(f"{cls.__module__}.{cls.__name__} has no fields {sorted(missing)}")


def check() -> None:
    """Fail if this Ray lacks the plan internals used here (no cluster needed)."""
    import inspect

    import ray.data
    from ray.data._internal.logical.interfaces import LogicalOperator, LogicalPlan
    from ray.data._internal.logical.operators.all_to_all_operator import AbstractAllToAll
    from ray.data._internal.logical.operators.map_operator import AbstractMap, MapBatches
    from ray.data._internal.logical.operators.read_operator import ListFiles, Read
    from ray.data._internal.logical.rules.operator_fusion import are_op_remote_args_compatible

    _fields(Read, {"datasource", "datasource_or_legacy_reader", "ray_remote_args", "compute"})
    _fields(
        MapBatches,
        {
            "fn",
            "fn_args",
            "fn_kwargs",
            "fn_constructor_args",
            "fn_constructor_kwargs",
            "batch_size",
            "batch_format",
            "zero_copy_batch",
            "ray_remote_args",
            "ray_remote_args_fn",
            "compute",
            "min_rows_per_bundled_input",
            "per_block_limit",
        },
    )
    _fields(ListFiles, {"shuffle_config_factory"})
    for cls in (Read, MapBatches):
        if not issubclass(cls, AbstractMap):
            raise TypeError(f"Ray's {cls.__name__} operator is no longer an AbstractMap")
    if not isinstance(AbstractAllToAll, type):
        raise TypeError("Ray's AbstractAllToAll is no longer a class")
    for name in ("post_order_iter", "_apply_transform", "input_dependencies", "name"):
        if not hasattr(LogicalOperator, name):
            raise AttributeError(f"Ray's LogicalOperator has no {name}")
    if list(inspect.signature(LogicalPlan).parameters)[:2] != ["dag", "context"]:
        raise TypeError("Ray's LogicalPlan no longer takes (dag, context)")
    for name in ("sources", "dag", "context"):
        if not hasattr(LogicalPlan, name):
            raise AttributeError(f"Ray's LogicalPlan has no {name}")
    if not callable(getattr(ray.data.Dataset, "_from_parent", None)):
        raise AttributeError("ray.data.Dataset has no _from_parent()")
    if "_deep_copy" not in inspect.signature(ray.data.Dataset.copy).parameters:
        raise TypeError("ray.data.Dataset.copy() takes no _deep_copy")
    if list(inspect.signature(are_op_remote_args_compatible).parameters) != [
        "up_logical_op",
        "down_logical_op",
    ]:
        raise TypeError("Ray's are_op_remote_args_compatible takes other arguments")
    if "size" not in inspect.signature(ray.data.TaskPoolStrategy).parameters:
        raise TypeError("ray.data.TaskPoolStrategy has no size")


def check_live() -> None:
    """Build (never execute) a small plan and read and rewrite it (Ray must be initialised)."""
    import ray.data

    def double(batch: dict[str, Any]) -> dict[str, Any]:
        return batch

    dataset = ray.data.range(8).map_batches(double, batch_size=4, fn_kwargs={})
    names = stage_names(dataset)
    if len(names) != 2 or not names[1].startswith("MapBatches"):
        raise ValueError(f"a read and one map_batches stage show as {names}")
    found = read_then_map_batches(dataset)
    if found is None:
        raise ValueError("range().map_batches() is not seen as a read and a map_batches stage")
    read, (stage,) = found
    if stage.fn is not double or stage.batch_size != 4 or not stage.on_tasks:
        raise ValueError(f"map_batches' fields read back as {stage}")
    if not hasattr(read.datasource, "get_read_tasks"):
        raise TypeError(f"the read's datasource {read.datasource!r} has no get_read_tasks")
    copied = own_copy(dataset)
    if copied.context is dataset.context or stage_names(copied) != names:
        raise ValueError("Dataset.copy(_deep_copy=True) shares the context or changes the plan")
    bounded = bound_retries(dataset, 2)
    if bounded is dataset or read_then_map_batches(bounded) is None:
        raise ValueError("bounding retries did not give a new plan of the same shape")
    rebounded = read_then_map_batches(bounded)
    assert rebounded is not None
    if rebounded[1][0].ray_remote_args.get("max_retries") != 2:
        raise ValueError("bounding retries did not set max_retries on a copy of the stage")
    if "max_retries" in stage.ray_remote_args:
        raise ValueError("bounding retries changed the user's stage in place")
    if has_all_to_all(dataset) or not has_all_to_all(dataset.random_shuffle(seed=1)):
        raise ValueError("random_shuffle() is not seen as an all-to-all stage")
    if permute_reads(dataset, 3) is dataset or non_read_sources(dataset):
        raise ValueError("a range() read is not seen as a read, or cannot be permuted")
