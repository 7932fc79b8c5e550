"""The opt-in ``on_bad_file="skip"`` policy of raydl's readers, and its ledger.

A *bad file* is one whose bytes cannot be read or decoded: a corrupt or
truncated parquet file, a text file named ``.jpg``, an empty file. With the
default policy (``"raise"``) reading it is an error that names the file. With
``"skip"`` the file is left out whole (none of its rows, never part of them),
a warning names it and the reason, and it is recorded in the *ledger*.

What is never skipped: a remote that stays down past the retry budget
(:class:`raydl.RemoteReadError`), errors that Ray Data itself retries
(``DataContext.retried_io_errors``), and ``MemoryError``. A failing server is
not a bad file: skipping would silently drop everything it serves.

The ledger is a named Ray actor per Ray job (namespace ``"raydl"``,
``num_cpus=0``). The driver creates it when it builds a plan with the skip
policy, so it lives as long as the driver's job; read tasks look it up by name
and record what they skipped, once per path. :func:`snapshot` reads it on the
driver.

How each reader skips, without re-implementing Ray Data's readers:

* images and binary files: subclasses of Ray Data's ``ImageDatasource`` /
  ``BinaryDatasource`` whose per-file read decodes the whole file before
  yielding anything, so a failure leaves out exactly that file;
* parquet: the files' footers are read in parallel threads when the plan is
  built, and the bad ones are handed to Ray Data's ``read_parquet`` as
  ``skip_paths``. A file whose footer is valid but whose data pages are
  corrupt still fails the read, with an error naming it.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

import pyarrow.fs as pafs
from ray.data._internal.datasource.binary_datasource import BinaryDatasource
from ray.data._internal.datasource.image_datasource import ImageDatasource

from raydl._internal.io.fs import LISTING_THREADS
from raydl.errors import RemoteReadError

if TYPE_CHECKING:
    import pyarrow as pa
    from ray.actor import ActorHandle
    from ray.data.block import Block

__all__ = [
    "BadFilePolicy",
    "SkippingBinaryDatasource",
    "SkippingImageDatasource",
    "find_bad_parquet_files",
    "ledger",
    "record_skip",
    "snapshot",
    "validate_policy",
]

BadFilePolicy = Literal["raise", "skip"]

logger = logging.getLogger("raydl")

NAMESPACE = "raydl"
# Errors that say nothing about the file's bytes: never a reason to skip it.
_NEVER_SKIPPED: tuple[type[BaseException], ...] = (RemoteReadError, MemoryError)
_MAX_REASON_CHARS = 500


def validate_policy(on_bad_file: object) -> BadFilePolicy:
    """``on_bad_file`` if it is ``"raise"`` or ``"skip"``; a ``ValueError`` naming it otherwise."""
    if on_bad_file == "raise":
        return "raise"
    if on_bad_file == "skip":
        return "skip"
    raise ValueError(
        f"on_bad_file option should be 'raise' (an error names the bad file) or 'skip' "
        f"(leave it out, warn and record it), got {on_bad_file!r}"
    )


class _SkipLedger:
    """The Ray actor that remembers each skipped file once, in the order they were skipped."""

    def __init__(self) -> None:
        self._reasons: dict[str, str] = {}

    def record(self, path: str, reason: str) -> None:
        self._reasons.setdefault(path, reason)

    def entries(self) -> list[dict[str, str]]:
        return [{"path": path, "reason": reason} for path, reason in self._reasons.items()]


def _ledger_name() -> str:
    import ray

    return f"skipped-files-{ray.get_runtime_context().get_job_id()}"


# Handles this process holds, per (node, job): a named actor whose every handle is
# dropped is destroyed, so the driver keeps the one it created for as long as it lives.
_handles: dict[tuple[str, str], Any] = {}


def ledger() -> ActorHandle[_SkipLedger]:
    """This Ray job's ledger actor, created on first use (Ray must be initialised)."""
    import ray

    context = ray.get_runtime_context()
    key = (context.get_node_id(), context.get_job_id())
    handle: ActorHandle[_SkipLedger] | None = _handles.get(key)
    if handle is None:
        actor_cls: Any = ray.remote(num_cpus=0)(_SkipLedger)
        handle = actor_cls.options(
            name=_ledger_name(), namespace=NAMESPACE, get_if_exists=True, num_cpus=0
        ).remote()
        _handles.clear()  # handles of an earlier Ray instance are dead
        _handles[key] = handle
    return handle


def snapshot() -> list[dict[str, str]]:
    """The files skipped so far in this Ray job, as ``{"path": ..., "reason": ...}`` dicts.

    Each path appears once (the first reason is kept), in the order the files
    were skipped. ``[]`` when Ray is not initialised or nothing was read with
    ``on_bad_file="skip"``.

    Example:
        >>> snapshot()  # doctest: +SKIP
        [{'path': 'bucket/train/3/x.jpeg', 'reason': "ValueError: PIL couldn't load image ..."}]
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return []
    try:
        actor = ray.get_actor(_ledger_name(), namespace=NAMESPACE)
    except ValueError:
        return []
    entries: list[dict[str, str]] = ray.get(actor.entries.remote())
    return entries


def record_skip(path: str, reason: str | BaseException) -> None:
    """Warn that ``path`` was skipped and why, and record it in the ledger."""
    import ray

    if isinstance(reason, BaseException):
        reason = f"{type(reason).__name__}: {reason}"
    reason = reason[:_MAX_REASON_CHARS]
    logger.warning("raydl skipped bad file %r (on_bad_file='skip'): %s", path, reason)
    ray.get(ledger().record.remote(path, reason))


def _is_retried_by_ray(err: BaseException, patterns: Sequence[str]) -> bool:
    message = str(err)
    for pattern in patterns:
        if pattern in message:
            return True
        try:
            if re.search(pattern, message):
                return True
        except re.error:
            continue
    return False


def skippable(err: BaseException, retried_patterns: Sequence[str]) -> bool:
    """Whether ``on_bad_file="skip"`` may skip a file for ``err``.

    Never: remote failures past the retry budget, memory errors, and errors Ray
    retries (their task runs again instead).
    """
    if isinstance(err, _NEVER_SKIPPED):
        return False
    return not _is_retried_by_ray(err, retried_patterns)


class _Unreadable:
    """Stands in for a file that could not be opened, so the per-file read can skip it."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __enter__(self) -> _Unreadable:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _SkipBadFilesMixin:
    """Per-file ``_open_input_source``/``_read_stream`` of a ``FileBasedDatasource`` that skip.

    The whole file is decoded before any block is yielded, so a failure drops
    exactly that file's rows.
    """

    _data_context: Any

    def _open_input_source(
        self, filesystem: pafs.FileSystem, path: str, **open_args: Any
    ) -> pa.NativeFile | _Unreadable:
        try:
            return super()._open_input_source(filesystem, path, **open_args)  # type: ignore[misc]
        except Exception as err:
            if not self._skippable(err):
                raise
            return _Unreadable(err)

    def _read_stream(self, f: pa.NativeFile | _Unreadable, path: str) -> Iterator[Block]:
        if isinstance(f, _Unreadable):
            record_skip(path, f.error)
            return
        read: Callable[[Any, str], Iterator[Block]] = super()._read_stream  # type: ignore[misc]
        try:
            blocks = list(read(f, path))
        except Exception as err:
            if not self._skippable(err):
                raise
            record_skip(path, err)
            return
        yield from blocks

    def _skippable(self, err: BaseException) -> bool:
        return skippable(err, self._data_context.retried_io_errors or ())


class SkippingImageDatasource(_SkipBadFilesMixin, ImageDatasource):
    """Ray Data's ``ImageDatasource`` that skips images it cannot read or decode."""


class SkippingBinaryDatasource(_SkipBadFilesMixin, BinaryDatasource):
    """Ray Data's ``BinaryDatasource`` that skips files it cannot read."""


def _parquet_footer_error(filesystem: pafs.FileSystem, path: str, size: int | None) -> str | None:
    """Why the parquet footer of ``path`` cannot be read, or ``None`` if it can."""
    import pyarrow.parquet as pq

    if size == 0:
        return "empty file (0 bytes), not a parquet file"
    try:
        with filesystem.open_input_file(path) as f:
            pq.read_metadata(f)
    except Exception as err:
        if isinstance(err, _NEVER_SKIPPED):
            raise
        return f"{type(err).__name__}: {err}"
    return None


def find_bad_parquet_files(
    filesystem: pafs.FileSystem,
    files: Sequence[tuple[str, int | None]],
    *,
    first_only: bool = False,
    threads: int = LISTING_THREADS,
) -> list[tuple[str, str]]:
    """``(path, reason)`` of each file whose parquet footer cannot be read, in ``files`` order.

    Footers are read in parallel threads. With ``first_only`` the files are
    checked in chunks and the search stops after the first chunk with a bad file.

    Raises:
        RemoteReadError: The remote failed for longer than the retry budget.
    """
    chunk = max(1, threads * 4) if first_only else max(1, len(files))
    bad: list[tuple[str, str]] = []
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="raydl-footer") as pool:
        for start in range(0, len(files), chunk):
            part = files[start : start + chunk]
            reasons = pool.map(lambda f: _parquet_footer_error(filesystem, f[0], f[1]), part)
            bad += [(path, r) for (path, _), r in zip(part, reasons, strict=True) if r is not None]
            if bad and first_only:
                break
    return bad
