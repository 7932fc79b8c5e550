"""Readers of fsspec URLs into lazy Ray Data datasets.

Each reader resolves ``paths`` (``s3://``, ``gs://``, ``file://``, plain local
paths, or any fsspec protocol) with ``storage_options`` into an fsspec
filesystem, bridges it to pyarrow with retries and an optional local disk cache
(:mod:`raydl._internal.io.fs`), lists the files, and builds the read: with raydl's
own sources, several files per read task (:mod:`raydl._internal.io.files`,
:mod:`raydl._internal.io.parquet`), where the options allow, else with Ray
Data's reader. The result is a lazy plan: nothing is read until it is iterated (for
example by :class:`raydl.RayDataLoader`). With raydl's own source it is a
:class:`FileDataset`, raydl's own plan, built and run without importing Ray Data
(about 60 MB of the training process's memory and half a second of its start); it
behaves as the ``ray.data.Dataset`` of the same read (``map_batches``, ``filter``,
``take``, ... work as usual: any call but a plain ``map_batches`` builds that Ray
Data plan and is made there), but is no instance of it. Ray Data's own readers give
a ``ray.data.Dataset``. This module holds the public readers and
their argument checks; the work is in ``raydl._internal.io``.

Listing: a prefix is listed when the plan is built, on the driver. raydl's own
listing runs before Ray starts (where Ray's readers list, the paths are looked up
first), so a missing path or a folder without matching files is an error at once,
naming the path as written and what was looked for. Its
immediate sub-prefixes (e.g. ``train/<label>/``) are listed in parallel threads,
each recursively, so a bucket with many labels does not page through one
listing serially; the file list and its (sorted) order are the same as a
serial listing's. Many paths given at once are expanded in parallel threads.

Ray: after listing, a reader connects this process to Ray (Ray Data plans run on
it), starting the embedded instance if none is up. In one process, with no cluster
named, ``read_parquet`` and ``read_binary_files`` return without waiting for that
start (it runs on a thread; their plan is built without Ray), and a Ray call of the
script waits for it instead of starting a second instance; a loader's first runs
load in the trainer meanwhile. Under torchrun every rank joins rank 0's instance,
as a loader does, so a script that reads on its ranks needs no ``raydl.init()``
first (ranks launched without torchrun's store still do).

Bad files: with the default ``on_bad_file="raise"``, a file that cannot be read
or decoded (corrupt or truncated parquet, a non-image among images, an empty
file) fails the read with an error naming it. With ``on_bad_file="skip"`` that
file is left out whole, a warning names it, and it is recorded in a ledger
(``raydl._internal.io.skips.snapshot()``); a remote that stays down is never a
reason to skip (:class:`RemoteReadError` is raised).

The filesystem must be reachable from every Ray worker: ``memory://`` holds its
files in one process and is therefore not suitable.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import fsspec
import pyarrow.fs as pafs
from fsspec.utils import get_protocol

from raydl._internal.io.cache import CacheConfig, CacheStats, DiskCache, as_cache_config
from raydl._internal.io.file_dataset import FileDataset, plan_of
from raydl._internal.io.fs import (
    LISTING_OPTIONS,
    RemoteHandler,
    RetryPolicy,
    check_paths_exist,
    describe_endpoint,
    list_files,
    to_pyarrow,
)
from raydl._internal.runtime import cluster
from raydl.errors import RemoteReadError

if TYPE_CHECKING:
    import ray.data

__all__ = [
    "CacheConfig",
    "CacheStats",
    "FileDataset",
    "RemoteReadError",
    "RetryPolicy",
    "label_from_path",
    "read_binary_files",
    "read_images",
    "read_parquet",
]

PathsLike = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
CacheLike = CacheConfig | str | os.PathLike[str] | None
_LOCAL_PROTOCOLS = ("file",)


def label_from_path(path: str, *, level: int = -2) -> str:
    """The path component at ``level`` (default: the parent directory, the usual label).

    Works for keys such as ``train/<label>/<uuid>.jpeg`` (with or without a
    bucket or URL scheme in front).

    Args:
        path: An object key or file path, as in the ``path`` column of the readers.
        level: Index into the ``/``-separated components (``-2``: the parent directory).

    Returns:
        The component, e.g. the class name.

    Raises:
        ValueError: ``path`` has no component at ``level``.

    Example:
        >>> label_from_path("bucket/train/7/0b1c.jpeg")
        '7'
        >>> label_from_path("s3://bucket/train/7/0b1c.jpeg", level=-3)
        'train'

        In a pipeline, with labels as integers::

            ds = raydl.read_images("s3://bucket/train/", storage_options=opts)
            ds = ds.map_batches(lambda b: {
                "image": b["image"],
                "label": np.array([int(raydl.label_from_path(p)) for p in b["path"]]),
            })
    """
    parts = [p for p in str(path).split("/") if p]
    try:
        return parts[level]
    except IndexError:
        raise ValueError(
            f"path {path!r} has no component at level={level}; it has {len(parts)} components"
        ) from None


def resolve_filesystem(
    paths: PathsLike,
    *,
    filesystem: pafs.FileSystem | fsspec.AbstractFileSystem | None = None,
    storage_options: Mapping[str, Any] | None = None,
    cache: CacheLike = None,
    retry: RetryPolicy | None = None,
) -> tuple[list[str], pafs.FileSystem]:
    """The paths without their scheme and the pyarrow filesystem to read them with.

    Local paths without a cache are read with pyarrow's native local filesystem;
    everything else goes through :class:`raydl._internal.io.fs.RemoteHandler`.

    Example:
        >>> paths, fs = resolve_filesystem("/tmp/data.parquet")
        >>> paths, fs.type_name
        (['/tmp/data.parquet'], 'local')
    """
    path_list = _as_path_list(paths)
    options = dict(storage_options or {})
    cache_config = as_cache_config(cache)
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise TypeError(
            f"retry option should be a raydl.RetryPolicy or None, got {type(retry).__name__}"
        )
    protocols = {get_protocol(p) for p in path_list}
    if len(protocols) > 1:
        raise ValueError(
            f"paths should all use one protocol, got {sorted(protocols)}; "
            "read each protocol separately and union() the datasets"
        )
    protocol = protocols.pop()

    if filesystem is not None and options:
        raise ValueError(
            "storage_options option is for filesystems raydl creates; with filesystem= given, "
            "configure that filesystem instead"
        )
    fs: fsspec.AbstractFileSystem
    if isinstance(filesystem, pafs.FileSystem):
        if cache_config is None and retry is None:
            return [_strip(p) for p in path_list], filesystem
        from fsspec.implementations.arrow import ArrowFSWrapper

        fs = ArrowFSWrapper(filesystem)
    elif isinstance(filesystem, fsspec.AbstractFileSystem):
        fs = filesystem
    elif filesystem is None:
        if protocol in _LOCAL_PROTOCOLS and cache_config is None and retry is None:
            if options:
                raise ValueError(
                    f"storage_options option does not apply to local paths, got {sorted(options)}"
                )
            return [_strip(p) for p in path_list], pafs.LocalFileSystem()
        fs = fsspec.filesystem(protocol, **options)
    else:
        raise TypeError(
            "filesystem option should be a pyarrow.fs.FileSystem, an fsspec filesystem or None, "
            f"got {type(filesystem).__name__}"
        )
    fs_protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    handler = RemoteHandler(
        fs,
        endpoint=describe_endpoint(str(fs_protocol), options or getattr(fs, "storage_options", {})),
        retry=retry or RetryPolicy(),
        cache=DiskCache(cache_config) if cache_config is not None else None,
    )
    return [fs._strip_protocol(p) for p in path_list], to_pyarrow(handler)


def read_parquet(
    paths: PathsLike,
    *,
    filesystem: pafs.FileSystem | fsspec.AbstractFileSystem | None = None,
    storage_options: Mapping[str, Any] | None = None,
    columns: Sequence[str] | None = None,
    cache: CacheLike = None,
    retry: RetryPolicy | None = None,
    include_paths: bool = False,
    on_bad_file: Literal["raise", "skip"] = "raise",
    **ray_options: Any,
) -> FileDataset | ray.data.Dataset:
    """A lazy dataset of the rows of parquet files at fsspec URLs.

    Args:
        paths: A file, a directory/prefix, or a list of them, e.g.
            ``"s3://bucket/table/"``. All must use one protocol.
        filesystem: A ready ``pyarrow.fs.FileSystem`` or fsspec filesystem
            (then ``paths`` are within it and ``storage_options`` must be empty).
        storage_options: Passed to the fsspec filesystem, e.g. for s3fs
            ``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}``.
        columns: Read only these columns.
        cache: A directory or :class:`CacheConfig`: keep whole files on local
            disk so later epochs do not read the remote again.
        retry: Retries of remote calls (default :class:`RetryPolicy()`).
        include_paths: Add a ``path`` column with each row's file.
        on_bad_file: ``"raise"``: a file that is not valid parquet (corrupt,
            truncated, empty) is an error naming it. ``"skip"``: every file's
            footer is read when the plan is built (in parallel threads), and the
            bad ones are left out whole, warned about and recorded in the skip
            ledger. A file whose footer is valid but whose data pages are
            corrupt still fails the read, naming the file.
        **ray_options: Passed to ``ray.data.read_parquet`` (e.g.
            ``override_num_blocks``, ``concurrency``, ``filter``).

    Returns:
        A lazy plan; nothing has been read but the files' metadata. A
        :class:`FileDataset` where raydl's own source reads the files (no option of
        Ray's V1 reader given), else a ``ray.data.Dataset``.

    Raises:
        FileNotFoundError: A path does not exist, or no ``.parquet`` file is
            under them (the message names the paths as written and what was
            looked for); raised before Ray starts.
        ValueError: With ``on_bad_file="raise"``, a file is empty or its
            footer cannot be read (the message names it); with ``"skip"``,
            no readable file is left.
        RemoteReadError: The remote failed for longer than ``retry`` allows.

    Example:
        >>> import raydl
        >>> ds = raydl.read_parquet(  # doctest: +SKIP
        ...     "s3://bucket/events/",
        ...     storage_options={"client_kwargs": {"endpoint_url": "http://127.0.0.1:8333"}},
        ...     columns=["user", "clicked"],
        ...     cache="/tmp/raydl-cache",
        ... )
        >>> loader = raydl.RayDataLoader(ds, batch_size=256, shuffle=True)  # doctest: +SKIP
    """
    from raydl._internal.io import parquet, skips

    policy = skips.validate_policy(on_bad_file)
    stripped, fs = resolve_filesystem(
        paths, filesystem=filesystem, storage_options=storage_options, cache=cache, retry=retry
    )
    user_skips = ray_options.pop("skip_paths", None) or []
    user_skips = [user_skips] if isinstance(user_skips, (str, os.PathLike)) else list(user_skips)
    # Listed before Ray starts: a wrong path is named at once, not after Ray's start-up.
    files = list_files(
        fs,
        stripped,
        file_extensions=ray_options.get("file_extensions", ["parquet"]),
        ignore_missing_paths=bool(ray_options.get("ignore_missing_paths", False)),
        partition_filter=ray_options.get("partition_filter"),
        exclude=frozenset(os.fspath(p) for p in user_skips),
        reader="read_parquet",
        written=_as_path_list(paths),
    )
    # The plan is built while Ray starts (Ray's own reader waits for it; the skip
    # ledger, an actor, needs it at once).
    if policy == "skip":
        cluster.ensure_ray_for_reads()
    else:
        cluster.begin_ray_for_reads()
    return parquet.read_dataset(
        fs,
        files,
        on_bad_file=policy,
        columns=columns,
        include_paths=include_paths,
        options={k: v for k, v in ray_options.items() if k not in LISTING_OPTIONS},
        cpus=cluster.read_cpus(),
    )


def read_images(
    paths: PathsLike,
    *,
    filesystem: pafs.FileSystem | fsspec.AbstractFileSystem | None = None,
    storage_options: Mapping[str, Any] | None = None,
    include_paths: bool = True,
    size: tuple[int, int] | None = None,
    mode: str | None = None,
    cache: CacheLike = None,
    retry: RetryPolicy | None = None,
    on_bad_file: Literal["raise", "skip"] = "raise",
    **ray_options: Any,
) -> ray.data.Dataset:
    """A lazy dataset of decoded images (an ``image`` column, and ``path``) at fsspec URLs.

    Args:
        paths: Image files or prefixes, e.g. ``"s3://bucket/train/"``.
        filesystem: A ready pyarrow or fsspec filesystem (see :func:`read_parquet`).
        storage_options: Passed to the fsspec filesystem.
        include_paths: Add a ``path`` column (the key without scheme), from which
            :func:`label_from_path` takes a label.
        size: Resize every image to ``(height, width)``.
        mode: PIL mode to convert to, e.g. ``"L"`` or ``"RGB"``.
        cache: A directory or :class:`CacheConfig` (see :func:`read_parquet`).
        retry: Retries of remote calls (default :class:`RetryPolicy()`).
        on_bad_file: ``"raise"``: a file that cannot be read or decoded as an
            image (e.g. a text file named ``.jpg``, an empty file) fails the
            epoch with an error naming it. ``"skip"``: that file is left out,
            warned about and recorded in the skip ledger; the others are read
            exactly once.
        **ray_options: Passed to ``ray.data.read_images`` (e.g. ``file_extensions``).

    Returns:
        A ``ray.data.Dataset`` with ``image`` (uint8 arrays) and ``path`` columns.

    Raises:
        FileNotFoundError: A path does not exist, or (on a local disk) no image
            file is under them; raised before Ray starts, naming the paths as
            written. Under a remote prefix Ray's listing reports an empty one.

    Example:
        >>> import raydl
        >>> ds = raydl.read_images(  # doctest: +SKIP
        ...     "s3://bucket/train/",
        ...     storage_options=opts,
        ...     size=(28, 28),
        ...     mode="L",
        ... )
        >>> ds.take(1)[0]["path"]  # doctest: +SKIP
        'bucket/train/7/0b1c.jpeg'
    """
    import ray.data

    from raydl._internal.io import skipping, skips
    from raydl._internal.ray_compat import reads

    policy = skips.validate_policy(on_bad_file)
    stripped, fs = resolve_filesystem(
        paths, filesystem=filesystem, storage_options=storage_options, cache=cache, retry=retry
    )
    _check_before_ray(
        "read_images",
        fs,
        stripped,
        _as_path_list(paths),
        ray_options,
        default_extensions=reads.IMAGE_EXTENSIONS,
    )
    cluster.ensure_ray_for_reads()
    if policy == "raise":
        return ray.data.read_images(
            stripped,
            filesystem=fs,
            include_paths=include_paths,
            size=size,
            mode=mode,
            **ray_options,
        )
    ray_options.setdefault("file_extensions", reads.IMAGE_EXTENSIONS)
    return _read_skipping(
        skipping.SkippingImageDatasource,
        stripped,
        fs,
        open_args_option="arrow_open_file_args",
        ray_options=ray_options,
        include_paths=include_paths,
        size=size,
        mode=mode,
        meta_provider=reads.ImageFileMetadataProvider(),
    )


def read_binary_files(
    paths: PathsLike,
    *,
    filesystem: pafs.FileSystem | fsspec.AbstractFileSystem | None = None,
    storage_options: Mapping[str, Any] | None = None,
    include_paths: bool = True,
    cache: CacheLike = None,
    retry: RetryPolicy | None = None,
    on_bad_file: Literal["raise", "skip"] = "raise",
    **ray_options: Any,
) -> FileDataset | ray.data.Dataset:
    """A lazy dataset of whole objects as bytes (a ``bytes`` column, and ``path``).

    Args:
        paths: Files or prefixes, e.g. ``"s3://bucket/shards/"``.
        filesystem: A ready pyarrow or fsspec filesystem (see :func:`read_parquet`).
        storage_options: Passed to the fsspec filesystem.
        include_paths: Add a ``path`` column (the key without scheme).
        cache: A directory or :class:`CacheConfig` (see :func:`read_parquet`).
        retry: Retries of remote calls (default :class:`RetryPolicy()`).
        on_bad_file: ``"raise"``: a file that cannot be read (e.g. deleted
            after listing) fails the epoch with an error naming it. ``"skip"``:
            it is left out, warned about and recorded in the skip ledger.
        **ray_options: ``file_extensions``, ``ignore_missing_paths`` and
            ``partition_filter`` (raydl's listing applies them) and
            ``override_num_blocks``, ``concurrency``, ``num_cpus``, ``memory``,
            ``ray_remote_args`` (of the read tasks). With these, raydl reads many
            files per task itself (``_internal/io/files.py``: Ray's reader costs
            about 1 ms of CPU per file); any other option (``partitioning``,
            ``shuffle``, ...) hands the read to ``ray.data.read_binary_files``.

    Returns:
        A lazy plan with ``bytes`` and ``path`` columns: a :class:`FileDataset` where
        raydl reads the files itself, else a ``ray.data.Dataset``.

    Raises:
        FileNotFoundError: A path does not exist, or no file is under them
            (raydl's own reader, or any local disk); raised before Ray starts,
            naming the paths as written.

    Example:
        >>> import raydl
        >>> ds = raydl.read_binary_files("s3://bucket/raw/", storage_options=opts)  # doctest: +SKIP
        >>> ds = ds.map_batches(decode)  # doctest: +SKIP
    """
    from raydl._internal.io import skips
    from raydl._internal.io.files import READ_DATASOURCE_OPTIONS, FileListDatasource

    policy = skips.validate_policy(on_bad_file)
    stripped, fs = resolve_filesystem(
        paths, filesystem=filesystem, storage_options=storage_options, cache=cache, retry=retry
    )
    written = _as_path_list(paths)
    if set(ray_options) <= LISTING_OPTIONS | READ_DATASOURCE_OPTIONS:
        # raydl's own reader: many files per task (Ray's costs ~1 ms of CPU per file),
        # listed before Ray starts (a wrong path is named at once).
        files = list_files(
            fs,
            stripped,
            file_extensions=ray_options.pop("file_extensions", None),
            ignore_missing_paths=bool(ray_options.pop("ignore_missing_paths", False)),
            partition_filter=ray_options.pop("partition_filter", None),
            reader="read_binary_files",
            written=written,
        )
        if policy == "skip":
            cluster.ensure_ray_for_reads()
            skips.ledger()  # owned by this driver, so it lives as long as the job
        else:
            cluster.begin_ray_for_reads()  # the plan is built while Ray starts
        source = FileListDatasource(files, fs, include_paths=include_paths, on_bad_file=policy)
        return plan_of(source, ray_options, cluster.read_cpus())
    import ray.data

    from raydl._internal.io import skipping

    _check_before_ray("read_binary_files", fs, stripped, written, ray_options)
    cluster.ensure_ray_for_reads()
    if policy == "raise":
        return ray.data.read_binary_files(
            stripped, filesystem=fs, include_paths=include_paths, **ray_options
        )
    from ray.data.datasource.file_meta_provider import DefaultFileMetadataProvider

    return _read_skipping(
        skipping.SkippingBinaryDatasource,
        stripped,
        fs,
        open_args_option="arrow_open_stream_args",
        ray_options=ray_options,
        include_paths=include_paths,
        meta_provider=DefaultFileMetadataProvider(),
    )


def _read_skipping(
    datasource_cls: type[Any],
    paths: list[str],
    filesystem: pafs.FileSystem,
    *,
    open_args_option: str,
    ray_options: dict[str, Any],
    **datasource_options: Any,
) -> ray.data.Dataset:
    """What ``ray.data.read_images``/``read_binary_files`` do, with a skipping datasource.

    ``ray_options`` are split as Ray's readers split them: the options of
    ``ray.data.read_datasource`` (resources, concurrency, block counts) go
    there, the rest to the datasource.
    """
    import ray.data

    from raydl._internal.io import skips

    read_params = set(inspect.signature(ray.data.read_datasource).parameters)
    read_params -= {"datasource", "read_args"}
    read_kwargs = {k: v for k, v in ray_options.items() if k in read_params}
    source_kwargs = {k: v for k, v in ray_options.items() if k not in read_params}
    if open_args_option in source_kwargs:
        source_kwargs["open_stream_args"] = source_kwargs.pop(open_args_option)
    skips.ledger()  # owned by this driver, so it lives as long as the job
    datasource = datasource_cls(paths, filesystem=filesystem, **datasource_options, **source_kwargs)
    return ray.data.read_datasource(datasource, **read_kwargs)


def _check_before_ray(
    reader: str,
    filesystem: pafs.FileSystem,
    paths: list[str],
    written: list[str],
    ray_options: Mapping[str, Any],
    *,
    default_extensions: list[str] | None = None,
) -> None:
    """For a read whose listing is Ray Data's: its path errors before Ray starts.

    A local filesystem is listed here as Ray would list it (milliseconds), so a
    folder without matching files is named too; a remote one only has each path
    looked up (a missing prefix), not listed twice.
    """
    ignore_missing = bool(ray_options.get("ignore_missing_paths", False))
    if not isinstance(filesystem, pafs.LocalFileSystem):
        check_paths_exist(
            filesystem, paths, reader=reader, written=written, ignore_missing_paths=ignore_missing
        )
        return
    list_files(
        filesystem,
        paths,
        file_extensions=ray_options.get("file_extensions", default_extensions),
        ignore_missing_paths=ignore_missing,
        partition_filter=ray_options.get("partition_filter"),
        reader=reader,
        written=written,
    )


def _as_path_list(paths: PathsLike) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        path_list = [os.fspath(paths)]
    elif isinstance(paths, Sequence) and all(isinstance(p, (str, os.PathLike)) for p in paths):
        path_list = [os.fspath(p) for p in paths]
    else:
        raise TypeError(
            f"paths option should be a path/URL or a list of them, got {type(paths).__name__}"
        )
    if not path_list:
        raise ValueError("paths option should name at least one path or URL, got an empty list")
    return path_list


def _strip(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path
