"""How raydl's file sources cut their listed files into read tasks and read them (no Ray cluster)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from fsspec.implementations.local import LocalFileSystem

from raydl._internal.io import files, readers
from raydl._internal.io.files import FileListDatasource


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


class _SlowFiles(LocalFileSystem):
    """Local files behind a round trip: each open waits ``delay`` s and is counted."""

    def __init__(self, delay: float, fail: str | None = None) -> None:
        super().__init__()
        self.delay = delay
        self.fail = fail
        self.lock = threading.Lock()
        self.open_now = 0
        self.most_at_once = 0

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        with self.lock:
            self.open_now += 1
            self.most_at_once = max(self.most_at_once, self.open_now)
        try:
            time.sleep(self.delay)
            if path.endswith(self.fail or "\0"):
                raise FileNotFoundError(path)
            return super()._open(path, mode, **kwargs)
        finally:
            with self.lock:
                self.open_now -= 1


def _read_task(paths: list[str], fs: Any) -> pa.Table:
    pyfs = pafs.PyFileSystem(pafs.FSSpecHandler(fs))
    source = FileListDatasource(
        [(p, None) for p in paths], pyfs, include_paths=True, on_bad_file="raise"
    )
    (task,) = source.get_read_tasks(1)
    (block,) = list(task())
    return block


@pytest.mark.timeout(30)
def test_a_remote_filesystems_files_are_fetched_at_once_in_the_tasks_order(
    tmp_path: Path,
) -> None:
    # An object store answers each request after a round trip: a task fetches up to
    # READ_THREADS files at once, and its block keeps the task's file order.
    paths = []
    for i in range(40):
        path = tmp_path / f"{i:02d}.bin"
        path.write_bytes(bytes([i]) * (i + 1))
        paths.append(str(path))
    slow = _SlowFiles(delay=0.05)
    block = _read_task(paths, slow)
    assert block.column("path").to_pylist() == paths
    assert block.column("bytes").to_pylist() == [bytes([i]) * (i + 1) for i in range(40)]
    assert 1 < slow.most_at_once <= readers.BinaryRuns.READ_THREADS


@pytest.mark.timeout(30)
def test_a_remote_read_error_names_the_file(tmp_path: Path) -> None:
    paths = []
    for i in range(20):
        path = tmp_path / f"{i:02d}.bin"
        path.write_bytes(b"x")
        paths.append(str(path))
    with pytest.raises(FileNotFoundError, match=r"07\.bin"):
        _read_task(paths, _SlowFiles(delay=0.01, fail="07.bin"))
