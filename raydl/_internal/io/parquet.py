"""raydl's parquet reads: footers read once, the bad-file scan, one schema, the reader.

* **Footers, once.** :func:`read_footers` reads every file's footer (schema,
  rows, uncompressed bytes) in parallel threads when the plan is built, through
  the filesystem without its disk cache (a footer is a few bytes of a large
  file). The bad-file policy is applied in that same read: with
  ``on_bad_file="raise"`` an unreadable footer is an error naming the file; with
  ``"skip"`` the file is left out, warned about and recorded in the skip ledger
  (:mod:`raydl._internal.io.skips`).
* **One schema.** :func:`unify_schemas` widens the files' schemas into one, so a
  column that only later files have is not dropped.
* **The reader.** :func:`read_dataset` builds the plan with raydl's own source
  (:class:`ParquetFilesDatasource`, in raydl's own plan, a
  :class:`~raydl._internal.io.file_dataset.FileDataset`) where the options allow,
  else with Ray's V1 parquet reader over the good files (a ``ray.data.Dataset``).

Why a source of its own: Ray Data's V1 parquet reader, given one task per file,
spends about as long between two tasks (the scheduler sees one finish, the
raylet starts the next) as a small file's read and filter take: measured here,
16 files of 62.5 k rows ran as 30 ms tasks started 45-55 ms apart. Fewer, longer
tasks amortise that, but Ray's reader then fixes which files share a task, so
``shuffle_mode="files"`` could only permute whole runs. This source keeps the
file list (with each file's footer figures) and cuts it into runs only when an
execution asks (:func:`raydl._internal.io.runs.cut_runs`), after
:meth:`~raydl._internal.io.files.FileRunsDatasource.permuted` has put the files in
the epoch's order. Each file is conformed to the plan's one schema (a missing
column becomes nulls, narrower types are cast), so every block has the same
columns and dtypes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from raydl._internal.io import skips
from raydl._internal.io.file_dataset import FileDataset, plan_of
from raydl._internal.io.files import READ_DATASOURCE_OPTIONS, FileRunsDatasource
from raydl._internal.io.fs import LISTING_THREADS, without_cache
from raydl._internal.io.readers import ParquetRuns
from raydl._internal.io.runs import RUN_BYTES, run_count
from raydl.errors import RemoteReadError

if TYPE_CHECKING:
    import pyarrow.fs as pafs
    import ray.data

__all__ = [
    "Footer",
    "ParquetFilesDatasource",
    "first_bad_file",
    "read_dataset",
    "read_footers",
    "read_tasks_for",
    "unify_schemas",
]

#: Uncompressed bytes a read task aims at (row-group sizes from the footers).
TASK_BYTES = RUN_BYTES
#: What raydl's parquet source takes besides the files; other options (``filter``,
#: ``partitioning``, Ray's own ``shuffle``, ...) go to Ray's V1 parquet reader.
OWN_READER_OPTIONS = READ_DATASOURCE_OPTIONS | {"schema"}


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


@dataclass(frozen=True)
class _Bad:
    """Why a file's footer cannot be read (``error``: what reading it raised, if it was read)."""

    reason: str
    error: Exception | None = None


def _read_footer(filesystem: pafs.FileSystem, path: str, size: int | None) -> Footer | _Bad:
    """The footer figures of ``path``, or why they cannot be read.

    Raises:
        RemoteReadError: The remote failed past its retry budget (never the file's fault).
        MemoryError: Likewise.
    """
    import pyarrow.parquet as pq

    if size == 0:
        return _Bad("empty file (0 bytes), not a parquet file")
    try:
        with filesystem.open_input_file(path) as f:
            metadata = pq.read_metadata(f)
            return Footer(
                schema=metadata.schema.to_arrow_schema(),
                num_rows=metadata.num_rows,
                num_bytes=sum(
                    metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups)
                ),
            )
    except Exception as err:
        if skips.never_skipped(err):
            raise
        return _Bad(f"{type(err).__name__}: {err}", err)


def unreadable(path: str, reason: str) -> ValueError:
    """The error for a parquet file whose footer cannot be read."""
    return ValueError(
        f"parquet file {path!r} cannot be read: {reason}. Replace or delete it, or pass "
        "on_bad_file='skip' to read the other files without it"
    )


def refuse_empty(files: Sequence[tuple[str, int | None]]) -> None:
    """Raise a ``ValueError`` naming the first listed empty file, if any (``on_bad_file="raise"``)."""
    empty = [path for path, size in files if size == 0]
    if empty:
        more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
        raise ValueError(
            f"parquet file {empty[0]!r} is empty (0 bytes){more}; delete it, "
            "or pass on_bad_file='skip' to read the other files without it"
        )


def read_footers(
    filesystem: pafs.FileSystem,
    files: Sequence[tuple[str, int | None]],
    *,
    on_bad_file: skips.BadFilePolicy,
) -> tuple[list[str], list[Footer]]:
    """Every file's footer, read once (in parallel threads), with the bad-file policy applied.

    Args:
        filesystem: The files' filesystem (without a disk cache: see
            :func:`raydl._internal.io.fs.without_cache`).
        files: ``(path, listed size)`` of each file.
        on_bad_file: ``"raise"``: a footer that cannot be read is an error naming
            the file (a missing or forbidden file raises its own error).
            ``"skip"``: such files are left out, warned about and recorded in the
            skip ledger.

    Returns:
        The paths kept and their footers, in ``files`` order.

    Raises:
        ValueError: A footer cannot be read (``"raise"``), or no file is left (``"skip"``).
        RemoteReadError: The remote failed for longer than the retry budget.
    """
    if on_bad_file == "skip":
        skips.ledger()  # owned by this driver, so it lives as long as the job
    kept: list[str] = []
    footers: list[Footer] = []
    bad: list[tuple[str, str]] = []
    with ThreadPoolExecutor(max_workers=LISTING_THREADS, thread_name_prefix="raydl-footer") as pool:
        results = pool.map(lambda f: _read_footer(filesystem, f[0], f[1]), files)
        for (path, _), found in zip(files, results, strict=True):
            if isinstance(found, Footer):
                kept.append(path)
                footers.append(found)
            elif on_bad_file == "skip":
                bad.append((path, found.reason))
            elif isinstance(found.error, (FileNotFoundError, PermissionError)):
                raise found.error
            else:
                raise unreadable(path, found.reason) from found.error
    for path, reason in bad:
        skips.record_skip(path, reason)
    if bad and len(bad) == len(files):
        raise ValueError(
            f"on_bad_file='skip' left no parquet file to read: all {len(files)} are bad, "
            f"e.g. {bad[0][0]!r}: {bad[0][1]}"
        )
    return kept, footers


def first_bad_file(
    filesystem: pafs.FileSystem,
    files: Sequence[tuple[str, int | None]],
    *,
    threads: int = LISTING_THREADS,
) -> tuple[str, str] | None:
    """``(path, reason)`` of the first file in ``files`` whose footer cannot be read, if any.

    For naming the file behind an error of Ray's reader: footers are read in
    parallel threads, in chunks, and the search stops after the first chunk with
    a bad file.

    Raises:
        RemoteReadError: The remote failed for longer than the retry budget.
    """
    chunk = max(1, threads * 4)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="raydl-footer") as pool:
        for start in range(0, len(files), chunk):
            part = files[start : start + chunk]
            for (path, _), found in zip(
                part, pool.map(lambda f: _read_footer(filesystem, f[0], f[1]), part), strict=True
            ):
                if isinstance(found, _Bad):
                    return path, found.reason
    return None


def unify_schemas(paths: Sequence[str], schemas: Sequence[pa.Schema]) -> pa.Schema:
    """One schema for the files ``paths`` whose footers gave ``schemas``.

    Ray's parquet reader takes the first file's schema, so a column that only later
    files have would be dropped without a word. Here every footer counts: types
    widen where Arrow can (float32 + float64 -> float64), and an integer column
    missing from some files becomes float64, so that its missing rows (nulls, NaN
    in numpy) give every batch the same dtype.

    Raises:
        TypeError: two files disagree on a column's type in a way Arrow cannot
            widen; the message names the column's types and both files.
    """
    unified = schemas[0]
    for path, schema in zip(paths[1:], schemas[1:], strict=True):
        try:
            unified = pa.unify_schemas([unified, schema], promote_options="permissive")
        except (pa.ArrowTypeError, pa.ArrowInvalid) as err:
            raise TypeError(
                f"parquet files disagree on a column's type: {err} (between {paths[0]!r} "
                f"and the files up to {path!r}). Cast the column when writing, read the files "
                "separately, or pass schema= to read them all with one schema"
            ) from err
    everywhere = set.intersection(*(set(schema.names) for schema in schemas))
    fields = [
        field.with_type(pa.float64())
        if field.name not in everywhere and pa.types.is_integer(field.type)
        else field
        for field in unified
    ]
    return pa.schema(fields, metadata=unified.metadata)


def read_dataset(
    filesystem: pafs.FileSystem,
    files: Sequence[tuple[str, int | None]],
    *,
    on_bad_file: skips.BadFilePolicy,
    columns: Sequence[str] | None,
    include_paths: bool,
    options: Mapping[str, Any],
    cpus: int,
) -> FileDataset | ray.data.Dataset:
    """The plan that reads the listed parquet ``files`` (what ``raydl.read_parquet`` returns).

    raydl's own source (several files per read task, cut after the epoch's file
    order) in raydl's own plan, built without Ray Data, where ``options`` are all
    :data:`OWN_READER_OPTIONS`; else Ray's V1
    parquet reader, one read task per file and at least one per CPU unless
    ``override_num_blocks`` says otherwise, with one schema for all files unless
    ``schema`` is given (Ray's reader is built with its V1 parquet reader, see
    :func:`raydl._internal.ray_compat.reads.parquet_reader_v1`; a shuffle's cost
    grows with the square of the block count, hence one read task per file
    rather than V1's default of 200). Footers are read once, here (see
    :func:`read_footers`), where the policy, the schema or raydl's source need them.

    Args:
        filesystem: The files' filesystem (the read tasks use it, disk cache included).
        files: ``(path, listed size)`` of each file, as listed.
        on_bad_file: ``"raise"`` or ``"skip"`` (see :func:`read_footers`).
        columns: Read only these columns.
        include_paths: Add a ``path`` column.
        options: Options of ``ray.data.read_datasource`` / ``ray.data.read_parquet``.
        cpus: The cluster's CPUs (the least number of read tasks).

    Raises:
        ValueError: A file is empty or its footer cannot be read (``"raise"``;
            the message names it), or no file is left (``"skip"``).
        RemoteReadError: The remote failed for longer than the retry budget.
    """
    options = dict(options)
    footer_fs = without_cache(filesystem)
    if on_bad_file == "raise":
        refuse_empty(files)
    own = bool(files) and set(options) <= OWN_READER_OPTIONS
    paths = [path for path, _ in files]
    footers: list[Footer] = []
    if on_bad_file == "skip" or own or (options.get("schema") is None and len(files) > 1):
        paths, footers = read_footers(footer_fs, files, on_bad_file=on_bad_file)
    columns = list(columns) if columns is not None else None
    if own:
        schema = options.pop("schema", None) or unify_schemas(paths, [f.schema for f in footers])
        source = ParquetFilesDatasource(
            paths, footers, filesystem, schema=schema, columns=columns, include_paths=include_paths
        )
        options.setdefault("override_num_blocks", read_tasks_for(footers, cpus))
        return plan_of(source, options, cpus)
    import ray.data

    from raydl._internal.ray_compat import reads

    options.setdefault("override_num_blocks", max(len(paths), cpus))
    if options.get("schema") is None and len(paths) > 1:
        options["schema"] = unify_schemas(paths, [f.schema for f in footers])
    try:
        with reads.parquet_reader_v1():
            return ray.data.read_parquet(
                paths,
                filesystem=filesystem,
                columns=columns,
                include_paths=include_paths,
                **options,
            )
    except (FileNotFoundError, PermissionError, RemoteReadError):
        raise
    except (ValueError, OSError) as err:
        # Ray reads a sample of footers here, and its error may not name the file: find it.
        bad = first_bad_file(footer_fs, files)
        if bad is None:
            raise
        raise unreadable(*bad) from err


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

    def run_reader(self) -> ParquetRuns:
        return ParquetRuns(self._filesystem, self._schema, self._include_paths)

    def run_rows(self, part: Sequence[tuple[str, int | None]]) -> int:
        return sum(self._rows[path] for path, _ in part)
