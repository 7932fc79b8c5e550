"""raydl.sources and the disk cache on local filesystems (the S3 server tests are in tests/s3).

Every test here may be the one that starts the module's Ray (autouse fixture), which
takes tens of seconds on a busy 2-core machine: no timeout below 120 s.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pyarrow.fs as pafs
import pytest
from fsspec.implementations.local import LocalFileSystem

import raydl
from raydl._internal.io.cache import DiskCache
from raydl._internal.io.fs import RemoteHandler, list_files
from raydl.sources import (
    CacheConfig,
    RemoteReadError,
    RetryPolicy,
    label_from_path,
    read_binary_files,
    resolve_filesystem,
)


class SlowLocalFS(LocalFileSystem):
    """A local filesystem that sleeps per request, standing in for a remote's latency."""

    protocol = ("slowlocal",)
    delay_s = 0.02

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        time.sleep(self.delay_s)
        return super().info(path, **kwargs)

    def get_file(self, rpath: str, lpath: str, **kwargs: Any) -> None:
        time.sleep(self.delay_s)
        super().get_file(rpath, lpath, **kwargs)


class ListingProbeFS(LocalFileSystem):
    """A local filesystem whose listings take a while and record how many ran at once."""

    protocol = ("probelocal",)
    delay_s = 0.05
    lock = threading.Lock()
    active = 0
    peak = 0

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        cls = type(self)
        with cls.lock:
            cls.active += 1
            cls.peak = max(cls.peak, cls.active)
        try:
            time.sleep(self.delay_s)
            return super().find(path, *args, **kwargs)
        finally:
            with cls.lock:
                cls.active -= 1


def _label_tree(root: Path, labels: int = 8, per_label: int = 4) -> None:
    """``root/<label>/<i>.bin``, plus a top-level file, a nested folder and hidden entries."""
    for label in range(labels):
        for i in range(per_label):
            path = root / str(label) / f"{i}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(bytes([label, i]) * (label + 1))
    (root / "top.bin").write_bytes(b"top")
    (root / "3" / "nested").mkdir()
    (root / "3" / "nested" / "deep.bin").write_bytes(b"deep")
    (root / "_hidden").mkdir()
    (root / "_hidden" / "x.bin").write_bytes(b"hidden")
    (root / ".dot.bin").write_bytes(b"dot")


def _infos(infos: list[pafs.FileInfo]) -> list[tuple[str, Any, Any]]:
    return [(i.path, i.type, i.size) for i in infos]


def _handler(cache_dir: Path, max_bytes: int | None = None) -> RemoteHandler:
    return RemoteHandler(
        LocalFileSystem(),
        endpoint="file endpoint test",
        retry=RetryPolicy(attempts=1),
        cache=DiskCache(CacheConfig(str(cache_dir), max_bytes=max_bytes)),
    )


@pytest.mark.timeout(120)
def test_label_from_path() -> None:
    assert label_from_path("bucket/train/3/ab12.jpeg") == "3"
    assert label_from_path("s3://bucket/train/3/ab12.jpeg", level=-3) == "train"
    with pytest.raises(ValueError, match="has no component at level=-9"):
        label_from_path("a/b", level=-9)


@pytest.mark.timeout(120)
def test_resolve_filesystem_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="paths should all use one protocol"):
        resolve_filesystem(["s3://a/x", "/tmp/y"])
    with pytest.raises(TypeError, match="paths option should be a path/URL"):
        resolve_filesystem(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="storage_options option does not apply to local paths"):
        resolve_filesystem("/tmp/x", storage_options={"key": "k"})
    with pytest.raises(TypeError, match="cache option should be a directory path"):
        resolve_filesystem("/tmp/x", cache=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_bytes option should be a positive int"):
        CacheConfig("/tmp/c", max_bytes=0)
    with pytest.raises(ValueError, match="attempts option should be a positive int"):
        RetryPolicy(attempts=0)
    paths, fs = resolve_filesystem("file:///tmp/x.parquet")
    assert (paths, fs.type_name) == (["/tmp/x.parquet"], "local")


@pytest.mark.timeout(120)
def test_cache_hit_miss_and_changed_object(tmp_path: Path) -> None:
    src = tmp_path / "obj.bin"
    src.write_bytes(b"a" * 10)
    handler = _handler(tmp_path / "cache")
    fs = pafs.PyFileSystem(handler)
    for _ in range(2):
        with fs.open_input_file(str(src)) as f:
            assert f.read() == b"a" * 10
    config = CacheConfig(str(tmp_path / "cache"))
    assert (config.stats().misses, config.stats().hits) == (1, 1)
    src.write_bytes(b"b" * 11)  # new size and mtime: a new version
    with fs.open_input_stream(str(src)) as f:
        assert f.read() == b"b" * 11
    stats = config.stats()
    assert (stats.misses, stats.hits, stats.entries) == (2, 1, 2)


@pytest.mark.timeout(120)
def test_cache_lru_eviction_keeps_bound(tmp_path: Path) -> None:
    handler = _handler(tmp_path / "cache", max_bytes=250)
    fs = pafs.PyFileSystem(handler)
    for i in range(6):
        (tmp_path / f"{i}.bin").write_bytes(bytes([i]) * 100)
    for i in [0, 1, 0, 2, 3, 4, 5]:
        time.sleep(0.01)  # distinct mtimes for the LRU order
        with fs.open_input_file(str(tmp_path / f"{i}.bin")) as f:
            assert f.read() == bytes([i]) * 100
    stats = CacheConfig(str(tmp_path / "cache")).stats()
    assert stats.bytes <= 250
    assert stats.evictions >= 4
    assert stats.entries == 2


def _read_all(cache_dir: str, paths: list[str], out: Any) -> None:
    fs = pafs.PyFileSystem(_handler(Path(cache_dir)))
    ok = True
    for p in paths:
        with fs.open_input_file(p) as f:
            ok &= f.read() == Path(p).read_bytes()
    out.put(ok)


@pytest.mark.timeout(120)
def test_cache_concurrent_writers(tmp_path: Path) -> None:
    paths = []
    for i in range(20):
        p = tmp_path / f"{i}.bin"
        p.write_bytes(os.urandom(50_000))
        paths.append(str(p))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_read_all, args=(str(tmp_path / "cache"), paths, out)) for _ in range(4)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=50) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    assert results == [True] * 4
    stats = CacheConfig(str(tmp_path / "cache")).stats()
    assert stats.entries == 20
    assert stats.hits + stats.misses == 80
    assert not os.listdir(tmp_path / "cache" / "tmp")  # no partial downloads left


@pytest.mark.timeout(120)
def test_retry_exhausted_names_endpoint_and_key() -> None:
    calls = []

    def flaky() -> None:
        calls.append(1)
        raise ConnectionError("connection refused")

    policy = RetryPolicy(attempts=3, initial_backoff_s=0.01)
    start = time.monotonic()
    with pytest.raises(
        RemoteReadError,
        match=r"download of key 'b/k.bin' at s3 endpoint http://h:1 failed after 3 attempt",
    ):
        policy.call(flaky, what="download", endpoint="s3 endpoint http://h:1", key="b/k.bin")
    assert len(calls) == 3
    assert time.monotonic() - start < 5
    with pytest.raises(FileNotFoundError):  # permanent errors are not retried
        policy.call(lambda: Path("/nonexistent/x").read_bytes(), what="read", endpoint="e", key="k")


@pytest.mark.timeout(180)
def test_cache_in_ray_workers_with_latency(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(12):
        (data / f"{i}.bin").write_bytes(bytes([i]) * 1000)
    cache = CacheConfig(str(tmp_path / "cache"))
    ds = read_binary_files(str(data), filesystem=SlowLocalFS(), cache=cache)
    first = sorted((r["path"], r["bytes"]) for r in ds.take_all())
    assert cache.stats().misses == 12
    second = sorted((r["path"], r["bytes"]) for r in ds.take_all())
    assert second == first
    assert (cache.stats().misses, cache.stats().hits) == (12, 12)


@pytest.mark.timeout(120)
def test_fsspec_registry_untouched() -> None:
    assert "slowlocal" not in fsspec.available_protocols()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads", [8, 1])
def test_recursive_listing_lists_sub_prefixes_in_parallel(tmp_path: Path, threads: int) -> None:
    _label_tree(tmp_path)
    ListingProbeFS.peak = 0
    handler = RemoteHandler(
        ListingProbeFS(), endpoint="e", retry=RetryPolicy(attempts=1), listing_threads=threads
    )
    selector = pafs.FileSelector(str(tmp_path), recursive=True)
    serial = sorted(_infos(pafs.FSSpecHandler(LocalFileSystem()).get_file_info_selector(selector)))
    assert _infos(handler.get_file_info_selector(selector)) == serial  # same entries, sorted
    if threads == 1:
        assert ListingProbeFS.peak == 1
    else:  # several labels listed at once (all 8 unless the box is very busy)
        assert ListingProbeFS.peak > 1
    assert _infos(handler.get_file_info_selector(pafs.FileSelector(str(tmp_path)))) == sorted(
        _infos(
            pafs.FSSpecHandler(LocalFileSystem()).get_file_info_selector(
                pafs.FileSelector(str(tmp_path))
            )
        )
    )


@pytest.mark.timeout(120)
def test_recursive_listing_of_a_missing_prefix_names_it(tmp_path: Path) -> None:
    handler = RemoteHandler(ListingProbeFS(), endpoint="e", retry=RetryPolicy(attempts=1))
    missing = str(tmp_path / "no-such-prefix")
    with pytest.raises(FileNotFoundError, match="no-such-prefix"):
        handler.get_file_info_selector(pafs.FileSelector(missing, recursive=True))
    assert (
        handler.get_file_info_selector(
            pafs.FileSelector(missing, recursive=True, allow_not_found=True)
        )
        == []
    )
    with pytest.raises(FileNotFoundError, match="no-such-prefix"):
        read_binary_files(missing, filesystem=ListingProbeFS())


@pytest.mark.timeout(120)
def test_parallel_listing_reads_the_same_files_in_the_same_order(tmp_path: Path) -> None:
    _label_tree(tmp_path)
    ListingProbeFS.peak = 0
    parallel = read_binary_files(str(tmp_path), filesystem=ListingProbeFS())  # lists here
    assert ListingProbeFS.peak > 1
    serial = read_binary_files(str(tmp_path))  # pyarrow's own local listing

    def rows(ds: Any) -> list[tuple[str, bytes]]:
        loader = raydl.RayDataLoader(ds, batch_size=5)
        return [
            (p, bytes(b))
            for batch in loader
            for p, b in zip(batch["path"], batch["bytes"], strict=True)
        ]

    got = rows(parallel)
    assert got == rows(serial)
    assert [p for p, _ in got] == sorted(p for p, _ in got)
    assert len(got) == 8 * 4 + 2  # labels, top.bin and 3/nested/deep.bin; no hidden entries


@pytest.mark.timeout(120)
def test_list_files_follows_ray_rules(tmp_path: Path) -> None:
    _label_tree(tmp_path)
    (tmp_path / "1" / "readme.txt").write_text("not data")
    fs = pafs.PyFileSystem(RemoteHandler(ListingProbeFS(), endpoint="e", retry=RetryPolicy()))
    files = list_files(fs, [str(tmp_path)], file_extensions=["BIN"])
    paths = [p for p, _ in files]
    assert paths == sorted(paths)
    assert str(tmp_path / "top.bin") in paths
    assert str(tmp_path / "3" / "nested" / "deep.bin") in paths
    assert not any("hidden" in p or ".dot" in p or p.endswith(".txt") for p in paths)
    assert dict(files)[str(tmp_path / "top.bin")] == 3
    one = str(tmp_path / "0" / "1.bin")
    assert list_files(fs, [one, str(tmp_path / "1")], exclude=frozenset({one}))[0][0].startswith(
        str(tmp_path / "1")
    )
    with pytest.raises(FileNotFoundError, match="nope"):
        list_files(fs, [str(tmp_path / "nope")])
    assert list_files(fs, [str(tmp_path / "nope")], ignore_missing_paths=True) == []


@pytest.mark.timeout(180)
def test_binary_files_are_read_many_per_task_and_shuffled_per_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raydl._internal.io import files as file_source

    per_task = 512  # fewer files than the default bound, for a quick test
    monkeypatch.setattr(file_source.FileListDatasource, "max_files_per_task", per_task)
    count = 3 * per_task // 2  # more than one task's worth
    for i in range(count):
        (tmp_path / f"{i:05d}.bin").write_bytes(i.to_bytes(4, "little") * (i % 3 + 1))
    ds = read_binary_files(str(tmp_path))
    tasks = ds._logical_plan.dag.datasource.get_read_tasks(1)
    assert 1 < len(tasks) < count  # many files per task, not one task per file
    rows = {
        row["path"]: row["bytes"]
        for batch in ds.iter_batches(batch_size=None)
        for row in _rows(batch)
    }
    assert len(rows) == count
    for i in range(count):
        assert rows[str(tmp_path / f"{i:05d}.bin")] == i.to_bytes(4, "little") * (i % 3 + 1)

    loader = raydl.RayDataLoader(
        ds, batch_size=64, shuffle=True, shuffle_mode="files", seed=1, collate_fn=lambda b: b
    )
    order = [
        int(Path(p).stem) for b in loader._source._epoch_plan(0).dataset.iter_batches(batch_size=None)
        for p in b["path"]
    ]  # fmt: skip
    assert sorted(order) == list(range(count))
    # per file, not per task: the first task's worth of files comes from all over
    assert max(order[:per_task]) - min(order[:per_task]) > count // 2
    # the epoch plan fuses the read into a stage with a batch size, one read task per
    # task (Ray would bundle 64 read tasks, each counted as one row, into one task)
    staged = ds.map_batches(lambda b: b, batch_size=64)
    source = raydl.RayDataLoader(staged, batch_size=64)._source
    assert isinstance(source._epoch_plan(0).dataset, raydl.FileDataset)  # the direct path's
    epoch_plan = source._epoch_plan(0, ray_data=True).dataset  # Ray Data's, where it runs it
    assert sum(len(b["path"]) for b in epoch_plan.iter_batches(batch_size=None)) == count
    executed = re.search(
        r"ReadBinaryFiles->MapBatches\(<lambda>\): (\d+) tasks executed", epoch_plan.stats()
    )
    assert executed is not None, epoch_plan.stats()
    assert int(executed.group(1)) > 1
    assert staged.take_batch(3)["path"].size == 3  # the user's plan is untouched (limit works)
    limited = raydl.RayDataLoader(staged.limit(70), batch_size=64, collate_fn=lambda b: b)
    assert [len(b["path"]) for b in limited] == [64, 6]
    # an option raydl's reader does not take hands the read to Ray's, which works too
    by_ray = read_binary_files(str(tmp_path), partitioning=None)
    assert by_ray.count() == count


@pytest.mark.timeout(180)
def test_parquet_files_are_read_several_per_task_and_shuffled_per_file(tmp_path: Path) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    count = 24
    for i in range(count):
        table = pa.table({"id": np.arange(i * 10, i * 10 + 10), "x": np.full(10, float(i))})
        if i % 2:
            table = table.append_column("only_odd", pa.array(np.arange(10, dtype=np.int32)))
        pq.write_table(table, tmp_path / f"{i:03d}.parquet", row_group_size=4)
    ds = raydl.read_parquet(str(tmp_path), include_paths=True)
    source = ds._logical_plan.dag.datasource
    tasks = source.get_read_tasks(3)
    assert len(tasks) == 3  # several files per task, not one task per file
    assert sum(task.metadata.num_rows for task in tasks) == count * 10
    assert ds.count() == count * 10  # from the footers, without reading the rows
    batches = list(ds.iter_batches(batch_size=None, batch_format="pyarrow"))
    assert all(b.schema.names == ["id", "x", "only_odd", "path"] for b in batches)
    assert all(b.schema.field("only_odd").type == pa.float64() for b in batches)
    table = pa.concat_tables(batches)
    assert table.column("id").to_pylist() == list(range(count * 10))  # in file order
    assert table.column("path").to_pylist() == [
        str(tmp_path / f"{i:03d}.parquet") for i in range(count) for _ in range(10)
    ]
    nulls = table.column("only_odd").is_null().to_pylist()
    assert nulls == [i % 2 == 0 for i in range(count) for _ in range(10)]

    loader = raydl.RayDataLoader(ds, batch_size=10, shuffle=True, shuffle_mode="files", seed=1)
    plan = loader._source._epoch_plan(0).dataset
    order = [int(i) // 10 for b in plan.iter_batches(batch_size=None) for i in b["id"][::10]]
    assert sorted(order) == list(range(count))
    first_task = order[: count // len(tasks)]
    assert first_task != sorted(first_task) or max(first_task) - min(first_task) >= count // 2

    only = raydl.read_parquet(str(tmp_path), columns=["x"])
    assert list(only.take_batch(5).keys()) == ["x"]
    with pytest.raises(ValueError, match=r"'nope'.* in none of the parquet files"):
        raydl.read_parquet(str(tmp_path), columns=["x", "nope"])
    # an option raydl's reader does not take hands the read to Ray's V1 reader
    import pyarrow.dataset as pads

    by_ray = raydl.read_parquet(str(tmp_path), filter=pads.field("id") < 15)
    assert sorted(by_ray.to_pandas()["id"]) == list(range(15))


def _rows(batch: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"path": p, "bytes": bytes(b)} for p, b in zip(batch["path"], batch["bytes"], strict=True)
    ]


@pytest.mark.timeout(120)
def test_parquet_reads_use_pyarrows_threads_only_with_over_one_cpu() -> None:
    import ray

    from raydl._internal.io.readers import decode_threads

    @ray.remote
    def threads() -> bool:
        return decode_threads()

    @ray.remote(num_cpus=0)
    class Actor:
        def threads(self) -> bool:
            return decode_threads()

    assert decode_threads() is True  # the driver: pyarrow's default
    assert ray.get(threads.remote()) is False  # a read task: one CPU's work
    assert ray.get(threads.options(num_cpus=2).remote()) is True
    assert ray.get(Actor.remote().threads.remote()) is False  # raydl's direct-path actors


@pytest.mark.timeout(120)
@pytest.mark.parametrize("blocks", [None, 3])
def test_a_plan_built_without_ray_is_rays_own(tmp_path: Path, blocks: int | None) -> None:
    """``plan_read`` (what raydl's readers build while Ray starts) gives the plan
    ``ray.data.read_datasource`` gives: the same read tasks and rows, blocks given or not."""
    import ray.data

    from raydl._internal.io.files import FileListDatasource, as_ray_datasource
    from raydl._internal.ray_compat import reads
    from raydl._internal.runtime import cluster

    files = []
    for i in range(40):
        path = tmp_path / f"{i:02d}.bin"
        path.write_bytes(bytes([i]) * (i + 1))
        files.append((str(path), i + 1))
    source = FileListDatasource(
        files, pafs.LocalFileSystem(), include_paths=True, on_bad_file="raise"
    )
    options = {} if blocks is None else {"override_num_blocks": blocks}
    datasource = as_ray_datasource(source)
    ours = reads.plan_read(datasource, cpus=cluster.cpus(), **options)
    rays = ray.data.read_datasource(datasource, **options)
    assert ours._logical_plan.dag.num_outputs == rays._logical_plan.dag.num_outputs
    assert ours._logical_plan.dag.parallelism == rays._logical_plan.dag.parallelism

    def rows(ds: Any) -> list[tuple[str, bytes]]:
        return sorted((row["path"], row["bytes"]) for row in ds.take_all())

    assert rows(ours) == rows(rays) and len(rows(ours)) == 40
