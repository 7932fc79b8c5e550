"""Shared pytest setup for raydl's test suite.

Integration tests hand datasets, samplers and ``collate_fn``s defined in test
modules to Ray worker processes. Those objects are pickled by reference (module
name + attribute), so the workers must be able to import the test modules: the
test folders are put on ``PYTHONPATH`` here, before any test starts Ray, and
Ray's worker processes inherit it.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

_TESTS = Path(__file__).resolve().parent
_PATHS = [str(_TESTS / "integration"), str(_TESTS)]


def _extend_pythonpath() -> None:
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([*[p for p in _PATHS if p not in current], *current])


def _no_implicit_ray_init() -> None:
    """A Ray call after ``ray.shutdown()`` raises instead of starting a new Ray.

    Ray's ``ray.get``/``ray.put``/... start a local instance when none is up.
    A background thread of a pipeline that outlived its module's cluster would
    start one in the middle of the next module's setup, and Ray's core worker
    then ends the whole pytest process (exit 1, no summary). Only this process
    is affected: the examples and torchrun trainers the tests start keep Ray's
    default. raydl itself always starts Ray explicitly.
    """
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False


_extend_pythonpath()
_no_implicit_ray_init()


class _Progress:
    """One readable line when a test file ends, and one when a tier ends.

    ``-q`` prints only dots; a suite that runs for 20 minutes needs a line a
    person can read: where it is, what passed and failed, how long it took.
    A tier is the folder under ``tests/`` (unit, integration, multirank,
    reliability, s3); a file directly in ``tests/`` is its own tier, named
    after it (``test_examples.py``: examples). The lines start with a clock
    (time since the first test started), never with ``=`` or ``FAILED``, so
    the summary that ``.ci/run`` greps for is unchanged.
    """

    def __init__(self) -> None:
        self.session_start: float | None = None
        self.current: Path | None = None
        self.last_lines: list[str] = []
        self.file_start: dict[Path, float] = {}
        self.tier_start: dict[str, float] = {}
        self.file_counts: dict[Path, Counter[str]] = {}
        self.tier_counts: dict[str, Counter[str]] = {}
        self.tier_files: Counter[str] = Counter()

    @staticmethod
    def place(path: Path) -> tuple[str, str]:
        try:
            rel = path.resolve().relative_to(_TESTS)
        except ValueError:
            return "other", path.name
        tier = rel.parts[0] if len(rel.parts) > 1 else rel.stem.removeprefix("test_")
        return tier, rel.as_posix()

    def started(self, path: Path) -> None:
        now = time.perf_counter()
        if self.session_start is None:
            self.session_start = now
        self.current = path
        tier, _ = self.place(path)
        self.file_start.setdefault(path, now)
        self.tier_start.setdefault(tier, now)

    def count(self, report: pytest.TestReport) -> None:
        path = self.current
        if path is not None and (report.when == "call" or report.outcome != "passed"):
            if hasattr(report, "wasxfail"):
                outcome = "xfailed" if report.skipped else "xpassed"
            elif report.when != "call" and report.failed:
                outcome = "error"
            else:
                outcome = report.outcome
            tier, _ = self.place(path)
            self.file_counts.setdefault(path, Counter())[outcome] += 1
            self.tier_counts.setdefault(tier, Counter())[outcome] += 1

    def finished(self, path: Path, next_path: Path | None) -> list[str]:
        if next_path == path:
            return []
        now = time.perf_counter()
        clock = _clock(now - (self.session_start or now))
        tier, rel = self.place(path)
        self.tier_files[tier] += 1
        counts = self.file_counts.pop(path, Counter())
        lines = [
            f"[{clock}] {rel}: {_counts(counts)} in {_seconds(now - self.file_start.pop(path))}"
        ]
        if next_path is None or self.place(next_path)[0] != tier:
            files = self.tier_files.pop(tier)
            lines.append(
                f"[{clock}] {tier}: {_counts(self.tier_counts.pop(tier, Counter()))} in "
                f"{_seconds(now - self.tier_start.pop(tier))} ({files} file{'s' * (files != 1)})"
            )
        return lines


def _counts(counts: Counter[str]) -> str:
    order = ["passed", "failed", "error", "skipped", "xfailed", "xpassed"]
    parts = [f"{counts[name]} {name}" for name in order if counts[name]]
    return ", ".join(parts) or "no tests"


def _seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


_PROGRESS = _Progress()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, None, None]:
    """Write the file's line (and its tier's) after its last test, under ``-q`` too."""
    _PROGRESS.started(item.path)
    yield
    lines = _PROGRESS.finished(item.path, nextitem.path if nextitem else None)
    if nextitem is None:
        _PROGRESS.last_lines = lines  # after pytest's own "[100%]", see pytest_runtestloop
    else:
        _write(item.config, lines, end_dots=True)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> Generator[None, None, None]:
    """Write the last file's lines once pytest has ended its dots with "[100%]"."""
    yield
    _write(session.config, _PROGRESS.last_lines, end_dots=False)
    _PROGRESS.last_lines = []


def _write(config: pytest.Config, lines: list[str], *, end_dots: bool) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or not lines:
        return
    _end_line(reporter, end_dots=end_dots)
    for line in lines:
        reporter.write_line(line)


def _end_line(reporter: Any, *, end_dots: bool) -> None:
    """End a line of dots, as pytest would ("[ 42%]"), so that ours starts on its own line.

    pytest's reporter has no public call for this; without its private parts
    the line just starts after a newline.
    """
    writer = getattr(reporter, "_tw", None)
    if writer is None or not writer.width_of_current_line:
        return
    fill = getattr(reporter, "_write_progress_information_filling_space", None)
    progress = getattr(reporter, "_show_progress_info", False)
    if end_dots and reporter.verbosity <= 0 and progress and fill:
        fill()
    reporter.line("")
    reporter.currentfspath = None  # the line is ended; pytest need not end it again


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Count each test once: its call's outcome, or the setup/teardown that failed or skipped."""
    _PROGRESS.count(report)
