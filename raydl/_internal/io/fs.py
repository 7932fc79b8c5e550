"""fsspec filesystems as pyarrow filesystems that Ray Data's readers can use.

Ray Data's file readers take a ``pyarrow.fs.FileSystem``; pyarrow bridges any
fsspec filesystem with ``PyFileSystem(FSSpecHandler(fs))``. raydl's handler
(:class:`RemoteHandler`) adds, around every remote call:

* bounded retries with exponential backoff (:class:`RetryPolicy`), so a server
  that restarts within the budget costs a delay, not the epoch;
* an error that names the endpoint and the object key when the budget runs out
  (:class:`RemoteReadError`);
* optionally, a local disk cache of whole objects (:mod:`raydl._internal.io.cache`,
  which is handed the key and a download callable, and imports nothing from here);
* a recursive listing of a prefix that lists its immediate sub-prefixes (one
  level, e.g. ``train/<label>/``) in parallel threads instead of paging through
  the whole prefix serially.

The handler is pickled into every Ray read task; it carries only the fsspec
filesystem (which pickles by its constructor arguments), the policy and the
cache configuration, so it works in worker processes on any node.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import random
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs

from raydl.errors import RemoteReadError

if TYPE_CHECKING:
    import fsspec

    from raydl._internal.io.cache import DiskCache

__all__ = [
    "LISTING_OPTIONS",
    "LISTING_THREADS",
    "RemoteHandler",
    "RemoteReadError",
    "RetryPolicy",
    "check_paths_exist",
    "describe_endpoint",
    "flush_cache",
    "list_files",
    "missing_path_error",
    "to_pyarrow",
    "without_cache",
]

T = TypeVar("T")

#: Threads that list the sub-prefixes of one prefix at once (see RemoteHandler.get_file_info_selector).
LISTING_THREADS = 16

# Errors that another attempt cannot fix: the object or the permission is missing.
_PERMANENT: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    ValueError,
    TypeError,
    NotImplementedError,
)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long remote calls are retried before :class:`RemoteReadError`.

    A call is retried on errors other than "not found", "permission denied" and
    argument errors, with exponential backoff from ``initial_backoff_s`` doubling
    up to ``max_backoff_s``, until ``attempts`` calls were made or ``deadline_s``
    seconds have passed since the first one, whichever comes first.

    Attributes:
        attempts: Calls in all (1 disables retries).
        initial_backoff_s: Sleep after the first failure.
        max_backoff_s: Largest sleep between two attempts.
        deadline_s: Give up once this much time has passed since the first attempt.

    Example:
        >>> RetryPolicy(attempts=3, deadline_s=5.0).attempts
        3
    """

    attempts: int = 8
    initial_backoff_s: float = 0.25
    max_backoff_s: float = 4.0
    deadline_s: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(
                f"attempts option should be a positive int (1 disables retries), got {self.attempts!r}"
            )
        for name in ("initial_backoff_s", "max_backoff_s", "deadline_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} option should be a non-negative number, got {value!r}")

    def call(self, fn: Callable[[], T], *, what: str, endpoint: str, key: str) -> T:
        """Run ``fn`` under this policy; raise :class:`RemoteReadError` naming ``endpoint``/``key``."""
        start = time.monotonic()
        delay = self.initial_backoff_s
        jitter = random.Random()  # backoff jitter only; no sample order depends on it
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except _PERMANENT:
                raise
            except Exception as err:
                elapsed = time.monotonic() - start
                sleep = min(delay, self.max_backoff_s) * (0.5 + jitter.random() / 2)
                if attempt >= self.attempts or elapsed + sleep > self.deadline_s:
                    raise RemoteReadError(
                        f"{what} of key {key!r} at {endpoint} failed after {attempt} attempt(s) "
                        f"in {elapsed:.1f}s: {type(err).__name__}: {err}. Check that the server "
                        "is up, or allow more time with retry=RetryPolicy(attempts=..., deadline_s=...)."
                    ) from err
                time.sleep(sleep)
                delay *= 2


def describe_endpoint(protocol: str, storage_options: Mapping[str, Any]) -> str:
    """A human-readable name of where ``protocol`` + ``storage_options`` point, for errors.

    Example:
        >>> describe_endpoint("s3", {"client_kwargs": {"endpoint_url": "http://127.0.0.1:8333"}})
        's3 endpoint http://127.0.0.1:8333'
    """
    client_kwargs = storage_options.get("client_kwargs") or {}
    url = (
        storage_options.get("endpoint_url")
        or client_kwargs.get("endpoint_url")
        or storage_options.get("endpoint")
    )
    if url:
        return f"{protocol} endpoint {url}"
    return f"{protocol}:// (default endpoint)"


class _RetryingFile(io.RawIOBase):
    """A read-only file over an fsspec object that reopens at its offset after a failure."""

    def __init__(self, handler: RemoteHandler, path: str, size: int | None) -> None:
        super().__init__()
        self._handler = handler
        self._path = path
        self._size = size
        self._pos = 0
        self._file: Any = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def size(self) -> int:
        if self._size is None:
            self._size = int(self._handler.info(self._path)["size"])
        return self._size

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        else:
            pos = self.size() + offset
        if pos < 0:
            raise ValueError(f"negative seek position {pos} in {self._path!r}")
        self._pos = pos
        return pos

    def _read_once(self, n: int) -> bytes:
        size = self._size
        if self._file is None and size is not None and (n < 0 or self._pos + n >= size):
            # The rest of the object (a whole image, a parquet footer): one ranged GET,
            # without opening a file (which costs another metadata request).
            if self._pos >= size:
                return b""
            data: bytes = self._handler.fs.cat_file(self._path, start=self._pos, end=size)
            return data
        if self._file is None:
            self._file = self._handler.fs.open(self._path, mode="rb", **self._known_size())
        try:
            if self._file.tell() != self._pos:
                self._file.seek(self._pos)
            data = self._file.read(n)
        except BaseException:
            self._drop_file()
            raise
        return data

    def _known_size(self) -> dict[str, int]:
        """``size=`` for filesystems whose ``open`` takes it (s3fs, gcsfs, http), saving a lookup."""
        fs_type: Any = type(self._handler.fs)
        if self._size is None or not _open_takes_size(fs_type):
            return {}
        return {"size": self._size}

    def read(self, size: int = -1) -> bytes:
        data = self._handler.call(lambda: self._read_once(size), "read", self._path)
        self._pos += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def _drop_file(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            # Closing a broken connection may fail again; there is nothing to keep.
            with contextlib.suppress(Exception):
                file.close()

    def close(self) -> None:
        self._drop_file()
        super().close()


@functools.cache
def _open_takes_size(fs_type: Any) -> bool:
    return "size" in inspect.signature(fs_type._open).parameters


class RemoteHandler(pafs.FSSpecHandler):
    """``FSSpecHandler`` with retries, endpoint-naming errors and an optional disk cache.

    Args:
        fs: The fsspec filesystem to read.
        endpoint: Where ``fs`` points (see :func:`describe_endpoint`), for error messages.
        retry: The retry policy of every remote call.
        cache: A disk cache of whole objects, or ``None`` to read remote each time.
        listing_threads: Sub-prefixes listed at once by a recursive listing
            (1 lists the whole prefix in one serial walk).
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        *,
        endpoint: str,
        retry: RetryPolicy,
        cache: DiskCache | None = None,
        listing_threads: int = LISTING_THREADS,
    ) -> None:
        super().__init__(fs)
        self.endpoint = endpoint
        self.retry = retry
        self.cache = cache
        self.listing_threads = listing_threads

    def without_cache(self) -> RemoteHandler:
        """The same handler without its disk cache (for reads that need only a few bytes)."""
        return RemoteHandler(
            self.fs,
            endpoint=self.endpoint,
            retry=self.retry,
            cache=None,
            listing_threads=self.listing_threads,
        )

    def call(self, fn: Callable[[], T], what: str, key: str) -> T:
        """Run one remote call under the retry policy."""
        return self.retry.call(fn, what=what, endpoint=self.endpoint, key=key)

    def info(self, path: str) -> dict[str, Any]:
        """fsspec's ``info`` of ``path``, retried; raises ``FileNotFoundError`` naming the key."""
        try:
            info: dict[str, Any] = self.call(lambda: self.fs.info(path), "metadata lookup", path)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"no object {path!r} at {self.endpoint}") from err
        return info

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.call(
            lambda: super(RemoteHandler, self).get_file_info(paths),
            "metadata lookup",
            paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} more)",
        )

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        """List ``selector.base_dir``; a recursive listing fans out over its sub-prefixes.

        Ray Data lists a single prefix with one recursive selector, which an
        object store answers page by page, serially. Here the prefix is listed
        one level deep first, then each sub-prefix (e.g. ``train/<label>/``) is
        listed recursively in its own thread. The result holds the same entries,
        sorted by path; a missing prefix raises ``FileNotFoundError`` naming it.
        """
        if not selector.recursive or self.listing_threads <= 1:
            return self._list(selector)
        top = self._list(
            pafs.FileSelector(
                selector.base_dir, recursive=False, allow_not_found=selector.allow_not_found
            )
        )
        subdirs = [info.path for info in top if info.type == pafs.FileType.Directory]
        if not subdirs:
            return sorted(top, key=lambda info: info.path)
        with ThreadPoolExecutor(
            max_workers=min(self.listing_threads, len(subdirs)), thread_name_prefix="raydl-list"
        ) as pool:
            below = list(pool.map(self._find_below, subdirs))
        infos = top + [info for infos in below for info in infos]
        return sorted(infos, key=lambda info: info.path)

    def _list(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.call(
            lambda: super(RemoteHandler, self).get_file_info_selector(selector),
            "listing",
            selector.base_dir,
        )

    def _find_below(self, prefix: str) -> list[pafs.FileInfo]:
        """Every entry under the directory ``prefix`` (not ``prefix`` itself), as pyarrow lists it."""
        found = self.call(
            lambda: self.fs.find(prefix, withdirs=True, detail=True), "listing", prefix
        )
        base = prefix.strip("/")
        return [
            self._create_file_info(path, info)
            for path, info in found.items()
            if path.strip("/") != base
        ]

    def open_input_file(self, path: str) -> pa.NativeFile:
        info = self.info(path)
        if info.get("type") == "directory":
            raise IsADirectoryError(f"{path!r} at {self.endpoint} is a directory, not an object")
        if self.cache is not None:
            local = self.cache.fetch(path, info, self._downloader(path), endpoint=self.endpoint)
            return pa.memory_map(local, "r")
        size = info.get("size")
        return pa.PythonFile(
            _RetryingFile(self, path, None if size is None else int(size)), mode="r"
        )

    def open_input_stream(self, path: str) -> pa.NativeFile:
        return self.open_input_file(path)

    def _downloader(self, path: str) -> Callable[[str], None]:
        """The disk cache's download of ``path``: fsspec's ``get_file``, retried."""

        def download(local: str) -> None:
            self.call(lambda: self.fs.get_file(path, local), "download", path)

        return download


def flush_cache(filesystem: pafs.FileSystem) -> None:
    """Write the disk cache counters of ``filesystem``, if it reads through one.

    raydl's read tasks call it when they end (see :mod:`raydl._internal.io.cache`).
    """
    handler = getattr(filesystem, "handler", None)
    if isinstance(handler, RemoteHandler) and handler.cache is not None:
        handler.cache.flush()


def without_cache(filesystem: pafs.FileSystem) -> pafs.FileSystem:
    """``filesystem`` without its disk cache: a read of a few bytes (a parquet footer)
    must not download the whole file."""
    handler = getattr(filesystem, "handler", None)
    if isinstance(filesystem, pafs.PyFileSystem) and isinstance(handler, RemoteHandler):
        return to_pyarrow(handler.without_cache())
    return filesystem


def to_pyarrow(handler: RemoteHandler) -> pafs.PyFileSystem:
    """The pyarrow filesystem that Ray Data's readers take."""
    return pafs.PyFileSystem(handler)


#: The readers' options that :func:`list_files` applies (before Ray sees the file list).
LISTING_OPTIONS = frozenset({"file_extensions", "ignore_missing_paths", "partition_filter"})


def list_files(
    filesystem: pafs.FileSystem,
    paths: list[str],
    *,
    file_extensions: list[str] | None = None,
    ignore_missing_paths: bool = False,
    partition_filter: Callable[[list[str]], list[str]] | None = None,
    exclude: frozenset[str] = frozenset(),
    reader: str | None = None,
    written: list[str] | None = None,
) -> list[tuple[str, int | None]]:
    """``(path, size)`` of the files Ray Data's file readers would read under ``paths``.

    Ray Data's rules: a file path is itself; a directory is listed recursively
    (sorted by path), leaving out entries whose path relative to it starts with
    ``.`` or ``_``; then ``file_extensions`` (case-insensitive) and
    ``partition_filter`` apply. Paths in ``exclude`` are left out.

    Args:
        reader: The public reader that lists (``"read_parquet"``): its errors start
            with its name, and finding no file at all is an error too.
        written: ``paths`` as the user wrote them (with their scheme), for errors.

    Raises:
        FileNotFoundError: A path does not exist (unless ``ignore_missing_paths``),
            or, with ``reader``, no file is left; the message names the paths as
            written, what was looked for and the fix.
    """
    extensions = None
    if file_extensions is not None:
        extensions = tuple("." + e.lower().lstrip(".") for e in file_extensions)
    shown = dict(zip(paths, written or paths, strict=True))
    excluded: list[str] = []  # appended from the listing threads

    def expand(path: str, info: pafs.FileInfo) -> list[tuple[str, int | None]]:
        if path in exclude:
            excluded.append(path)
            return []
        if info.type == pafs.FileType.File:
            return [(path, info.size)]
        if info.type == pafs.FileType.NotFound:
            if ignore_missing_paths:
                return []
            raise missing_path_error(filesystem, shown[path], reader)
        selector = pafs.FileSelector(path, recursive=True, allow_not_found=ignore_missing_paths)
        out = []
        for entry in filesystem.get_file_info(selector):
            if not entry.is_file or not entry.path.startswith(selector.base_dir):
                continue
            relative = entry.path[len(selector.base_dir) :].lstrip("/")
            if relative.startswith((".", "_")):
                continue
            if entry.path in exclude:
                excluded.append(entry.path)
                continue
            out.append((entry.path, entry.size))
        return sorted(out)

    def expand_all(chunk: list[str]) -> list[list[tuple[str, int | None]]]:
        # One metadata call for the chunk's paths (a local listing of thousands of
        # files: ~12 ms, against ~150 ms one call per path).
        infos = filesystem.get_file_info(chunk)
        return [expand(path, info) for path, info in zip(chunk, infos, strict=True)]

    # Contiguous chunks, one per thread: a remote store answers them at once.
    step = max(1, -(-len(paths) // LISTING_THREADS))
    chunks = [paths[i : i + step] for i in range(0, len(paths), step)]
    if len(chunks) <= 1:
        expanded = [part for chunk in chunks for part in expand_all(chunk)]
    else:
        with ThreadPoolExecutor(max_workers=len(chunks), thread_name_prefix="raydl-list") as pool:
            expanded = [part for parts in pool.map(expand_all, chunks) for part in parts]
    listed = [f for part in expanded for f in part]
    files = listed
    if extensions is not None:
        files = [f for f in files if f[0].lower().endswith(extensions)]
    matched = len(files)
    if partition_filter is not None and files:
        kept = set(partition_filter([p for p, _ in files]))
        files = [f for f in files if f[0] in kept]
    if not files and reader is not None:
        where = _describe_paths([shown[p] for p in paths], filesystem)
        if matched:
            raise FileNotFoundError(
                f"{reader}: partition_filter left none of the {matched} files under {where}; "
                "check that it returns the paths it keeps, as they are listed"
            )
        if excluded and not listed:
            raise FileNotFoundError(
                f"{reader}: skip_paths left none of the {len(excluded)} files under {where}; "
                "leave out fewer of them"
            )
        raise FileNotFoundError(_no_files_message(reader, where, extensions, listed))
    return files


def missing_path_error(
    filesystem: pafs.FileSystem, written: str, reader: str | None
) -> FileNotFoundError:
    """The error for a path of a reader (``reader``) that does not exist (``written``: as the user wrote it)."""
    prefix = f"{reader}: " if reader else ""
    return FileNotFoundError(
        f"{prefix}path {written!r} does not exist{_at(filesystem)}. Check its spelling and that "
        "it is reachable from this machine, or pass ignore_missing_paths=True to read the paths "
        "that exist"
    )


def check_paths_exist(
    filesystem: pafs.FileSystem,
    paths: list[str],
    *,
    reader: str,
    written: list[str],
    ignore_missing_paths: bool,
) -> None:
    """Raise :func:`missing_path_error` for the first of ``paths`` that does not exist.

    For the readers that leave the listing to Ray Data: a missing path is named
    before Ray starts (one metadata lookup per path, no listing).
    """
    if ignore_missing_paths:
        return
    infos = filesystem.get_file_info(paths)
    for info, shown in zip(infos, written, strict=True):
        if info.type == pafs.FileType.NotFound:
            raise missing_path_error(filesystem, shown, reader)


def _at(filesystem: pafs.FileSystem) -> str:
    handler = getattr(filesystem, "handler", None)
    return f" at {handler.endpoint}" if isinstance(handler, RemoteHandler) else ""


def _describe_paths(written: list[str], filesystem: pafs.FileSystem) -> str:
    shown = repr(written[0]) if len(written) == 1 else f"{written[:3]!r}"
    if len(written) > 3:
        shown = f"{shown[:-1]}, ...] ({len(written)} paths)"
    return f"{shown}{_at(filesystem)}"


def _no_files_message(
    reader: str,
    where: str,
    extensions: tuple[str, ...] | None,
    listed: list[tuple[str, int | None]],
) -> str:
    """Why a listing found no file to read: what was looked for, what was there, the fix."""
    hidden = "names starting with '.' or '_' are left out"
    if extensions is None:
        return (
            f"{reader} found no files under {where} ({hidden}). Point paths at the files "
            "or their folder"
        )
    looked_for = " or ".join(extensions)
    if not listed:
        others = "no other files"
    else:
        plural = "file" if len(listed) == 1 else "files"
        others = f"{len(listed)} other {plural}, e.g. {listed[0][0]!r}"
    return (
        f"{reader} found no files ending in {looked_for} under {where} ({others}; {hidden}). "
        "Point paths at the files or their folder, or pass file_extensions=[...] to read "
        "files named otherwise"
    )
