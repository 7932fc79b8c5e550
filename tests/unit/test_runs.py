"""The one run-cutting rule (io/runs.py) and the callers that share it, without Ray."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pyarrow.fs as pafs
import pytest

from raydl._internal.epochs import direct
from raydl._internal.io import files, parquet, runs
from raydl._internal.io.files import FileListDatasource
from raydl._internal.io.parquet import Footer
from raydl._internal.io.runs import RUN_BYTES, cut_runs, run_count


def _listed(count: int, size: int | None) -> list[tuple[str, int | None]]:
    return [(f"/data/{i:05d}.bin", size) for i in range(count)]


def _previous_cut(
    files: list[tuple[str, int | None]], at_least: int, max_files: int, max_bytes: int | None
) -> list[list[tuple[str, int | None]]]:
    """The rule as both cutters wrote it before they shared one function."""
    count = len(files)
    if count == 0:
        return []
    wanted = max(at_least, math.ceil(count / max_files))
    if max_bytes:
        wanted = max(wanted, math.ceil(sum(s or 0 for _, s in files) / max_bytes))
    bounds = np.linspace(0, count, min(count, wanted) + 1).astype(int).tolist()
    return [files[a:b] for a, b in itertools.pairwise(bounds)]


def test_one_size_for_read_tasks_and_direct_runs() -> None:
    assert RUN_BYTES == 32 << 20
    assert files.TASK_BYTES == parquet.TASK_BYTES == direct.BYTES_PER_RUN == RUN_BYTES


def test_runs_cover_the_files_in_order_with_equal_counts() -> None:
    listed = _listed(1000, 10)
    cut = cut_runs(listed, at_least=7, max_files=4096, max_bytes=RUN_BYTES)
    assert len(cut) == 7
    assert [f for run in cut for f in run] == listed
    assert max(map(len, cut)) - min(map(len, cut)) <= 1
    assert cut_runs([], at_least=7, max_files=10, max_bytes=None) == []
    assert run_count([], at_least=7, max_files=10, max_bytes=None) == 0


def test_files_bytes_and_the_file_count_bound_the_cut() -> None:
    assert run_count(_listed(100, None), at_least=1, max_files=10, max_bytes=RUN_BYTES) == 10
    assert (
        run_count(_listed(8, RUN_BYTES // 2), at_least=1, max_files=None, max_bytes=RUN_BYTES) == 4
    )
    assert run_count(_listed(3, 1), at_least=50, max_files=None, max_bytes=None) == 3
    assert run_count(_listed(3, 1), at_least=0, max_files=None, max_bytes=None) == 1
    # unknown sizes count as 0 bytes
    assert run_count(_listed(4, None), at_least=1, max_files=None, max_bytes=1) == 1


def test_the_shared_rule_cuts_as_both_old_cutters_did() -> None:
    rng = random.Random(0)
    for _ in range(300):
        count = rng.randrange(0, 3000)
        sizes = rng.choice([None, rng.randrange(0, 4 * RUN_BYTES // max(1, count))])
        listed = _listed(count, sizes)
        at_least = rng.randrange(1, 40)
        max_files = rng.choice([64, 512, 4096, rng.randrange(1, 200)])
        max_bytes = rng.choice([None, RUN_BYTES, rng.randrange(1, RUN_BYTES)])
        expected = _previous_cut(listed, at_least, max_files, max_bytes)
        assert cut_runs(listed, at_least=at_least, max_files=max_files, max_bytes=max_bytes) == (
            expected
        )


@pytest.mark.parametrize("parallelism", [1, 4, 16])
def test_read_tasks_and_direct_runs_use_the_same_rule(parallelism: int) -> None:
    listed = _listed(5000, 700)
    source = FileListDatasource(
        listed, pafs.LocalFileSystem(), include_paths=True, on_bad_file="raise"
    )
    tasks = [t.metadata.input_files for t in source.get_read_tasks(parallelism)]
    expected = cut_runs(listed, at_least=parallelism, max_files=4096, max_bytes=RUN_BYTES)
    assert tasks == [tuple(p for p, _ in run) for run in expected]
    assert direct.runs(listed) == [
        tuple(p for p, _ in run)
        for run in cut_runs(listed, at_least=direct.MIN_RUNS, max_files=512, max_bytes=RUN_BYTES)
    ]


def test_parquet_read_task_count_is_the_rule_with_one_task_per_cpu_at_least() -> None:
    schema = None
    footers = [Footer(schema, 10, 11 << 20) for _ in range(16)]  # type: ignore[arg-type]
    assert parquet.read_tasks_for(footers, 2) == runs.run_count(
        [("", f.num_bytes) for f in footers], at_least=2, max_files=None, max_bytes=RUN_BYTES
    )
    assert parquet.read_tasks_for([], 4) == 1
