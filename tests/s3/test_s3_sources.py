"""raydl's fsspec sources against a real S3 server: reads, labels, listing, cache, errors.

The server-outage tests (restart within the retry budget, kept down) are in
tests/reliability/test_s3_faults.py.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raydl
from raydl import sources
from raydl.sources import CacheConfig, label_from_path
from raydl.testing.s3 import SeaweedServer

pytestmark = [pytest.mark.s3, pytest.mark.usefixtures("ray_instance")]

LABELS = 3
PER_LABEL = 8


@pytest.fixture(scope="module")
def images(s3_server: SeaweedServer, s3fs_client: Any, jpeg_bytes: Any) -> str:
    """``train/<label>/<i>.jpeg`` objects whose pixel value encodes the label."""
    prefix = f"{s3_server.bucket}/images/train"
    for label in range(LABELS):
        for i in range(PER_LABEL):
            s3fs_client.pipe(f"{prefix}/{label}/{i:03d}.jpeg", jpeg_bytes(40 + 80 * label))
    return f"s3://{prefix}/"


@pytest.fixture(scope="module")
def table(s3_server: SeaweedServer, s3fs_client: Any) -> str:
    prefix = f"{s3_server.bucket}/table"
    for part in range(3):
        ids = np.arange(part * 100, (part + 1) * 100)
        buf = io.BytesIO()
        pq.write_table(pa.table({"id": ids, "x": ids * 0.5, "name": [f"u{i}" for i in ids]}), buf)
        s3fs_client.pipe(f"{prefix}/part-{part}.parquet", buf.getvalue())
    return f"s3://{prefix}/"


@pytest.mark.timeout(120)  # includes starting the server and Ray on a busy 2-core box
def test_server_listens_on_loopback_only(s3_server: SeaweedServer) -> None:
    assert {ip for ip, _ in s3_server.listening_addresses()} == {"127.0.0.1"}


@pytest.mark.timeout(120)
def test_read_images_labels_from_path(s3_server: SeaweedServer, images: str) -> None:
    ds = sources.read_images(images, storage_options=s3_server.storage_options, mode="L")
    seen: list[str] = []
    for batch in raydl.RayDataLoader(ds, batch_size=5, shuffle=True, seed=0):
        for path, image in zip(batch["path"], batch["image"], strict=True):
            label = int(label_from_path(path))
            assert abs(float(np.asarray(image, dtype=np.float64).mean()) - (40 + 80 * label)) < 3, (
                path
            )
            seen.append(path)
    assert len(seen) == len(set(seen)) == LABELS * PER_LABEL


@pytest.mark.timeout(120)
def test_read_parquet_columns_every_row_once(s3_server: SeaweedServer, table: str) -> None:
    ds = sources.read_parquet(table, storage_options=s3_server.storage_options, columns=["id", "x"])
    loader = raydl.RayDataLoader(ds, batch_size=64, shuffle=True, seed=1)
    for epoch in range(2):
        loader.set_epoch(epoch)
        ids = [int(i) for b in loader for i in b["id"]]
        assert sorted(ids) == list(range(300))


@pytest.mark.timeout(60)
def test_read_binary_files_bytes(s3_server: SeaweedServer, s3fs_client: Any) -> None:
    prefix = f"{s3_server.bucket}/blobs"
    blobs = {f"{prefix}/{i}.bin": bytes([i]) * (i + 1) for i in range(5)}
    s3fs_client.pipe(blobs)
    rows = sources.read_binary_files(
        f"s3://{prefix}/", storage_options=s3_server.storage_options
    ).take_all()
    assert {r["path"]: r["bytes"] for r in rows} == blobs


@pytest.mark.timeout(60)
def test_missing_prefix_error_names_it(s3_server: SeaweedServer) -> None:
    with pytest.raises(FileNotFoundError, match="raydl-test/no-such-prefix"):
        sources.read_images(
            f"s3://{s3_server.bucket}/no-such-prefix/", storage_options=s3_server.storage_options
        )


@pytest.mark.timeout(120)
def test_cache_serves_epoch_two_and_refetches_changed_objects(
    s3_server: SeaweedServer, s3fs_client: Any, tmp_path: Any
) -> None:
    prefix = f"{s3_server.bucket}/cached"
    for i in range(6):
        s3fs_client.pipe(f"{prefix}/{i}.bin", bytes([i]) * 100)
    cache = CacheConfig(str(tmp_path / "cache"))
    ds = sources.read_binary_files(
        f"s3://{prefix}/", storage_options=s3_server.storage_options, cache=cache
    )

    def epoch() -> dict[str, bytes]:
        return {r["path"]: r["bytes"] for r in ds.take_all()}

    first = epoch()
    assert len(first) == 6
    assert (cache.stats().misses, cache.stats().hits) == (6, 0)
    assert epoch() == first
    assert (cache.stats().misses, cache.stats().hits) == (6, 6)

    s3fs_client.pipe(f"{prefix}/0.bin", b"changed")  # new ETag and size: a new entry
    third = epoch()
    assert third[f"{prefix}/0.bin"] == b"changed"
    stats = cache.stats()
    assert (stats.misses, stats.hits) == (7, 11)
    assert stats.entries == 7  # the stale entry stays until LRU eviction


@pytest.mark.timeout(120)
def test_listing_fans_out_over_sub_prefixes_same_files_same_order(
    s3_server: SeaweedServer, s3fs_client: Any
) -> None:
    import pyarrow.fs as pafs

    prefix = f"{s3_server.bucket}/listing/train"
    objects = {
        f"{prefix}/{label}/{i:02d}.bin": bytes([label, i]) for label in range(6) for i in range(4)
    }
    objects |= {
        f"{prefix}/top.bin": b"top",
        f"{prefix}/2/nested/deep.bin": b"deep",
        f"{prefix}/_meta/skip.bin": b"hidden",
    }
    s3fs_client.pipe(objects)
    paths, fs = sources.resolve_filesystem(
        f"s3://{prefix}/", storage_options=s3_server.storage_options
    )
    selector = pafs.FileSelector(paths[0], recursive=True)
    fanned_out = [(i.path, i.type, i.size) for i in fs.get_file_info(selector)]
    serial = pafs.PyFileSystem(pafs.FSSpecHandler(s3fs_client)).get_file_info(selector)
    assert fanned_out == sorted((i.path, i.type, i.size) for i in serial)

    ds = sources.read_binary_files(f"s3://{prefix}/", storage_options=s3_server.storage_options)
    rows = [
        (p, bytes(b))
        for batch in raydl.RayDataLoader(ds, batch_size=5)
        for p, b in zip(batch["path"], batch["bytes"], strict=True)
    ]
    expected = sorted((k, v) for k, v in objects.items() if "/_meta/" not in k)
    assert rows == expected  # every object once, in sorted order, hidden prefix left out
