"""Simple file pipelines run on raydl's own persistent Ray actors.

Each epoch of a ``ray.data.Dataset`` is a new Ray Data execution: it plans, asks the
autoscaling coordinator for its share of the cluster, and schedules one task per
read task, each a round trip through the driver's scheduling loop and the raylet.
On small machines that start-up and those round trips are a large part of an epoch:
the images benchmark (5,000 small JPEGs, 2 CPUs) spent 26 % of the machine idle and
reached 0.6x torch's ``DataLoader``, while a prototype running the same read and
decode on two long-lived actors matched torch.

So a plan of the simplest shape, one of raydl's file reads (``read_binary_files``,
``read_parquet``) followed by ``map_batches`` stages that are plain functions on
CPUs, runs on a pool of raydl's actors that lives as long as the loader:

* the epoch's files (already in the epoch's order: ``shuffle_mode="files"``
  permuted the read's file list in ``plan_epoch``) are cut into contiguous runs
  (:func:`runs`), at most :data:`FILES_PER_RUN` files and :data:`BYTES_PER_RUN`
  listed bytes each, at least :data:`MIN_RUNS`;
* a run is one request to an actor: it reads the files through the read's own
  reader (retries, cache, skip policy and error naming per file are the read's)
  and applies the stages with Ray Data's own batching and output checks
  (:class:`EpochWork`);
* the epoch's fetch thread keeps ``prefetch_factor`` runs per actor in flight,
  takes the results in order and cuts batches from them as from Ray's blocks.

Under several ranks rank 0 loads the runs and deals their rows to the ranks
(``deal_ranks.py``). Anything else (another source, an all-to-all stage, a class
stage, GPUs or custom resources) runs as a Ray Data execution. Without a local
shuffle buffer the batches are exactly those of the Ray Data execution (rows in
file order either way); with one they differ (the buffer sees other block
boundaries), but the order is still a pure function of (seed, epoch).
"""

from __future__ import annotations

import collections
import collections.abc
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from raydl._internal.epochs.exchange import Exchange, Here, partition_count
from raydl._internal.io.readers import RunReader
from raydl._internal.io.runs import RUN_BYTES, cut_runs
from raydl._internal.ray_compat import batches, plans
from raydl._internal.ray_compat.context import DEFAULT_RETRIED_IO_ERRORS
from raydl._internal.ray_compat.errors import unpickling_cause
from raydl._internal.stream.batching import row_count
from raydl._internal.stream.dispatch import Calls, Dispatcher, LateActors, SplitCalls
from raydl._internal.workers.failure import RemoteError
from raydl._internal.workers.pool import WorkerPool
from raydl._internal.workers.worker import ImportFailure, WorkerSpec

if TYPE_CHECKING:
    from raydl._internal.stream.exchange_producer import Partitions

#: Files per run (one actor request), at most: the unit of work, retry and the first batch's wait.
FILES_PER_RUN = 512
#: Listed bytes per run, at most (parquet: uncompressed bytes from the footers).
BYTES_PER_RUN = RUN_BYTES
#: Runs an epoch is cut into, at least (where there are enough files): work for every
#: actor of a small cluster. Not derived from the pool's size, so the cut (and, with a
#: local shuffle buffer, the order) does not depend on how many CPUs the cluster has.
MIN_RUNS = 16

#: Bytes of loaded runs in flight per epoch, at most (fewer runs are sent at once once
#: the first runs show how large a loaded run is; at least one is always in flight).
WINDOW_BYTES = 512 << 20
#: Bytes of runs a global shuffle's map phase keeps in the training process, at most
#: (plus one run), per epoch, while Ray is not up: a run stays there until the last
#: partition that slices it is reduced (a run has rows in nearly every partition: about
#: the epoch's end), outside the object store (which spills; this process does not). At
#: an epoch boundary two epochs may hold that much (the next one started early).
MAP_HERE_BYTES = 256 << 20
#: Listed bytes of one file, at most: a run is loaded whole in its actor (Ray Data streams
#: a file's row groups), so plans with larger files stay on Ray Data.
MAX_FILE_BYTES = 4 * BYTES_PER_RUN

#: ``ray_remote_args`` a stage may set and still run on raydl's actors (``max_retries``:
#: a run is retried on a fresh actor after its worker died, see ``pool.MAX_TASK_RETRIES``).
_PLAIN_REMOTE_ARGS = {"num_cpus", "max_retries", "scheduling_strategy"}
#: Scheduling strategies raydl's actors honour (they are spread over the nodes).
_PLAIN_SCHEDULING = {"SPREAD", "DEFAULT"}


@dataclass(frozen=True)
class Stage:
    """One ``map_batches`` stage: a plain function applied to batches of a run's rows."""

    name: str
    fn: Callable[..., Any]
    fn_args: tuple[Any, ...]
    fn_kwargs: dict[str, Any]
    batch_size: int | None
    batch_format: Any  # Ray's resolved format: "numpy", "pandas", "pyarrow" or None
    zero_copy_batch: bool

    def apply(self, blocks: Iterable[Any], ray_data: batches.RayData) -> Iterator[Any]:
        """The function's (checked) outputs for ``blocks``, batched as Ray Data's ``map_batches``."""
        cut = batches.batches(
            blocks,
            batch_size=self.batch_size,
            batch_format=self.batch_format,  # None: the block as it is, as Ray passes it
            ensure_copy=not self.zero_copy_batch and self.batch_size is not None,
            ray_data=ray_data,
        )
        for batch in cut:
            out = self.fn(batch, *self.fn_args, **self.fn_kwargs)
            for each in out if isinstance(out, collections.abc.Generator) else (out,):
                batches.validate_output(each, ray_data)
                yield each


@dataclass(frozen=True)
class DirectPlan:
    """A plan raydl runs on its own actors: a file read and its ``map_batches`` stages."""

    source: Any  # a raydl file source (io/files.py), its files in the epoch's order
    stages: tuple[Stage, ...]
    num_cpus: float  # per actor: what the read and the stages ask per task
    concurrency: int | None  # the stages' task cap (map_batches(concurrency=N)), if any
    names: tuple[str, ...]  # the plan's stage names, for messages and stats
    exchange: Exchange | None = None  # the epoch's global shuffle (exchange.py), if any

    def work(self, context: Any) -> EpochWork:
        """What an actor needs for this plan's runs, under ``context`` (the epoch's
        ``DataContext``; ``None``: Ray Data's defaults, for a plan made without it)."""
        retried = DEFAULT_RETRIED_IO_ERRORS if context is None else context.retried_io_errors
        return EpochWork(
            self.source.run_reader(),
            tuple(retried or ()),
            self.stages,
            batches.LazyContext(context),
            self.exchange,
        )

    @property
    def without_pandas(self) -> bool:
        """Whether its actors most likely never import pandas: a read of whole files
        (binary and string columns, which raydl converts to numpy itself) whose stages
        all take numpy batches. A stage given Arrow tables or pandas batches most likely
        converts them with pyarrow's ``to_numpy`` or ``to_pandas``, which import pandas
        (the benchmark's tabular stage does), as does raydl's conversion of a parquet
        column of another type than plain numbers, strings and bytes."""
        from raydl._internal.io.files import FileListDatasource

        return isinstance(self.source, FileListDatasource) and all(
            stage.batch_format == "numpy" for stage in self.stages
        )

    def runs(self) -> list[tuple[str, ...]]:
        """The epoch's runs of files (see :func:`runs`)."""
        return runs(self.source.files)

    def shuffled(self, seed: int) -> DirectPlan:
        """This plan with a global shuffle drawn from ``seed`` (one output partition per run)."""
        return replace(self, exchange=Exchange(seed, partition_count(len(self.runs()))))


def direct_plan(dataset: Any) -> DirectPlan | None:
    """``dataset``'s plan as a :class:`DirectPlan`, or ``None`` if Ray Data must run it.

    raydl's own plan of a read (``io/file_dataset.py``) is read without Ray Data.
    """
    from raydl._internal.io.file_dataset import FileDataset
    from raydl._internal.io.files import own_source

    if isinstance(dataset, FileDataset):
        found: tuple[plans.ReadView, list[plans.MapBatchesView]] | None = dataset.plain_plan()
    else:
        found = plans.read_then_map_batches(dataset)
    if found is None:
        return None
    read, views = found
    source = own_source(read.datasource)
    if (
        source is None
        or not _plain(read.ray_remote_args)
        or read.concurrency is not None  # read concurrency capped
        or any((size or 0) > MAX_FILE_BYTES for _, size in source.files)
    ):
        return None
    cpus = []  # what each stage asks per task
    stages = []
    concurrency = None
    for view in views:
        if (
            not view.on_tasks
            or view.has_remote_args_fn
            or not _plain(view.ray_remote_args)
            or view.has_constructor_args
            or view.per_block_limit is not None
            or not (view.batch_size is None or isinstance(view.batch_size, int))
            or not callable(view.fn)
            or isinstance(view.fn, type)
        ):
            return None
        cpus.append(view.ray_remote_args.get("num_cpus", 1))
        if view.concurrency is not None:
            concurrency = min(concurrency or view.concurrency, view.concurrency)
        stages.append(
            Stage(
                name=view.name,
                fn=view.fn,
                fn_args=view.fn_args,
                fn_kwargs=view.fn_kwargs,
                batch_size=view.batch_size,
                batch_format=view.batch_format,
                zero_copy_batch=view.zero_copy_batch,
            )
        )
    # An actor runs a run's read and all its stages: the stages' CPU requests (the read's
    # when there is no stage) decide how many actors the cluster holds, the largest wins.
    num_cpus = max(cpus or [read.ray_remote_args.get("num_cpus", 1)])
    if not num_cpus or not 0 < num_cpus <= 1:  # a multi-threaded stage keeps Ray's threads
        return None
    names = (read.name, *(view.name for view in views))
    return DirectPlan(source, tuple(stages), float(num_cpus), concurrency, names)


def _plain(remote_args: dict[str, Any]) -> bool:
    """Whether a stage's Ray options are ones raydl's actors honour."""
    strategy = remote_args.get("scheduling_strategy", "DEFAULT")
    return not set(remote_args) - _PLAIN_REMOTE_ARGS and strategy in _PLAIN_SCHEDULING


def pool_size(plan: DirectPlan, cluster_cpus: float, context: Any) -> int:
    """Actors for ``plan``: as many tasks as Ray Data could run at once.

    The cluster's CPUs, within the plan's ``execution_options`` (``resource_limits``,
    ``exclude_resources``), over the CPUs a task asks for, capped by ``concurrency``.
    ``context=None`` (a plan made without Ray Data): Ray Data's defaults, no limits.
    """
    cpus = cluster_cpus
    if context is not None:
        options = context.execution_options
        cpus = min(cpus, options.resource_limits.cpu) - options.exclude_resources.cpu
    size = max(1, int(cpus // plan.num_cpus))
    return min(size, plan.concurrency) if plan.concurrency else size


def start_pool(plan: DirectPlan, context: Any, seed: int) -> WorkerPool:
    """The actors that run direct epochs: as many as :func:`pool_size` says, seeded from ``seed``.

    They hold no CPUs: like torch's worker processes they compete for the machine, and
    other Ray work (a ``len()`` that must count rows) is never locked out. They are
    spread over the nodes.
    """
    import ray

    size = pool_size(plan, ray.cluster_resources().get("CPU", 1.0), context)
    spec = WorkerSpec(
        num_workers=size,
        collate_fn=None,
        auto_collation=False,
        worker_init_fn=None,
        base_seed=seed,
    )
    options = {"num_cpus": 0, "scheduling_strategy": "SPREAD"}
    return WorkerPool(RunLoader(), spec, restartable=True, options=options)


def runs(files: Sequence[tuple[str, int | None]]) -> list[tuple[str, ...]]:
    """``files`` cut into contiguous runs of equal file counts: at least :data:`MIN_RUNS`,
    at most :data:`FILES_PER_RUN` files and :data:`BYTES_PER_RUN` listed bytes each.

    A pure function of the file list (in the epoch's order): the read tasks' rule
    (:func:`raydl._internal.io.runs.cut_runs`) with direct execution's bounds.
    """
    cut = cut_runs(files, at_least=MIN_RUNS, max_files=FILES_PER_RUN, max_bytes=BYTES_PER_RUN)
    return [tuple(path for path, _ in run) for run in cut]


def loaded_bytes(blocks: Sequence[dict[str, np.ndarray]]) -> int:
    """The size of a loaded run's arrays (object arrays count their pointers only)."""
    return sum(column.nbytes for block in blocks for column in block.values())


def describe_run(paths: Sequence[str]) -> str:
    """Short text naming a run's files, for error messages."""
    if len(paths) <= 3:
        return f"files {list(paths)}"
    return f"files [{paths[0]!r}, ..., {paths[-1]!r}] ({len(paths)} files)"


@dataclass(frozen=True)
class LoadRun:
    """A request: load a run, its rows after every stage (the streaming mode)."""

    paths: tuple[str, ...]


@dataclass(frozen=True)
class MapRun:
    """A request: load run ``run`` and group its rows by output partition (map phase).

    ``whole``: reply with the grouped run as one object (:meth:`Exchange.group`), not
    one object per partition (:meth:`Exchange.split`); see :func:`map_phase`.
    ``partitions``: the epoch's output partitions (how many objects a reply that is
    not ``whole`` has after its head, a failure's included).
    """

    run: int
    paths: tuple[str, ...]
    whole: bool = False
    partitions: int = 0


@dataclass(frozen=True)
class DealRun:
    """A request: load a run, its rows after every stage, to deal to ranks (``deal_ranks.py``)."""

    paths: tuple[str, ...]


Task = LoadRun | MapRun | DealRun


@dataclass(frozen=True)
class EpochWork:
    """What an actor needs for the runs of one epoch: the read, the stages, Ray's context.

    None of it imports Ray Data as it unpickles (``io/readers.py``, ``ray_compat/batches.py``):
    an actor imports it only for a stage or a column that needs Ray Data's own conversions.
    """

    reader: RunReader
    retried: tuple[str, ...]  # the epoch's DataContext.retried_io_errors
    stages: tuple[Stage, ...]
    context: batches.LazyContext  # the epoch plan's ray.data.DataContext, for Ray's conversions
    exchange: Exchange | None = None

    def load(
        self, paths: Sequence[str], *, own_context: bool = True
    ) -> list[dict[str, np.ndarray]]:
        """The run's rows after every stage, as Ray Data's numpy batches (one per output block).

        ``own_context``: make the plan's ``DataContext`` current while Ray Data's code
        runs (in an actor; not in the trainer's process, whose other threads may read
        the current one).
        """
        return list(self.stream(paths, own_context=own_context))

    def stream(
        self, paths: Sequence[str], *, own_context: bool = True
    ) -> Iterator[dict[str, np.ndarray]]:
        """:meth:`load`'s blocks, each made when the one before was taken (an actor's
        memory holds one block and its stage's temporaries, not the run)."""
        with batches.RayData(self.context if own_context else None) as ray_data:
            outputs: Iterable[Any] = self.reader.read(paths, self.retried)
            for stage in self.stages:
                blocks = (batches.to_block(output, ray_data) for output in outputs)
                outputs = stage.apply(blocks, ray_data)
            for output in outputs:
                batch = batches.to_numpy(output, ray_data)
                if row_count(batch):
                    yield batch

    def run(self, task: Task, *, own_context: bool = True) -> Any:
        """An actor's reply to ``task`` (``own_context``: as for :meth:`load`).

        :class:`LoadRun`: a list of numpy batches. :class:`MapRun`: ``((counts, bytes),
        piece_0, ..., piece_{P-1})``, one Ray object each (the call's ``num_returns``), or
        with ``whole``, ``((counts, bytes), grouped run)``. :class:`DealRun`: ``((rows of
        each batch, their bytes), the batches)``, two Ray objects.
        """
        loaded = self.load(task.paths, own_context=own_context)
        if isinstance(task, LoadRun):
            return loaded
        if isinstance(task, DealRun):
            return ([row_count(batch) for batch in loaded], loaded_bytes(loaded)), loaded
        assert self.exchange is not None
        if task.whole:
            counts, grouped = self.exchange.group(task.run, loaded)
            return (counts, loaded_bytes([grouped])), grouped
        counts, pieces = self.exchange.split(task.run, loaded)
        return (counts, loaded_bytes(pieces)), *pieces


#: A streamed run's parts hold at least this many bytes of blocks (:meth:`RunLoader.parts`):
#: a few parts per run, each a Ray object this process owns.
PART_BYTES = 64 << 20


class RunLoader:
    """The "dataset" of a direct pool's actors: request ``(work, task)`` -> the task's reply.

    The pool's actors are :class:`~raydl._internal.workers.worker.DatasetWorker` s (restarts,
    exception transport and seeding are theirs); this object is their dataset. The
    work of an epoch travels as an object reference (put once per epoch) and is
    kept for the next requests, so a request carries only its task.
    """

    #: Read by the actors: this work imports no torch, so they set up none (``worker.py``).
    needs_torch = False

    def __init__(self) -> None:
        self._works: dict[Any, EpochWork] = {}

    def _work(self, holder: list[Any], task: Task) -> EpochWork | Any:
        """The epoch's work (fetched once, kept for the next requests), or the failed reply."""
        import ray

        ref = holder[0]
        work = self._works.get(ref)
        if work is None:
            try:
                work = ray.get(ref)
                if work.context.eager:  # user configs, which may name the user's modules
                    work.context.get()
            except Exception as err:  # not cached: the next request tries again
                return failed_reply(task, _unpickling_failed(err))
            self._works = {ref: work, **dict(list(self._works.items())[:1])}  # this + one more
        return work

    def __getitem__(self, request: tuple[list[Any], Task]) -> Any:
        holder, task = request
        work = self._work(holder, task)
        if not isinstance(work, EpochWork):
            return work
        try:
            return work.run(task)
        except Exception:
            return failed_reply(task, RemoteError(where=_where(work, "on a raydl actor", task)))

    def parts(self, request: tuple[list[Any], LoadRun]) -> Iterator[Any]:
        """A :class:`LoadRun`'s reply in parts, for a streaming call (``DatasetWorker.fetch_parts``).

        Each part is a list of the run's next blocks, of at least :data:`PART_BYTES`
        (the last one: the rest, if any); joined, they are :meth:`__getitem__`'s reply. A part
        is sent, and its memory freed here, before the next one is made, so an actor
        holds one part, not the run (a run of 250 decoded 224x224 images is 150 MB).
        A failure is the last part: the failed reply.
        """
        holder, task = request
        work = self._work(holder, task)
        if not isinstance(work, EpochWork):
            yield work
            return
        part: list[dict[str, np.ndarray]] = []
        size = 0
        try:
            for block in work.stream(task.paths):
                part.append(block)
                size += loaded_bytes([block])
                if size >= PART_BYTES:
                    yield part
                    part, size = [], 0
        except Exception:
            yield failed_reply(task, RemoteError(where=_where(work, "on a raydl actor", task)))
            return
        if part:  # the rest; no empty part (each is a Ray object): no parts joins to []
            yield part


def failed_reply(task: Task, error: RemoteError) -> Any:
    """The reply carrying ``error`` in place of ``task``'s (as many objects as its reply)."""
    if isinstance(task, MapRun):
        assert task.whole or task.partitions > 0, "a map-phase request names its partitions"
        return (error, *([None] * (1 if task.whole else task.partitions)))
    if isinstance(task, DealRun):
        return error, None
    return error


def _unpickling_failed(err: Exception) -> RemoteError:
    """An actor's error when the epoch's work (its read and stages) did not unpickle."""
    cause = unpickling_cause(err)
    if isinstance(cause, ModuleNotFoundError):
        return ImportFailure(
            None,
            cause,
            who="a raydl actor",
            what="the epoch's read and Ray Data stages (their functions and arguments)",
            ship="ray.init(runtime_env=...) before the first raydl read or loader",
        )
    if cause is err:  # not an unpickling failure: the object could not be fetched
        return RemoteError(where="on a raydl actor while fetching the epoch's read and stages")
    return RemoteError(
        where="on a raydl actor while unpickling the epoch's read and stages",
        exc_info=(type(cause), cause, cause.__traceback__),
    )


def _where(work: EpochWork, place: str, task: Task) -> str:
    """Where a run's loading raised: the stages, the process, the run's files."""
    stages = " -> ".join(stage.name for stage in work.stages) or "the read"
    return f"in {stages} {place}, {describe_run(task.paths)}"


#: A request that loads no file: an actor's first one resolves the epoch's work (and
#: imports what it needs), so its reply says the actor is ready for runs.
WARM_UP = LoadRun(())


def load_here(work: EpochWork, task: LoadRun | MapRun) -> Any:
    """A run loaded in this process, as an actor loads it: its reply to ``task``.

    For the runs an epoch loads while its pool's actors start (a streaming epoch's,
    :class:`~raydl._internal.stream.direct_producer.DirectProducer`; a global
    shuffle's map phase, :func:`map_phase`): a run is a pure function of its files,
    so the blocks are those an actor gives (the same code :class:`LocalRuns` relies
    on for elastic resume). An error names the stages and the files as an actor's
    does, and says it was raised here.
    """
    try:
        return work.run(task, own_context=False)
    except Exception:
        where = _where(work, "in the training process (while raydl's actors started)", task)
        RemoteError(where=where).reraise()


def map_phase(
    actors: LateActors,
    plan: DirectPlan,
    between: Callable[[], None],
    calls: Calls | None = None,
    *,
    whole: Callable[[], bool],
    local: Callable[[MapRun], Any] | None = None,
    here_bytes: Callable[[], int] = lambda: MAP_HERE_BYTES,
) -> Partitions:
    """A globally shuffled epoch's map phase (``exchange.py``), on raydl's actors.

    Every run is loaded and grouped by output partition on an actor; its rows stay
    in the object store, owned by this process. ``actors``: where the runs go (made
    once Ray is up: :class:`LateActors`), ``Actors.request(task)`` being an actor's
    request for a :class:`MapRun`; ``between``: a stop check.

    ``local``: while Ray or the actors still start (:meth:`LateActors.starting`), the
    next runs are mapped in this process instead, by ``local(task)`` (the actors' own
    code, :func:`load_here`), and their grouped rows stay here (:class:`Here`), until
    they hold ``here_bytes()``. A run is a pure function of its files, so the epoch is
    the same either way.

    ``whole()``, asked once the actors are bound: each run comes back as one object
    (its rows sorted by partition), which the reduces slice, instead of one object
    per partition. Runs x partitions objects cost Ray's raylet and this process about
    0.1 ms each (a 21-run epoch: 462 objects against 42); but a run's object stays
    until the epoch's last partition is reduced, so the whole epoch is held at once
    (``RaySource`` asks for it only when the previous epoch's map output was a small
    part of the object store).
    """
    # Here, not at the top: the actors import this module, and the producers' modules import torch.
    from raydl._internal.stream.exchange_producer import Partitions

    exchange = plan.exchange
    assert exchange is not None
    parts = exchange.partitions
    partitions = Partitions.empty(parts)
    runs = collections.deque(
        MapRun(index, run, partitions=parts) for index, run in enumerate(plan.runs())
    )
    while local is not None and runs and partitions.nbytes < here_bytes():
        between()  # before starting(), which may bind (connect, start the pool)
        if not actors.starting():
            break
        (counts, nbytes), grouped = local(replace(runs.popleft(), whole=True))
        partitions.add(counts, [Here(grouped)], whole=True, nbytes=nbytes)
        partitions.mapped_here += 1
    if not runs:
        return partitions
    bound = actors.bind(between)
    assert bound is not None
    partitions.actors = len(bound.pool)
    whole_runs = whole()
    dispatch = Dispatcher(
        bound.pool,
        calls or SplitCalls(2 if whole_runs else parts + 1),
        method="fetch",
        describe=lambda request: describe_run(request[1].paths),
        between=between,
    )
    for task in runs:
        dispatch.send(bound.request(replace(task, whole=whole_runs)))
    while dispatch:  # in run order
        head, refs = dispatch.collect()
        if isinstance(head, RemoteError):
            head.reraise()
        counts, nbytes = head
        partitions.add(counts, refs, whole=whole_runs, nbytes=nbytes)
    partitions.whole = whole_runs
    return partitions
