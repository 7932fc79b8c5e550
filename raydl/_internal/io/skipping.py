"""Ray Data's image and binary-file datasources under the ``on_bad_file="skip"`` policy.

Apart from :mod:`raydl._internal.io.skips` (the policy and its ledger) because
these subclass Ray Data's classes: importing them imports Ray Data (about 57 MB
and half a second), which a loader of a torch ``Dataset`` never needs.
"""

from __future__ import annotations

from collections.abc import Sequence

from raydl._internal.io.skips import record_skip, skippable
from raydl._internal.ray_compat import reads

__all__ = ["SkippingBinaryDatasource", "SkippingImageDatasource"]


class _SkipBadFiles(reads.WholeFileGuard):
    """A Ray ``FileBasedDatasource`` subclass's per-file policy: skip what :func:`skippable` allows."""

    def _may_leave_out(self, err: BaseException, retried_patterns: Sequence[str]) -> bool:
        return skippable(err, retried_patterns)

    def _left_out(self, path: str, err: BaseException) -> None:
        record_skip(path, err)


class SkippingImageDatasource(_SkipBadFiles, reads.ImageDatasource):
    """Ray Data's ``ImageDatasource`` that skips images it cannot read or decode."""


class SkippingBinaryDatasource(_SkipBadFiles, reads.BinaryDatasource):
    """Ray Data's ``BinaryDatasource`` that skips files it cannot read."""
