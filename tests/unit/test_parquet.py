"""raydl's parquet source without Ray: task sizing, row-group runs, schema conforming, reading."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from raydl._internal.io import parquet, readers
from raydl._internal.io.parquet import Footer, ParquetFilesDatasource, read_tasks_for
from raydl._internal.io.readers import conform

MIB = 1 << 20


def _footers(sizes_mib: list[int]) -> list[Footer]:
    return [Footer(pa.schema([("x", pa.int64())]), 10, size * MIB) for size in sizes_mib]


@pytest.mark.parametrize(
    ("sizes_mib", "cpus", "tasks"),
    [
        ([11] * 16, 2, 6),  # 176 MiB / 32 MiB -> 6 tasks
        ([1] * 16, 2, 2),  # small files: still one task per CPU
        ([1] * 16, 64, 16),  # ... but never more tasks than files
        ([500] * 4, 2, 4),  # big files: one task each
        ([0], 8, 1),
    ],
)
def test_read_tasks_aim_at_task_bytes(sizes_mib: list[int], cpus: int, tasks: int) -> None:
    assert parquet.TASK_BYTES == 32 * MIB
    assert read_tasks_for(_footers(sizes_mib), cpus) == tasks


def test_conform_fills_missing_columns_casts_and_adds_the_path() -> None:
    schema = pa.schema([("a", pa.float64()), ("b", pa.int64()), ("c", pa.string())])
    table = pa.table({"c": ["x", "y"], "a": pa.array([1.5, 2.5], type=pa.float32())})
    out = conform(table, schema, "/data/f.parquet")
    assert out.schema.names == ["a", "b", "c", "path"]
    assert out.schema.field("a").type == pa.float64()
    assert out.column("b").null_count == 2
    assert out.column("c").to_pylist() == ["x", "y"]
    assert out.column("path").to_pylist() == ["/data/f.parquet"] * 2
    assert conform(table, schema, None).schema == schema


def test_conform_refuses_an_impossible_cast() -> None:
    schema = pa.schema([("a", pa.int64())])
    with pytest.raises(pa.ArrowInvalid):
        conform(pa.table({"a": ["not a number"]}), schema, None)


def test_read_task_reads_its_files_in_order_by_row_group_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = []
    for i in range(3):
        path = tmp_path / f"{i}.parquet"
        pq.write_table(pa.table({"id": np.arange(i * 100, i * 100 + 100)}), path, row_group_size=10)
        paths.append(str(path))
    footers = [Footer(pq.read_schema(p), 100, 1000) for p in paths]
    source = ParquetFilesDatasource(
        paths,
        footers,
        pafs.LocalFileSystem(),
        schema=footers[0].schema,
        columns=None,
        include_paths=False,
    )
    monkeypatch.setattr(readers, "CHUNK_BYTES", 1)  # one row group per table
    (task,) = source.get_read_tasks(1)
    assert task.metadata.num_rows == 300
    tables = list(task())
    assert len(tables) == 30
    assert pa.concat_tables(tables).column("id").to_pylist() == list(range(300))
    permuted = source.permuted(seed=3).get_read_tasks(3)
    assert [t.metadata.input_files for t in permuted] != [(p,) for p in paths]
    assert sorted(f for t in permuted for f in t.metadata.input_files) == paths


def test_a_corrupt_file_is_named(tmp_path: Path) -> None:
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"id": [1]}), good)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(good.read_bytes()[:-20] + b"\0" * 20)
    schema = pq.read_schema(good)
    source = ParquetFilesDatasource(
        [str(good), str(bad)],
        [Footer(schema, 1, 10)] * 2,
        pafs.LocalFileSystem(),
        schema=schema,
        columns=None,
        include_paths=False,
    )
    (task,) = source.get_read_tasks(1)
    with pytest.raises(Exception, match=r"bad\.parquet"):
        list(task())
