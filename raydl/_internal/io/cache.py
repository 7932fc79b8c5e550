"""A local disk cache of remote objects, shared by every Ray worker on a node.

Layout of a cache directory::

    <dir>/objects/<ab>/<sha256>   whole objects, named by (endpoint, key, version)
    <dir>/tmp/                    downloads in progress (renamed into objects/ when done)
    <dir>/stats/<host>-<pid>.json hit/miss counters of each process
    <dir>/.lock                   held while evicting

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
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raydl._internal.io.fs import RemoteHandler

__all__ = ["CacheConfig", "CacheStats", "DiskCache"]

_OBJECTS = "objects"
_TMP = "tmp"
_STATS = "stats"
_SCAN_INTERVAL_S = 1.0
_COUNTER_KEYS = ("hits", "misses", "bytes_fetched", "evictions")
# Counters of this process per cache directory (read tasks come and go; the process stays).
_process_counts: dict[str, dict[str, int]] = {}
_counts_lock = threading.Lock()


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
        """Counters of every process that used this directory, and its current size."""
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
        still alive writes its running totals again at its next open.
        """
        for path, _, _ in _scan(os.path.join(self.dir, _OBJECTS)):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        stats_dir = os.path.join(self.dir, _STATS)
        for name in _listdir(stats_dir):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(stats_dir, name))
        _process_counts.pop(self.dir, None)


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


def version_token(info: dict[str, Any]) -> str:
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

    Pickles as its configuration; each process keeps its own counters per directory.
    """

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self._estimate: int | None = None
        self._written_since_scan = 0
        self._last_scan = 0.0
        # A read task fetches several files at once (files._Reader.READ_THREADS).
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        return (DiskCache, (self.config,))

    def entry_path(self, endpoint: str, path: str, info: dict[str, Any]) -> str:
        """Where the entry of this version of ``path`` at ``endpoint`` lives."""
        digest = hashlib.sha256(
            "\0".join((endpoint, path, version_token(info))).encode()
        ).hexdigest()
        return os.path.join(self.config.dir, _OBJECTS, digest[:2], digest)

    def fetch(self, handler: RemoteHandler, path: str, info: dict[str, Any]) -> str:
        """The local path of ``path``'s current version, downloading it on a miss."""
        final = self.entry_path(handler.endpoint, path, info)
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
        fetched = self._download(handler, path, final, size)
        self._count(misses=1, bytes_fetched=fetched)
        with self._lock:
            self._written_since_scan += fetched
            self._maybe_evict()
        return final

    def _download(self, handler: RemoteHandler, path: str, final: str, size: Any) -> int:
        tmp_dir = os.path.join(self.config.dir, _TMP)
        os.makedirs(tmp_dir, exist_ok=True)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = os.path.join(tmp_dir, f"{os.path.basename(final)}.{os.getpid()}.{uuid.uuid4().hex}")
        try:
            handler.call(lambda: handler.fs.get_file(path, tmp), "download", path)
            got = os.path.getsize(tmp)
            if size is not None and got != int(size):
                raise OSError(
                    f"download of key {path!r} at {handler.endpoint} got {got} bytes, "
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
        with _counts_lock:  # a task's reading threads count at once
            counts = _process_counts.setdefault(self.config.dir, dict.fromkeys(_COUNTER_KEYS, 0))
            for k, v in deltas.items():
                counts[k] += v
            stats_dir = os.path.join(self.config.dir, _STATS)
            os.makedirs(stats_dir, exist_ok=True)
            name = f"{socket.gethostname()}-{os.getpid()}"
            tmp = os.path.join(stats_dir, f".{name}.{uuid.uuid4().hex}")
            with open(tmp, "w") as f:
                json.dump(counts, f)
            os.replace(tmp, os.path.join(stats_dir, f"{name}.json"))


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
