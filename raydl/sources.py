"""Readers of fsspec URLs into lazy Ray Data datasets.

Each reader resolves ``paths`` (``s3://``, ``gs://``, ``file://``, plain local
paths, or any fsspec protocol) with ``storage_options`` into an fsspec
filesystem, bridges it to pyarrow with retries and an optional local disk cache
(:mod:`raydl._internal.fs`), and hands it to Ray Data's own reader. The result is
a ``ray.data.Dataset`` plan: nothing is read until it is iterated (for example by
:class:`raydl.RayDataLoader`), and ``map_batches``/``filter`` work as usual.

Listing: Ray lists the given paths on the driver when the plan is built, in
parallel Ray tasks when many paths are given. To spread the listing of a huge
bucket, pass its sub-prefixes (e.g. one per label) rather than the root.

The filesystem must be reachable from every Ray worker: ``memory://`` holds its
files in one process and is therefore not suitable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import fsspec
import pyarrow.fs as pafs
from fsspec.utils import get_protocol

from raydl._internal import cluster
from raydl._internal.cache import CacheConfig, CacheStats, DiskCache, as_cache_config
from raydl._internal.fs import (
    RemoteHandler,
    RetryPolicy,
    describe_endpoint,
    to_pyarrow,
)
from raydl.errors import RemoteReadError

if TYPE_CHECKING:
    import ray.data

__all__ = [
    "CacheConfig",
    "CacheStats",
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
    everything else goes through :class:`raydl._internal.fs.RemoteHandler`.

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
    **ray_options: Any,
) -> ray.data.Dataset:
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
        **ray_options: Passed to ``ray.data.read_parquet`` (e.g.
            ``override_num_blocks``, ``concurrency``, ``filter``).

    Returns:
        A ``ray.data.Dataset``; nothing has been read but the files' metadata.

    Raises:
        FileNotFoundError: A path does not exist (the message names it).
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
    import ray.data

    stripped, fs = resolve_filesystem(
        paths, filesystem=filesystem, storage_options=storage_options, cache=cache, retry=retry
    )
    cluster.ensure_ray()
    return ray.data.read_parquet(
        stripped,
        filesystem=fs,
        columns=list(columns) if columns is not None else None,
        include_paths=include_paths,
        **ray_options,
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
        **ray_options: Passed to ``ray.data.read_images`` (e.g. ``file_extensions``).

    Returns:
        A ``ray.data.Dataset`` with ``image`` (uint8 arrays) and ``path`` columns.

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

    stripped, fs = resolve_filesystem(
        paths, filesystem=filesystem, storage_options=storage_options, cache=cache, retry=retry
    )
    cluster.ensure_ray()
    return ray.data.read_images(
        stripped, filesystem=fs, include_paths=include_paths, size=size, mode=mode, **ray_options
    )


def read_binary_files(
    paths: PathsLike,
    *,
    filesystem: pafs.FileSystem | fsspec.AbstractFileSystem | None = None,
    storage_options: Mapping[str, Any] | None = None,
    include_paths: bool = True,
    cache: CacheLike = None,
    retry: RetryPolicy | None = None,
    **ray_options: Any,
) -> ray.data.Dataset:
    """A lazy dataset of whole objects as bytes (a ``bytes`` column, and ``path``).

    Args:
        paths: Files or prefixes, e.g. ``"s3://bucket/shards/"``.
        filesystem: A ready pyarrow or fsspec filesystem (see :func:`read_parquet`).
        storage_options: Passed to the fsspec filesystem.
        include_paths: Add a ``path`` column (the key without scheme).
        cache: A directory or :class:`CacheConfig` (see :func:`read_parquet`).
        retry: Retries of remote calls (default :class:`RetryPolicy()`).
        **ray_options: Passed to ``ray.data.read_binary_files``.

    Returns:
        A ``ray.data.Dataset`` with ``bytes`` and ``path`` columns.

    Example:
        >>> import raydl
        >>> ds = raydl.read_binary_files("s3://bucket/raw/", storage_options=opts)  # doctest: +SKIP
        >>> ds = ds.map_batches(decode)  # doctest: +SKIP
    """
    import ray.data

    stripped, fs = resolve_filesystem(
        paths, filesystem=filesystem, storage_options=storage_options, cache=cache, retry=retry
    )
    cluster.ensure_ray()
    return ray.data.read_binary_files(
        stripped, filesystem=fs, include_paths=include_paths, **ray_options
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
