"""How a list of files is cut into runs: the one rule of raydl's read tasks and direct runs.

A *run* is a contiguous slice of the file list, in the list's order (the epoch's
order, once ``shuffle_mode="files"`` has permuted it). Ray Data's read tasks of
raydl's file sources (:class:`raydl._internal.io.files.FileRunsDatasource`) and the
requests of direct execution (:mod:`raydl._internal.epochs.direct`) are both runs,
cut by :func:`cut_runs`: as few as ``at_least`` allows, bounded by files and by
listed bytes per run, never more runs than files, file counts that differ by at
most one. A pure function of its arguments.

Example:
    >>> files = [(f"{i}.jpg", 700) for i in range(10)]
    >>> [len(run) for run in cut_runs(files, at_least=3, max_files=4096, max_bytes=RUN_BYTES)]
    [3, 3, 4]
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

__all__ = ["RUN_BYTES", "cut_runs", "run_count"]

#: Listed bytes per run, at most (parquet: the footers' uncompressed bytes): the bytes a
#: read task or a direct run holds at once, and its unit of retry.
RUN_BYTES = 32 << 20

#: ``(path, listed size or None)`` of one file.
Listed = tuple[str, int | None]


def run_count(
    files: Sequence[Listed],
    *,
    at_least: int,
    max_files: int | None,
    max_bytes: int | None,
) -> int:
    """How many runs :func:`cut_runs` cuts ``files`` into.

    Args:
        files: ``(path, listed size or None)`` of each file, in order.
        at_least: Runs wanted at least (Ray's parallelism, a minimum for the cluster).
        max_files: Files per run, at most (``None``: no bound).
        max_bytes: Listed bytes per run, at most (``None`` or 0: no bound; files
            without a listed size count as 0 bytes).

    Returns:
        ``0`` for no files, else between 1 and ``len(files)``.
    """
    count = len(files)
    if count == 0:
        return 0
    wanted = at_least
    if max_files:
        wanted = max(wanted, -(-count // max_files))
    if max_bytes:
        total = sum(size or 0 for _, size in files)
        wanted = max(wanted, -(-total // max_bytes))
    return max(1, min(count, wanted))


def cut_runs(
    files: Sequence[Listed],
    *,
    at_least: int,
    max_files: int | None,
    max_bytes: int | None,
) -> list[list[Listed]]:
    """``files`` cut into :func:`run_count` contiguous runs of equal file counts.

    Args:
        files: ``(path, listed size or None)`` of each file, in order.
        at_least: See :func:`run_count`.
        max_files: See :func:`run_count`.
        max_bytes: See :func:`run_count`.

    Returns:
        The runs, in order; together they hold every file once. ``[]`` for no files.
    """
    runs = run_count(files, at_least=at_least, max_files=max_files, max_bytes=max_bytes)
    if runs == 0:
        return []
    bounds = np.linspace(0, len(files), runs + 1).astype(int).tolist()
    return [list(files[start:stop]) for start, stop in itertools.pairwise(bounds)]
