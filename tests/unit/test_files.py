"""How raydl's file sources cut their listed files into read tasks (no Ray cluster)."""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest

from raydl._internal import files
from raydl._internal.files import FileListDatasource


def _source(count: int, size: int | None) -> FileListDatasource:
    listed = [(f"/data/{i:05d}.jpg", size) for i in range(count)]
    return FileListDatasource(
        listed, pafs.LocalFileSystem(), include_paths=True, on_bad_file="raise"
    )


def _runs(source: FileListDatasource, parallelism: int) -> list[int]:
    return [task.metadata.num_rows for task in source.get_read_tasks(parallelism)]


@pytest.mark.timeout(30)
def test_small_files_make_as_few_tasks_as_rays_parallelism_asks() -> None:
    # 5,000 small images: four tasks of 1,250 files, not ten of 500 (each task costs
    # Ray a scheduling round trip)
    assert _runs(_source(5000, 700), parallelism=4) == [1250] * 4


@pytest.mark.timeout(30)
def test_tasks_are_bounded_by_files_and_by_bytes() -> None:
    many = _runs(_source(3 * files.FILES_PER_TASK, 10), parallelism=1)
    assert len(many) == 3 and sum(many) == 3 * files.FILES_PER_TASK
    big = files.TASK_BYTES // 4  # four such files fill a task's bytes
    assert _runs(_source(40, big), parallelism=2) == [4] * 10
    # sizes the listing did not give bound nothing; never more tasks than files
    assert _runs(_source(40, None), parallelism=2) == [20, 20]
    assert _runs(_source(3, 10), parallelism=8) == [1, 1, 1]
