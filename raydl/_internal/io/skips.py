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

* raydl's own file-list reader (``io/files.py``): each file's read error is
  checked against :func:`skippable` in the read task;
* Ray's images and binary files readers: subclasses of Ray Data's
  ``ImageDatasource`` / ``BinaryDatasource`` whose per-file read decodes the
  whole file before yielding anything
  (:class:`raydl._internal.ray_compat.reads.WholeFileGuard`), so a failure
  leaves out exactly that file (:mod:`raydl._internal.io.skipping`, apart so
  that this module imports no Ray Data: the loader reads the ledger);
* parquet: every file's footer is read once, in parallel threads, when the plan
  is built (:func:`raydl._internal.io.parquet.read_footers`), and the bad files
  are left out of the file list the reader gets. A file whose footer is valid
  but whose data pages are corrupt still fails the read, with an error naming it.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from raydl.errors import RemoteReadError

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = [
    "BadFilePolicy",
    "ledger",
    "never_skipped",
    "record_skip",
    "skippable",
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


def never_skipped(err: BaseException) -> bool:
    """Whether ``err`` says nothing about the file's bytes (a remote down, memory): never skipped."""
    return isinstance(err, _NEVER_SKIPPED)


def skippable(err: BaseException, retried_patterns: Sequence[str]) -> bool:
    """Whether ``on_bad_file="skip"`` may skip a file for ``err``.

    Never: remote failures past the retry budget, memory errors, and errors Ray
    retries (their task runs again instead).
    """
    if never_skipped(err):
        return False
    return not _is_retried_by_ray(err, retried_patterns)
