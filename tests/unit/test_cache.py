"""The disk cache without Ray or a filesystem: a fake download callable stands in for the remote."""

from __future__ import annotations

import ast
import gc
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from raydl._internal.io import cache as cache_module
from raydl._internal.io.cache import CacheConfig, DiskCache

ENDPOINT = "s3 endpoint http://127.0.0.1:1"


class FakeRemote:
    """Objects by key; ``download(key)`` is the callable the cache is handed, counting calls."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects
        self.downloads: list[str] = []
        self.wrong_size = False

    def info(self, key: str, version: str = "v1") -> dict[str, object]:
        return {"size": len(self.objects[key]), "ETag": f'"{version}"'}

    def download(self, key: str) -> Callable[[str], None]:
        def into(local: str) -> None:
            self.downloads.append(key)
            data = self.objects[key]
            Path(local).write_bytes(data + b"!" if self.wrong_size else data)

        return into


def _fetch(cache: DiskCache, remote: FakeRemote, key: str, version: str = "v1") -> bytes:
    local = cache.fetch(key, remote.info(key, version), remote.download(key), endpoint=ENDPOINT)
    return Path(local).read_bytes()


def _stats_files(config: CacheConfig) -> list[str]:
    stats_dir = Path(config.dir) / "stats"
    return sorted(p.name for p in stats_dir.iterdir()) if stats_dir.exists() else []


@pytest.fixture
def config(tmp_path: Path) -> CacheConfig:
    return CacheConfig(str(tmp_path / "cache"))


@pytest.mark.timeout(30)
def test_a_miss_downloads_once_and_a_hit_serves_the_entry(config: CacheConfig) -> None:
    remote = FakeRemote({"b/k.bin": b"abc"})
    cache = DiskCache(config)
    assert _fetch(cache, remote, "b/k.bin") == b"abc"
    assert _fetch(cache, remote, "b/k.bin") == b"abc"
    assert remote.downloads == ["b/k.bin"]
    stats = config.stats()
    assert (stats.hits, stats.misses, stats.bytes_fetched, stats.entries, stats.bytes) == (
        1,
        1,
        3,
        1,
        3,
    )


@pytest.mark.timeout(30)
def test_a_new_version_is_a_new_entry(config: CacheConfig) -> None:
    remote = FakeRemote({"k": b"old"})
    cache = DiskCache(config)
    _fetch(cache, remote, "k", "v1")
    remote.objects["k"] = b"newer"
    assert _fetch(cache, remote, "k", "v2") == b"newer"
    assert remote.downloads == ["k", "k"]
    stats = config.stats()
    assert (stats.misses, stats.hits, stats.entries) == (2, 0, 2)
    # the same key at another endpoint is another object
    other = cache.fetch("k", remote.info("k", "v2"), remote.download("k"), endpoint="elsewhere")
    assert other != cache.entry_path(ENDPOINT, "k", remote.info("k", "v2"))


@pytest.mark.timeout(30)
def test_a_download_of_the_wrong_size_names_key_and_endpoint_and_caches_nothing(
    config: CacheConfig,
) -> None:
    remote = FakeRemote({"b/k.bin": b"abc"})
    remote.wrong_size = True
    cache = DiskCache(config)
    with pytest.raises(OSError, match=r"key 'b/k\.bin' at s3 endpoint http://127\.0\.0\.1:1 got 4"):
        _fetch(cache, remote, "b/k.bin")
    assert config.stats().entries == 0
    assert not os.listdir(Path(config.dir) / "tmp")  # no partial download left


@pytest.mark.timeout(30)
def test_a_failed_download_leaves_nothing_behind(config: CacheConfig) -> None:
    def fails(local: str) -> None:
        Path(local).write_bytes(b"partial")
        raise ConnectionError("reset by peer")

    cache = DiskCache(config)
    with pytest.raises(ConnectionError, match="reset by peer"):
        cache.fetch("k", {"size": 10, "ETag": "e"}, fails, endpoint=ENDPOINT)
    assert config.stats().entries == 0
    assert not os.listdir(Path(config.dir) / "tmp")


@pytest.mark.timeout(30)
def test_lru_eviction_keeps_the_bound(tmp_path: Path) -> None:
    config = CacheConfig(str(tmp_path / "cache"), max_bytes=250)
    remote = FakeRemote({str(i): bytes([i]) * 100 for i in range(6)})
    cache = DiskCache(config)
    for i in [0, 1, 0, 2, 3, 4, 5]:
        time.sleep(0.01)  # distinct mtimes for the LRU order
        assert _fetch(cache, remote, str(i)) == bytes([i]) * 100
    stats = config.stats()
    assert stats.bytes <= 250 and stats.entries == 2
    assert stats.evictions >= 4


@pytest.mark.timeout(30)
def test_counters_are_written_on_flush_not_on_every_open(
    config: CacheConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[dict[str, int]] = []
    real_write = cache_module._write_counts

    def counting_write(directory: str, counts: dict[str, int]) -> None:
        writes.append(dict(counts))
        real_write(directory, counts)

    monkeypatch.setattr(cache_module, "_write_counts", counting_write)
    remote = FakeRemote({str(i): b"x" * 10 for i in range(5)})
    cache = DiskCache(config)
    for _ in range(4):
        for i in range(5):
            _fetch(cache, remote, str(i))
    assert writes == []  # 20 opens, no stats file written
    assert _stats_files(config) == []
    cache.flush()
    assert len(writes) == 1 and writes[0]["hits"] == 15 and writes[0]["misses"] == 5
    cache.flush()  # nothing changed: nothing written
    config.stats()
    assert len(writes) == 1
    _fetch(cache, remote, "0")
    assert config.stats().hits == 16  # stats() writes this process's counters first
    assert len(writes) == 2
    (name,) = _stats_files(config)
    assert json.loads((Path(config.dir) / "stats" / name).read_text())["hits"] == 16


@pytest.mark.timeout(30)
def test_close_and_garbage_collection_flush(
    config: CacheConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[str] = []
    real_write = cache_module._write_counts

    def counting_write(directory: str, counts: dict[str, int]) -> None:
        writes.append(directory)
        real_write(directory, counts)

    monkeypatch.setattr(cache_module, "_write_counts", counting_write)
    remote = FakeRemote({"k": b"abc"})
    cache = DiskCache(config)
    _fetch(cache, remote, "k")
    cache.close()
    cache.close()  # idempotent
    assert writes == [config.dir]
    dropped = DiskCache(config)  # e.g. the copy a Ray read task unpickled
    _fetch(dropped, remote, "k")
    del dropped
    gc.collect()
    assert writes == [config.dir, config.dir]


@pytest.mark.timeout(60)
def test_another_process_counts_are_seen_once_it_dropped_its_cache(config: CacheConfig) -> None:
    data = Path(config.dir).parent / "obj.bin"
    data.write_bytes(b"y" * 7)
    # A worker that drops its cache, then exits without running atexit handlers
    # (as multiprocessing's children do): its counters were written on the drop.
    code = textwrap.dedent(
        f"""
        import os, shutil
        from raydl._internal.io.cache import CacheConfig, DiskCache

        def read():
            cache = DiskCache(CacheConfig({config.dir!r}))
            for _ in range(3):
                cache.fetch("obj.bin", {{"size": 7, "ETag": "e"}},
                            lambda local: shutil.copy({str(data)!r}, local), endpoint="e")

        read()
        os._exit(0)
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)
    stats = config.stats()
    assert (stats.misses, stats.hits, stats.bytes_fetched) == (1, 2, 7)
    config.clear()
    assert config.stats().hits == 0


def test_the_cache_imports_nothing_of_raydl() -> None:
    tree = ast.parse(Path(cache_module.__file__).read_text())
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert not [name for name in imported if name and name.startswith("raydl")]
