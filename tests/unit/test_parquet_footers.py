"""Parquet footers are read once, with the bad-file policy folded into that read (no Ray)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem

from raydl._internal.io import parquet, skips
from raydl._internal.io.file_dataset import FileDataset
from raydl._internal.io.parquet import ParquetFilesDatasource, read_dataset, read_footers


class CountingFS(LocalFileSystem):
    """Local files whose opens are counted per path."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.opens: dict[str, int] = {}

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        with self.lock:
            self.opens[path] = self.opens.get(path, 0) + 1
        return super()._open(path, mode, **kwargs)


def _table(root: Path, n: int, bad: dict[int, str]) -> list[tuple[str, int | None]]:
    files = []
    for i in range(n):
        path = root / f"part-{i:02d}.parquet"
        ids = np.arange(i * 10, i * 10 + 10)
        pq.write_table(pa.table({"id": ids}), path)
        if bad.get(i) == "garbage":
            path.write_bytes(b"not parquet\n" * 5)
        elif bad.get(i) == "empty":
            path.write_bytes(b"")
        files.append((str(path), path.stat().st_size))
    return files


@pytest.fixture
def ledger(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """The skip ledger, without Ray: what ``record_skip`` was told."""
    recorded: list[tuple[str, str]] = []
    monkeypatch.setattr(skips, "ledger", lambda: None)
    monkeypatch.setattr(skips, "record_skip", lambda path, reason: recorded.append((path, reason)))
    return recorded


@pytest.mark.timeout(30)
def test_skip_reads_each_footer_once_and_the_plan_reuses_them(
    tmp_path: Path, ledger: list[tuple[str, str]]
) -> None:
    files = _table(tmp_path, 6, {1: "garbage", 4: "empty"})
    counting = CountingFS()
    fs = pafs.PyFileSystem(pafs.FSSpecHandler(counting))
    out = read_dataset(
        fs, files, on_bad_file="skip", columns=None, include_paths=False, options={}, cpus=2
    )
    assert isinstance(out, FileDataset)  # raydl's own plan, built without Ray Data
    # the empty file is known bad from its listed size: never opened; the others once each
    assert counting.opens == {path: 1 for i, (path, _) in enumerate(files) if i != 4}
    assert [path for path, _ in ledger] == [files[1][0], files[4][0]]
    assert "empty" in ledger[1][1] and "magic bytes" in ledger[0][1]
    source = out.source
    assert isinstance(source, ParquetFilesDatasource)
    good = [path for i, (path, _) in enumerate(files) if i not in (1, 4)]
    assert [path for path, _ in source.files] == good
    assert out._read_options == {"override_num_blocks": 2} and out._cpus == 2


@pytest.mark.timeout(30)
def test_raise_names_the_first_bad_file_and_an_empty_one_before_reading(tmp_path: Path) -> None:
    files = _table(tmp_path, 5, {3: "garbage"})
    with pytest.raises(ValueError, match=r"part-03\.parquet' cannot be read: .*on_bad_file='skip'"):
        read_footers(pafs.LocalFileSystem(), files, on_bad_file="raise")
    (tmp_path / "e").mkdir()
    with_empty = _table(tmp_path / "e", 3, {0: "empty", 2: "empty"})
    with pytest.raises(ValueError, match=r"part-00\.parquet' is empty \(0 bytes\) \(and 1 more\)"):
        read_dataset(
            pafs.LocalFileSystem(),
            with_empty,
            on_bad_file="raise",
            columns=None,
            include_paths=False,
            options={},
            cpus=1,
        )


@pytest.mark.timeout(30)
def test_a_missing_file_keeps_its_own_error_under_raise(tmp_path: Path) -> None:
    files = _table(tmp_path, 2, {})
    Path(files[1][0]).unlink()
    with pytest.raises(FileNotFoundError):
        read_footers(pafs.LocalFileSystem(), files, on_bad_file="raise")


@pytest.mark.timeout(30)
def test_skip_with_nothing_left_is_an_error(tmp_path: Path, ledger: list[tuple[str, str]]) -> None:
    files = _table(tmp_path, 2, {0: "garbage", 1: "garbage"})
    with pytest.raises(ValueError, match=r"left no parquet file to read: all 2 are bad"):
        read_footers(pafs.LocalFileSystem(), files, on_bad_file="skip")
    assert len(ledger) == 2


@pytest.mark.timeout(30)
def test_first_bad_file_finds_the_first_in_order(tmp_path: Path) -> None:
    files = _table(tmp_path, 12, {7: "garbage", 9: "garbage"})
    found = parquet.first_bad_file(pafs.LocalFileSystem(), files, threads=1)  # chunks of 4
    assert found is not None and found[0] == files[7][0]
    assert parquet.first_bad_file(pafs.LocalFileSystem(), files[:7]) is None
