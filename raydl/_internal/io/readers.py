"""How a run of files is read: raydl's file and parquet readers, without Ray Data.

A run (a contiguous part of a read's file list, :mod:`raydl._internal.io.runs`) is
read by one of these objects, wherever it is read: in a Ray Data read task (the
sources in ``files.py`` and ``parquet.py`` wrap them as their tasks' bodies), on
one of raydl's direct-path actors, or in the training process while the actors
start (``epochs/direct.py``). They are plain picklable objects, and this module
imports neither Ray Data nor anything that does: a direct-path actor unpickles its
epoch's reader without importing ``ray.data`` (about 60 MB and a CPU-second per
process, pandas included; docs/design/direct-execution.md, "Actors without Ray Data").

``retried``: the messages of the errors a read retries (Ray Data's
``DataContext.retried_io_errors``, which also decide what the skip policy may skip);
the caller passes its epoch's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import pyarrow as pa

from raydl._internal.io import skips
from raydl._internal.io.fs import flush_cache

if TYPE_CHECKING:
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

__all__ = ["BinaryRuns", "ParquetRuns", "RunReader", "conform", "decode_threads", "naming"]

#: Uncompressed bytes read from a parquet file at once (whole row groups).
CHUNK_BYTES = 32 << 20


class RunReader(Protocol):
    """Reads a run of files (paths in order) into Arrow tables."""

    def read(self, paths: Sequence[str], retried: Sequence[str]) -> Iterator[pa.Table]: ...


class BinaryRuns:
    """Whole files as a ``bytes`` column (and ``path``), one table per run, in the run's order.

    Files on pyarrow's local filesystem are read in one loop (a few microseconds
    each). Any other filesystem (an object store, an fsspec bridge) answers each
    request after a round trip, so up to :attr:`READ_THREADS` files are fetched at
    once; the table keeps the run's file order either way.
    """

    #: Files fetched at once per run from a filesystem other than the local disk.
    READ_THREADS = 16

    def __init__(self, filesystem: pafs.FileSystem, *, include_paths: bool, skip: bool) -> None:
        self._filesystem = filesystem
        self._include_paths = include_paths
        self._skip = skip

    def _read(self, path: str) -> tuple[bytes | None, Exception | None]:
        try:
            with self._filesystem.open_input_stream(path) as f:
                return f.read(), None
        except Exception as err:
            return None, err

    def _results(self, paths: Sequence[str]) -> Iterator[tuple[bytes | None, Exception | None]]:
        import pyarrow.fs as pafs

        threads = min(self.READ_THREADS, len(paths))
        if isinstance(self._filesystem, pafs.LocalFileSystem) or threads < 2:
            yield from map(self._read, paths)
            return
        with ThreadPoolExecutor(threads, thread_name_prefix="raydl-read") as pool:
            # map() yields in order; if the run stops early (a file failed and
            # is not skipped), closing it cancels the reads not yet started.
            yield from pool.map(self._read, paths)

    def read(self, paths: Sequence[str], retried: Sequence[str]) -> Iterator[pa.Table]:
        """The run's files as one table; a bad file raises naming it, or is skipped and recorded."""
        datas: list[bytes] = []
        kept: list[str] = []
        try:
            for path, (data, err) in zip(paths, self._results(paths), strict=True):
                if err is not None:
                    if not self._skip or not skips.skippable(err, retried):
                        raise naming(err, path) from err
                    skips.record_skip(path, err)
                    continue
                assert data is not None
                datas.append(data)
                kept.append(path)
        finally:
            flush_cache(self._filesystem)  # the run's cache counters, once
        columns: dict[str, Any] = {"bytes": packed(datas, pa.binary())}
        if self._include_paths:
            columns["path"] = packed([path.encode() for path in kept], pa.string())
        yield pa.table(columns)


class ParquetRuns:
    """Rows of parquet files conformed to ``schema``, whole row groups at a time, in the run's order."""

    def __init__(self, filesystem: pafs.FileSystem, schema: pa.Schema, include_paths: bool) -> None:
        self._filesystem = filesystem
        self._schema = schema
        self._include_paths = include_paths

    def read(self, paths: Sequence[str], retried: Sequence[str]) -> Iterator[pa.Table]:
        """The run's rows, about :data:`CHUNK_BYTES` per table; an error names its file.

        ``retried`` is not used: a parquet file's pages are read whole, and an
        unreadable one fails the run (the skip policy applies to footers, when the
        plan is built).
        """
        import pyarrow.parquet as pq

        threads = decode_threads()
        try:
            for path in paths:
                try:
                    with self._filesystem.open_input_file(path) as f:
                        parquet = pq.ParquetFile(f)
                        present = [n for n in self._schema.names if n in parquet.schema_arrow.names]
                        for groups in _row_group_runs(parquet.metadata):
                            table = parquet.read_row_groups(
                                groups, columns=present, use_threads=threads
                            )
                            yield conform(
                                table, self._schema, path if self._include_paths else None
                            )
                except Exception as err:
                    raise naming(err, path) from err
        finally:
            flush_cache(self._filesystem)  # the run's cache counters, once


def _row_group_runs(metadata: pq.FileMetaData) -> Iterator[list[int]]:
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
        out = out.append_column("path", packed([path.encode()] * out.num_rows, pa.string()))
    return out


#: The most bytes an Arrow ``binary``/``string`` array holds (32-bit offsets).
_MAX_PACKED = (1 << 31) - 1


def packed(values: Sequence[bytes], type: pa.DataType) -> pa.Array:
    """``values`` (UTF-8 for ``pa.string()``) as one Arrow ``binary`` or ``string`` array.

    Built from its two buffers: ``pa.array`` of a list imports pandas (to check
    for its objects), 41 MB of a training process that loads runs itself. Over
    2 GB in all: ``pa.array``'s chunked array.
    """
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > _MAX_PACKED:
        return pa.array(values, type=type)
    buffers = [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(values))]
    return pa.Array.from_buffers(type, len(values), buffers)


def decode_threads() -> bool:
    """Whether a read here decodes columns on pyarrow's thread pool: only with over one CPU.

    A read task (a Ray Data task, or a run on one of raydl's direct-path actors) is
    one CPU's work, and Ray runs as many as the cluster has CPUs: pyarrow's pool,
    sized to the whole machine, then only adds threads that compete for the same
    cores (measured: two processes reading 32 files each on 2 cores spent 0.68-0.83
    CPU-seconds each without the pool, 0.85-1.0 with it, and took as much longer).
    A task given more than one CPU (``ray_remote_args={"num_cpus": 4}``), or a read
    outside Ray, keeps the pool.
    """
    import ray

    from raydl._internal.ray_compat.cluster import in_worker
    from raydl._internal.runtime.cluster import is_connected

    if not is_connected() or not in_worker():  # the trainer's process (or no Ray at all)
        return True
    return float(ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)) > 1


def naming(err: Exception, path: str) -> Exception:
    """``err``, or one of its type whose message also names ``path``."""
    if path in str(err):
        return err
    try:
        return type(err)(f"{err} (file {path!r})")
    except Exception:  # an exception type with another constructor
        return err
