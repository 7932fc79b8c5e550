"""A local disk cache of remote objects, shared by every Ray worker on a node.

Layout of a cache directory::

    <dir>/objects/<ab>/<sha256>   whole objects, named by (endpoint, key, version)
    <dir>/tmp/                    downloads in progress (renamed into objects/ when done)
    <dir>/stats/<host>-<pid>.json hit/miss counters of each process
    <dir>/.lock                   held while evicting

The cache knows nothing of filesystems: :meth:`DiskCache.fetch` is given the
object's key, its metadata and a callable that downloads it to a local path
(:class:`raydl._internal.io.fs.RemoteHandler` passes its retried ``get_file``).

* **Validation.** An entry's name hashes the endpoint, the key and the object's
  version as the server reports it (ETag, else size and modification time).
  Each open looks the object up (one metadata request), so a changed object
  has a new name and is fetched again; the stale entry ages out.
* **Atomic fill.** A download goes to a private file in ``tmp/`` and is
  ``os.replace``-d into place, so several workers may fetch the same object at
  once and a reader never sees half an entry.
* **LRU, bounded.** A hit touches the entry's mtime. After downloads, a process
  scans the directory (under ``.lock``) and deletes the least recently used
  entries until the total is at most ``max_bytes``. It scans when its own
  estimate says the bound is crossed, or after ``max_bytes / 16`` bytes or one
  second of its own downloads, so concurrent writers overshoot the bound by at
  most that much each, briefly. An entry deleted while a reader has it open
  stays readable (POSIX unlink semantics).
* **Counters written rarely.** Hits, misses, fetched bytes and evictions are
  counted in memory, per process and directory, and written to the process's
  stats file only by :meth:`DiskCache.flush`: raydl's read tasks and direct runs
  flush when they end, a :class:`DiskCache` flushes when it is closed or
  garbage-collected (a Ray read task's copy is dropped when the task ends), the
  process flushes at exit, and :meth:`CacheConfig.stats` flushes this process's
  own counters before it reads the files. A hit therefore costs a ``stat`` and
  an ``utime``, not a file rewrite.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["CacheConfig", "CacheStats", "DiskCache", "as_cache_config", "version_token"]

_OBJECTS = "objects"
_TMP = "tmp"
_STATS = "stats"
_SCAN_INTERVAL_S = 1.0
_COUNTER_KEYS = ("hits", "misses", "bytes_fetched", "evictions")


class _ProcessCounters:
    """This process's counters per cache directory, and which changed since they were written.

    Read tasks come and go (each unpickles its own :class:`DiskCache`); the process
    stays, so its totals live here and are written to ``<dir>/stats/<host>-<pid>.json``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a task's reading threads count at once
        self._counts: dict[str, dict[str, int]] = {}
        self._dirty: set[str] = set()

    def add(self, directory: str, deltas: Mapping[str, int]) -> None:
        """Add ``deltas`` to ``directory``'s counters (in memory only)."""
        with self._lock:
            counts = self._counts.setdefault(directory, dict.fromkeys(_COUNTER_KEYS, 0))
            for k, v in deltas.items():
                counts[k] += v
            self._dirty.add(directory)

    def flush(self, directory: str | None = None) -> None:
        """Write the changed counters of ``directory`` (of every directory when ``None``)."""
        with self._lock:
            for each in [directory] if directory is not None else sorted(self._dirty):
                if each not in self._dirty:
                    continue
                _write_counts(each, self._counts[each])
                self._dirty.discard(each)

    def forget(self, directory: str) -> None:
        """Drop ``directory``'s counters (its stats files were deleted)."""
        with self._lock:
            self._counts.pop(directory, None)
            self._dirty.discard(directory)

    def reset(self) -> None:
        """Start over (in a forked child: the parent's counts are the parent's to write)."""
        self._lock = threading.Lock()
        self._counts = {}
        self._dirty = set()


def _write_counts(directory: str, counts: Mapping[str, int]) -> None:
    """Replace this process's stats file in ``directory`` with ``counts`` (atomically)."""
    stats_dir = os.path.join(directory, _STATS)
    name = f"{socket.gethostname()}-{os.getpid()}"
    tmp = os.path.join(stats_dir, f".{name}.{uuid.uuid4().hex}")
    try:
        os.makedirs(stats_dir, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(dict(counts), f)
        os.replace(tmp, os.path.join(stats_dir, f"{name}.json"))
    except FileNotFoundError:  # the directory was deleted meanwhile: nothing to count into
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


_process_counts = _ProcessCounters()
atexit.register(_process_counts.flush)
os.register_at_fork(after_in_child=_process_counts.reset)


@dataclass(frozen=True)
class CacheStats:
    """Counters summed over every process that used one cache directory.

    Attributes:
        hits: Opens served from the cache.
        misses: Opens that fetched the object (first read, or the object changed).
        bytes_fetched: Bytes downloaded into the cache.
        evictions: Entries deleted to stay under ``max_bytes``.
        entries: Entries in the cache now.
        bytes: Their total size now.
    """

    hits: int
    misses: int
    bytes_fetched: int
    evictions: int
    entries: int
    bytes: int


@dataclass(frozen=True)
class CacheConfig:
    """A local disk cache for remote reads (pass as ``cache=`` to raydl's readers).

    The directory must be on a local disk of each node (every Ray worker of a
    node shares it); it is created when first used.

    Attributes:
        dir: Cache directory.
        max_bytes: Bound on the cached bytes (least recently used entries are
            evicted), or ``None`` for no bound.

    Example:
        >>> cfg = CacheConfig("/tmp/raydl-cache", max_bytes=10 * 2**30)
        >>> cfg.max_bytes
        10737418240
    """

    dir: str
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dir, (str, os.PathLike)) or not str(self.dir):
            raise TypeError(f"dir option should be a non-empty path, got {self.dir!r}")
        object.__setattr__(self, "dir", os.path.abspath(os.fspath(self.dir)))
        if self.max_bytes is not None and (
            not isinstance(self.max_bytes, int) or self.max_bytes <= 0
        ):
            raise ValueError(
                f"max_bytes option should be a positive int or None (no bound), got {self.max_bytes!r}"
            )

    def stats(self) -> CacheStats:
        """Counters of every process that used this directory, and its current size.

        This process's own counters are written first. Another process's counters
        are as it last flushed them: when its last read task ended (see the module
        docstring).
        """
        _process_counts.flush(self.dir)
        totals = dict.fromkeys(_COUNTER_KEYS, 0)
        stats_dir = os.path.join(self.dir, _STATS)
        for name in _listdir(stats_dir):
            if not name.endswith(".json"):
                continue
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(stats_dir, name)) as f:
                    counts = json.load(f)
                for k in totals:
                    totals[k] += int(counts.get(k, 0))
        entries = _scan(os.path.join(self.dir, _OBJECTS))
        return CacheStats(**totals, entries=len(entries), bytes=sum(size for _, size, _ in entries))

    def clear(self) -> None:
        """Delete every entry and counter (the directory itself stays).

        Call it while no reader uses the directory: a worker process that is
        still alive writes its running totals again at its next flush.
        """
        for path, _, _ in _scan(os.path.join(self.dir, _OBJECTS)):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        stats_dir = os.path.join(self.dir, _STATS)
        for name in _listdir(stats_dir):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(stats_dir, name))
        _process_counts.forget(self.dir)


def as_cache_config(cache: CacheConfig | str | os.PathLike[str] | None) -> CacheConfig | None:
    """Normalise a reader's ``cache=`` argument (a directory means no size bound)."""
    if cache is None or isinstance(cache, CacheConfig):
        return cache
    if isinstance(cache, (str, os.PathLike)):
        return CacheConfig(os.fspath(cache))
    raise TypeError(
        "cache option should be a directory path, a raydl.CacheConfig or None, "
        f"got {type(cache).__name__}"
    )


def version_token(info: Mapping[str, Any]) -> str:
    """What identifies one version of an object: its ETag, else its size and mtime."""
    size = info.get("size")
    etag = info.get("ETag") or info.get("etag") or info.get("md5Hash")
    if etag:
        return f"etag={str(etag).strip(chr(34))};size={size}"
    mtime: Any = info.get("mtime") or info.get("LastModified") or info.get("last_modified")
    if hasattr(mtime, "timestamp"):
        mtime = mtime.timestamp()
    return f"size={size};mtime={mtime}"


class DiskCache:
    """The cache of one :class:`CacheConfig`, as used inside one process.

    Pickles as its configuration; each process keeps its own counters per
    directory, written by :meth:`flush` (called on :meth:`close` and when the object
    is garbage-collected, too).

    Example:
        >>> import pathlib, tempfile
        >>> cache = DiskCache(CacheConfig(tempfile.mkdtemp()))
        >>> download = lambda local: pathlib.Path(local).write_bytes(b"abc")
        >>> info = {"size": 3, "ETag": "v1"}
        >>> local = cache.fetch("bucket/k.bin", info, download, endpoint="s3 endpoint http://h")
        >>> pathlib.Path(local).read_bytes()
        b'abc'
        >>> cache.close()
        >>> (cache.config.stats().misses, cache.config.stats().hits)
        (1, 0)
    """

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self._estimate: int | None = None
        self._written_since_scan = 0
        self._last_scan = 0.0
        # A read task fetches several files at once (files._Reader.READ_THREADS).
        self._lock = threading.Lock()
        # A read task's copy is dropped when the task ends: its counts are written then.
        self._finalizer = weakref.finalize(self, _process_counts.flush, config.dir)

    def __reduce__(self) -> tuple[Any, ...]:
        return (DiskCache, (self.config,))

    def flush(self) -> None:
        """Write this process's counters of the cache directory, if they changed."""
        _process_counts.flush(self.config.dir)

    def close(self) -> None:
        """Write the counters (the cache holds nothing else to release); idempotent."""
        self._finalizer()

    def entry_path(self, endpoint: str, path: str, info: Mapping[str, Any]) -> str:
        """Where the entry of this version of ``path`` at ``endpoint`` lives."""
        digest = hashlib.sha256(
            "\0".join((endpoint, path, version_token(info))).encode()
        ).hexdigest()
        return os.path.join(self.config.dir, _OBJECTS, digest[:2], digest)

    def fetch(
        self,
        key: str,
        info: Mapping[str, Any],
        download: Callable[[str], object],
        *,
        endpoint: str,
    ) -> str:
        """The local path of ``key``'s current version, downloading it on a miss.

        Args:
            key: The object's key (its path in its filesystem).
            info: Its metadata as its filesystem reports it (``size`` and the
                ETag or modification time: they name the version).
            download: Writes the object's bytes to the local path it is given
                (retrying as it sees fit); called on a miss only.
            endpoint: Where the object lives: part of the entry's name, and named
                by errors.

        Raises:
            OSError: The download's size is not ``info``'s (the object changed
                while it was read); nothing is cached.
        """
        final = self.entry_path(endpoint, key, info)
        size = info.get("size")
        try:
            st = os.stat(final)
        except FileNotFoundError:
            pass
        else:
            if size is None or st.st_size == int(size):
                with contextlib.suppress(FileNotFoundError):
                    os.utime(final)  # LRU: a hit makes the entry the newest
                    self._count(hits=1)
                    return final
        fetched = self._download(key, download, endpoint, final, size)
        self._count(misses=1, bytes_fetched=fetched)
        with self._lock:
            self._written_since_scan += fetched
            self._maybe_evict()
        return final

    def _download(
        self, key: str, download: Callable[[str], object], endpoint: str, final: str, size: Any
    ) -> int:
        tmp_dir = os.path.join(self.config.dir, _TMP)
        os.makedirs(tmp_dir, exist_ok=True)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = os.path.join(tmp_dir, f"{os.path.basename(final)}.{os.getpid()}.{uuid.uuid4().hex}")
        try:
            download(tmp)
            got = os.path.getsize(tmp)
            if size is not None and got != int(size):
                raise OSError(
                    f"download of key {key!r} at {endpoint} got {got} bytes, "
                    f"expected {int(size)}: the object changed while it was read; retry the epoch"
                )
            os.replace(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        return got

    def _maybe_evict(self) -> None:
        """Evict the least recently used entries past ``max_bytes`` (holding ``self._lock``)."""
        max_bytes = self.config.max_bytes
        if max_bytes is None:
            return
        estimate = (self._estimate or 0) + self._written_since_scan
        if (
            self._estimate is not None
            and estimate <= max_bytes
            and self._written_since_scan < max_bytes // 16
            and time.monotonic() - self._last_scan < _SCAN_INTERVAL_S
        ):
            return
        lock_path = os.path.join(self.config.dir, ".lock")
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                entries = _scan(os.path.join(self.config.dir, _OBJECTS))
                total = sum(size for _, size, _ in entries)
                evicted = 0
                for entry, size, _ in sorted(entries, key=lambda e: e[2]):
                    if total <= max_bytes:
                        break
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(entry)
                        evicted += 1
                    total -= size
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        self._estimate = total
        self._written_since_scan = 0
        self._last_scan = time.monotonic()
        if evicted:
            self._count(evictions=evicted)

    def _count(self, **deltas: int) -> None:
        _process_counts.add(self.config.dir, deltas)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def _scan(objects_dir: str) -> list[tuple[str, int, float]]:
    """(path, size, mtime) of every entry under ``objects_dir``."""
    out: list[tuple[str, int, float]] = []
    for sub in _listdir(objects_dir):
        sub_path = os.path.join(objects_dir, sub)
        try:
            with os.scandir(sub_path) as it:
                for e in it:
                    with contextlib.suppress(FileNotFoundError):
                        st = e.stat()
                        out.append((e.path, st.st_size, st.st_mtime))
        except (FileNotFoundError, NotADirectoryError):
            continue
    return out
