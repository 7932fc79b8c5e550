"""A Ray Data source of whole files as bytes, many files per read task.

Ray's ``read_binary_files`` spends about a millisecond of CPU per file here
(1.8-2.4 k files/s on 2 CPUs for 28x28 JPEGs, against 6.9 k files/s for one
plain process that reads and decodes them). raydl lists the files itself
(``fs.list_files``: parallel for remote prefixes) and reads each task's files in
a plain loop through the resolved pyarrow filesystem (up to 16 files at once from a
remote one), so retries, the disk cache and the skip policy apply per file. The
task's files become one Arrow block, in the task's file order.

Tasks hold contiguous runs of the file list in its order (:class:`FileRunsDatasource`,
shared with the parquet source; the cut is :func:`raydl._internal.io.runs.cut_runs`,
direct execution's too); ``shuffle_mode="files"`` asks
:meth:`FileRunsDatasource.permuted` for a copy whose files are in a seeded random
order *before* they are cut into tasks, so the order is per file, as torch's
file-level shuffles are.

These sources import no Ray Data: a raydl read is planned and, on the direct path,
run without it (``io/file_dataset.py``). Ray Data reads one through the adapter
:func:`as_ray_datasource` (``ray_compat/reads.py``), which it builds only when a plan
must run on Ray Data.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import pyarrow as pa

from raydl._internal.io.readers import BinaryRuns, RunReader
from raydl._internal.io.runs import RUN_BYTES, cut_runs

if TYPE_CHECKING:
    import pyarrow.fs as pafs
    from ray.data.block import BlockMetadata
    from ray.data.datasource import ReadTask

#: Files per read task, at most (a task is also a block and a unit of retry).
FILES_PER_TASK = 4096
#: Bytes per read task, at most, where the listing gave the files' sizes.
TASK_BYTES = RUN_BYTES
#: What ``ray.data.read_datasource`` takes besides the source (resources, concurrency, blocks).
READ_DATASOURCE_OPTIONS = frozenset(
    {"override_num_blocks", "concurrency", "num_cpus", "memory", "ray_remote_args"}
)


class FileRunsDatasource:
    """Already listed ``files`` cut into contiguous runs, one read task (and retry unit) per run.

    Subclasses say how a run is read (:meth:`run_reader`), what it is called
    (:meth:`get_name`) and how many rows a run holds (:meth:`run_rows`);
    :meth:`permuted` reorders the files before they are cut. Ray Data's side of a
    datasource (:meth:`get_read_tasks`, :meth:`estimate_inmemory_data_size`) imports
    Ray Data when it is called; Ray Data calls it through :func:`as_ray_datasource`.
    """

    #: Files per read task, at most.
    max_files_per_task = FILES_PER_TASK
    #: Bytes (the listed file sizes) per read task, at most; ``None``: no bound.
    max_bytes_per_task: int | None = TASK_BYTES

    def __init__(self, files: Sequence[tuple[str, int | None]]) -> None:
        self._files = list(files)

    def get_name(self) -> str:
        """The source's name (Ray's read stage is ``Read`` + this)."""
        raise NotImplementedError

    def run_rows(self, part: Sequence[tuple[str, int | None]]) -> int:
        """The rows a run of these files holds (what its read task's metadata says)."""
        raise NotImplementedError

    def row_count(self) -> int:
        """The rows of all the files (a plan without stages knows it before it runs)."""
        return self.run_rows(self._files)

    def estimate_inmemory_data_size(self) -> int | None:
        sizes = [size for _, size in self._files]
        return None if any(size is None for size in sizes) else sum(s or 0 for s in sizes)

    def permuted(self, seed: int) -> Self:
        """The same files in an order drawn from ``seed`` (``shuffle_mode="files"``)."""
        order = np.random.default_rng(seed).permutation(len(self._files))
        clone = copy.copy(self)
        clone._files = [self._files[i] for i in order]
        return clone

    @property
    def files(self) -> list[tuple[str, int | None]]:
        """``(path, listed size)`` of the files, in the order they are cut into runs."""
        return self._files

    def get_read_tasks(self, parallelism: int, *args: Any, **kwargs: Any) -> list[ReadTask]:
        from ray.data.datasource import ReadTask

        from raydl._internal.ray_compat import reads

        reads.before_read_tasks()  # an execution may begin while raydl's start runs
        # As few tasks as Ray's parallelism allows: each task costs a scheduling round
        # trip (tens of ms here), so 5,000 small images in ten tasks of 500 ran at
        # 6.9 k images/s and in four tasks at 8.3-9.0 k (2 CPUs). Bounded by files and
        # bytes, since a task holds its files' bytes and is the unit of retry.
        parts = cut_runs(
            self._files,
            at_least=parallelism,
            max_files=self.max_files_per_task,
            max_bytes=self.max_bytes_per_task,
        )
        return [
            ReadTask(self._reader([path for path, _ in part]), self._run_metadata(part))
            for part in parts
        ]

    def run_reader(self) -> RunReader:
        """What reads a run of this source's files (``readers.py``: no Ray Data in it)."""
        raise NotImplementedError

    def _reader(self, paths: list[str]) -> Callable[[], Iterator[pa.Table]]:
        return _TaskRead(self.run_reader(), paths)

    def _run_metadata(self, part: list[tuple[str, int | None]]) -> BlockMetadata:
        from ray.data.block import BlockMetadata

        sizes = [size for _, size in part]
        return BlockMetadata(
            num_rows=self.run_rows(part),
            size_bytes=None if None in sizes else sum(s or 0 for s in sizes),
            input_files=tuple(path for path, _ in part),
            exec_stats=None,
        )


def as_ray_datasource(source: FileRunsDatasource) -> Any:
    """``source`` as a Ray Data ``Datasource`` (imports Ray Data; ``ray_compat/reads.py``)."""
    from raydl._internal.ray_compat import reads

    return reads.RayFileRuns(source)


def own_source(datasource: Any) -> FileRunsDatasource | None:
    """The raydl file source behind a Ray ``Read``'s datasource, or ``None`` for any other."""
    if isinstance(datasource, FileRunsDatasource):
        return datasource
    inner = getattr(datasource, "raydl_source", None)
    return inner if isinstance(inner, FileRunsDatasource) else None


class FileListDatasource(FileRunsDatasource):
    """Whole files of an already listed ``files`` list: a ``bytes`` column (and ``path``)."""

    def __init__(
        self,
        files: Sequence[tuple[str, int | None]],
        filesystem: pafs.FileSystem,
        *,
        include_paths: bool,
        on_bad_file: str,
    ) -> None:
        super().__init__(files)
        self._filesystem = filesystem
        self._include_paths = include_paths
        self._on_bad_file = on_bad_file

    def get_name(self) -> str:
        return "BinaryFiles"

    def run_reader(self) -> BinaryRuns:
        return BinaryRuns(
            self._filesystem, include_paths=self._include_paths, skip=self._on_bad_file == "skip"
        )

    def run_rows(self, part: Sequence[tuple[str, int | None]]) -> int:
        return len(part)


class _TaskRead:
    """A Ray Data read task's body: its run, read with the execution's retried errors."""

    def __init__(self, reader: RunReader, paths: list[str]) -> None:
        self._reader = reader
        self._paths = paths

    def __call__(self) -> Iterator[pa.Table]:
        import ray.data

        retried = ray.data.DataContext.get_current().retried_io_errors or ()
        return self._reader.read(self._paths, retried)
