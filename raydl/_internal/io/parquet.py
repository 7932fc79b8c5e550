"""A Ray Data source of parquet files, several files per read task.

Ray Data's V1 parquet reader, given one task per file, spends about as long
between two tasks (the scheduler sees one finish, the raylet starts the next) as
a small file's read and filter take: measured here, 16 files of 62.5 k rows ran
as 30 ms tasks started 45-55 ms apart. Fewer, longer tasks amortise that, but
Ray's reader then fixes which files share a task, so ``shuffle_mode="files"``
could only permute whole runs. This source keeps the file list (with each file's
footer figures, read once when the plan is built) and cuts it into runs only
when an execution asks, after :meth:`permuted` has put the files in the epoch's
order. Each file is conformed to the plan's one schema (a missing column becomes
nulls, narrower types are cast), so every block has the same columns and dtypes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
from ray.data.block import BlockMetadata

from raydl._internal.io.files import FileRunsDatasource, naming
from raydl._internal.io.fs import flush_cache
from raydl._internal.io.runs import RUN_BYTES, run_count

if TYPE_CHECKING:
    import pyarrow.fs as pafs

#: Uncompressed bytes a read task aims at (row-group sizes from the footers).
TASK_BYTES = RUN_BYTES
#: Uncompressed bytes read from a file at once (whole row groups).
CHUNK_BYTES = 32 << 20


@dataclass(frozen=True)
class Footer:
    """What a parquet file's footer says: its schema, rows and uncompressed bytes."""

    schema: pa.Schema
    num_rows: int
    num_bytes: int


def read_tasks_for(footers: Sequence[Footer], cpus: int) -> int:
    """How many read tasks: about :data:`TASK_BYTES` each, at least one per CPU, at most one per file."""
    sizes = [("", footer.num_bytes) for footer in footers]
    return max(1, run_count(sizes, at_least=cpus, max_files=None, max_bytes=TASK_BYTES))


class ParquetFilesDatasource(FileRunsDatasource):
    """Rows of already listed parquet ``paths``, conformed to ``schema``."""

    max_files_per_task = 64
    max_bytes_per_task = None  # sized from the footers' uncompressed bytes (read_tasks_for)

    def __init__(
        self,
        paths: Sequence[str],
        footers: Sequence[Footer],
        filesystem: pafs.FileSystem,
        *,
        schema: pa.Schema,
        columns: Sequence[str] | None,
        include_paths: bool,
    ) -> None:
        super().__init__(
            [(path, footer.num_bytes) for path, footer in zip(paths, footers, strict=True)]
        )
        self._rows = {path: footer.num_rows for path, footer in zip(paths, footers, strict=True)}
        self._filesystem = filesystem
        if columns is not None:
            missing = [name for name in columns if name not in schema.names]
            if missing:
                raise ValueError(
                    f"columns {missing} are in none of the parquet files (their columns: "
                    f"{schema.names}); pass names from that list"
                )
            schema = pa.schema([schema.field(name) for name in columns], metadata=schema.metadata)
        self._schema = schema
        self._include_paths = include_paths

    def get_name(self) -> str:
        return "Parquet"

    def _reader(self, paths: list[str]) -> Callable[[], Iterator[pa.Table]]:
        return _ParquetRun(self._filesystem, self._schema, self._include_paths, paths)

    def _run_metadata(self, part: list[tuple[str, int | None]]) -> BlockMetadata:
        return BlockMetadata(
            num_rows=sum(self._rows[path] for path, _ in part),
            size_bytes=sum(size or 0 for _, size in part),
            input_files=tuple(path for path, _ in part),
            exec_stats=None,
        )


class _ParquetRun:
    """One read task's body: its files in order, whole row groups at a time."""

    def __init__(
        self,
        filesystem: pafs.FileSystem,
        schema: pa.Schema,
        include_paths: bool,
        paths: list[str],
    ) -> None:
        self._filesystem = filesystem
        self._schema = schema
        self._include_paths = include_paths
        self._paths = paths

    def __call__(self) -> Iterator[pa.Table]:
        import pyarrow.parquet as pq

        try:
            for path in self._paths:
                try:
                    with self._filesystem.open_input_file(path) as f:
                        parquet = pq.ParquetFile(f)
                        present = [n for n in self._schema.names if n in parquet.schema_arrow.names]
                        for groups in _row_group_runs(parquet.metadata):
                            table = parquet.read_row_groups(groups, columns=present)
                            yield conform(
                                table, self._schema, path if self._include_paths else None
                            )
                except Exception as err:
                    raise naming(err, path) from err
        finally:
            flush_cache(self._filesystem)  # the task's cache counters, once


def _row_group_runs(metadata: pa._parquet.FileMetaData) -> Iterator[list[int]]:
    """Consecutive row groups of about :data:`CHUNK_BYTES` (uncompressed) each."""
    run: list[int] = []
    size = 0
    for index in range(metadata.num_row_groups):
        run.append(index)
        size += metadata.row_group(index).total_byte_size
        if size >= CHUNK_BYTES:
            yield run
            run, size = [], 0
    if run or metadata.num_row_groups == 0:
        yield run


def conform(table: pa.Table, schema: pa.Schema, path: str | None) -> pa.Table:
    """``table`` with exactly ``schema``'s columns: missing ones null, others cast; plus ``path``."""
    columns = []
    for field in schema:
        if field.name in table.column_names:
            column = table.column(field.name)
            columns.append(column if column.type == field.type else column.cast(field.type))
        else:
            columns.append(pa.nulls(table.num_rows, field.type))
    out = pa.Table.from_arrays(columns, schema=schema)
    if path is not None:
        out = out.append_column("path", pa.array([path] * out.num_rows, type=pa.string()))
    return out
