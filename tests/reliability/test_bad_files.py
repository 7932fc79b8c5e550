"""Bad files (corrupt/truncated/empty parquet, a non-image among images, a vanished object).

Default policy: iterating the loader raises an error that names the file.
``on_bad_file="skip"``: exactly that file's rows are missing, every other row
comes exactly once, and the skip ledger lists exactly the bad files.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _private_ray import private_ray

import raydl
from raydl import sources
from raydl._internal.io import skips

ROWS_PER_FILE = 10


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[None]:
    """One private 2-CPU Ray for this module."""
    with private_ray(num_cpus=2):
        yield


pytestmark = pytest.mark.usefixtures("ray_instance")


def _write_parts(root: Path, n: int) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        ids = np.arange(i * ROWS_PER_FILE, (i + 1) * ROWS_PER_FILE)
        path = root / f"part-{i:02d}.parquet"
        pq.write_table(pa.table({"id": ids, "x": ids * 0.5}), path)
        paths.append(path)
    return paths


def _spoil(path: Path, how: str) -> None:
    if how == "garbage":
        path.write_bytes(b"this is not a parquet file\n" * 20)
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "empty":
        path.write_bytes(b"")
    else:
        raise AssertionError(how)


def _ids_of(part: int) -> set[int]:
    return set(range(part * ROWS_PER_FILE, (part + 1) * ROWS_PER_FILE))


def _skipped_under(root: Path) -> dict[str, str]:
    """The ledger's entries for files under ``root`` (other tests' skips are elsewhere)."""
    return {e["path"]: e["reason"] for e in skips.snapshot() if e["path"].startswith(str(root))}


def _image(path: Path, value: int) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8), value, dtype=np.uint8)).save(path, format="PNG")


@pytest.mark.timeout(120)
def test_snapshot_is_empty_before_any_skip() -> None:
    assert skips.snapshot() == []


@pytest.mark.timeout(120)
def test_snapshot_is_empty_without_ray() -> None:
    code = "from raydl._internal.io.skips import snapshot; assert snapshot() == []; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.timeout(120)
def test_on_bad_file_rejects_unknown_values(tmp_path: Path) -> None:
    for reader in (sources.read_parquet, sources.read_images, sources.read_binary_files):
        with pytest.raises(
            ValueError, match=r"on_bad_file option should be 'raise' .* got 'ignore'"
        ):
            reader(str(tmp_path), on_bad_file="ignore")  # type: ignore[arg-type]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["garbage", "truncated", "empty"])
@pytest.mark.parametrize("remote", [False, True], ids=["pyarrow-local", "fsspec"])
def test_bad_parquet_default_error_names_the_file(tmp_path: Path, how: str, remote: bool) -> None:
    parts = _write_parts(tmp_path / "table", 4)
    _spoil(parts[1], how)
    retry = raydl.RetryPolicy(attempts=1) if remote else None
    with pytest.raises(ValueError, match=re.escape(str(parts[1]))):
        ds = sources.read_parquet(str(tmp_path / "table"), retry=retry)
        list(raydl.RayDataLoader(ds, batch_size=8))


@pytest.mark.timeout(120)
def test_bad_parquet_among_many_files_error_names_it(tmp_path: Path) -> None:
    # Ray reads a sample of footers when the plan is built; a bad file outside the
    # sample fails the epoch itself. Either way the error names the file.
    parts = _write_parts(tmp_path / "table", 20)
    _spoil(parts[17], "garbage")
    with pytest.raises(ValueError, match=re.escape(str(parts[17]))):
        ds = sources.read_parquet(str(tmp_path / "table"))
        list(raydl.RayDataLoader(ds, batch_size=8))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("remote", [False, True], ids=["pyarrow-local", "fsspec"])
def test_bad_parquet_skip_drops_exactly_those_files(tmp_path: Path, remote: bool) -> None:
    parts = _write_parts(tmp_path / "table", 8)
    bad = {1: "garbage", 4: "truncated", 6: "empty"}
    for i, how in bad.items():
        _spoil(parts[i], how)
    retry = raydl.RetryPolicy(attempts=1) if remote else None
    ds = sources.read_parquet(str(tmp_path / "table"), retry=retry, on_bad_file="skip")
    loader = raydl.RayDataLoader(ds, batch_size=7, shuffle=True, seed=0)
    expected = sorted(set().union(*(_ids_of(i) for i in range(8) if i not in bad)))
    for epoch in range(2):
        loader.set_epoch(epoch)
        ids = [int(i) for batch in loader for i in batch["id"]]
        assert sorted(ids) == expected  # every good row exactly once, no bad file's row
    skipped = _skipped_under(tmp_path)
    assert set(skipped) == {str(parts[i]) for i in bad}
    assert "empty" in skipped[str(parts[6])]
    assert "magic bytes" in skipped[str(parts[1])]


@pytest.mark.timeout(120)
def test_bad_parquet_skip_with_rays_older_parquet_reader(tmp_path: Path) -> None:
    # Ray's V1 parquet reader has no skip_paths: raydl hands it the good files instead.
    import ray.data

    parts = _write_parts(tmp_path / "table", 4)
    _spoil(parts[2], "truncated")
    ctx = ray.data.DataContext.get_current()
    saved, ctx.use_datasource_v2 = ctx.use_datasource_v2, False
    try:
        ds = sources.read_parquet(str(tmp_path / "table"), on_bad_file="skip")
        ids = sorted(int(i) for batch in raydl.RayDataLoader(ds, batch_size=8) for i in batch["id"])
    finally:
        ctx.use_datasource_v2 = saved
    assert ids == sorted(_ids_of(0) | _ids_of(1) | _ids_of(3))
    assert set(_skipped_under(tmp_path)) == {str(parts[2])}


@pytest.mark.timeout(120)
def test_parquet_skip_with_nothing_left_is_an_error(tmp_path: Path) -> None:
    parts = _write_parts(tmp_path / "table", 2)
    for part in parts:
        _spoil(part, "garbage")
    with pytest.raises(ValueError, match=r"left no parquet file to read: all 2 are bad"):
        sources.read_parquet(str(tmp_path / "table"), on_bad_file="skip")


def _image_tree(root: Path) -> tuple[list[Path], list[Path]]:
    """``root/<label>/<i>.png`` images plus a text file and an empty file named like images."""
    good = []
    for i in range(8):
        path = root / str(i % 2) / f"{i}.png"
        _image(path, 10 * i)
        good.append(path)
    text, empty = root / "1" / "notes.png", root / "0" / "empty.jpg"
    text.write_text("hello, I am not an image\n")
    empty.write_bytes(b"")
    return good, [text, empty]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", [0, 1], ids=["text-named-png", "empty-jpg"])
def test_bad_image_default_error_names_the_file(tmp_path: Path, which: int) -> None:
    _, bad = _image_tree(tmp_path / "images")
    (bad[1 - which]).unlink()  # only one bad file, so the error can only name it
    ds = sources.read_images(str(tmp_path / "images"))
    with pytest.raises(ValueError, match=re.escape(str(bad[which]))):
        list(raydl.RayDataLoader(ds, batch_size=4))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("remote", [False, True], ids=["pyarrow-local", "fsspec"])
def test_bad_images_skip_drops_exactly_those_files(tmp_path: Path, remote: bool) -> None:
    good, bad = _image_tree(tmp_path / "images")
    retry = raydl.RetryPolicy(attempts=1) if remote else None
    ds = sources.read_images(
        str(tmp_path / "images"), mode="L", retry=retry, on_bad_file="skip", override_num_blocks=3
    )
    loader = raydl.RayDataLoader(ds, batch_size=3, shuffle=True, seed=1)
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen = [
            (p, int(img.float().mean()))
            for b in loader
            for p, img in zip(b["path"], b["image"], strict=True)
        ]
        assert sorted(p for p, _ in seen) == sorted(str(p) for p in good)
        for path, mean in seen:  # the right pixels came with each path
            assert abs(mean - 10 * int(Path(path).stem)) <= 1, path
    skipped = _skipped_under(tmp_path)
    assert set(skipped) == {str(p) for p in bad}
    assert all("PIL couldn't load image" in reason for reason in skipped.values())


@pytest.mark.timeout(120)
def test_vanished_binary_file_default_error_names_it(tmp_path: Path) -> None:
    for i in range(6):
        (tmp_path / f"{i}.bin").write_bytes(bytes([i]) * 10)
    ds = sources.read_binary_files(str(tmp_path))  # listed here
    (tmp_path / "3.bin").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "3.bin"))):
        list(raydl.RayDataLoader(ds, batch_size=2))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("remote", [False, True], ids=["pyarrow-local", "fsspec"])
def test_vanished_binary_file_skip(tmp_path: Path, remote: bool) -> None:
    for i in range(6):
        (tmp_path / f"{i}.bin").write_bytes(bytes([i]) * 10)
    retry = raydl.RetryPolicy(attempts=1) if remote else None
    ds = sources.read_binary_files(str(tmp_path), retry=retry, on_bad_file="skip")
    (tmp_path / "3.bin").unlink()
    rows = {
        p: bytes(b)
        for batch in raydl.RayDataLoader(ds, batch_size=2)
        for p, b in zip(batch["path"], batch["bytes"], strict=True)
    }
    assert rows == {str(tmp_path / f"{i}.bin"): bytes([i]) * 10 for i in (0, 1, 2, 4, 5)}
    skipped = _skipped_under(tmp_path)
    assert set(skipped) == {str(tmp_path / "3.bin")}
    assert skipped[str(tmp_path / "3.bin")].startswith("FileNotFoundError")


@pytest.mark.timeout(120)
def test_ledger_records_each_file_once_over_epochs(tmp_path: Path) -> None:
    good, bad = _image_tree(tmp_path / "images")
    ds = sources.read_images(str(tmp_path / "images"), on_bad_file="skip")
    loader = raydl.RayDataLoader(ds, batch_size=4)
    for _ in range(3):
        assert sum(len(b["path"]) for b in loader) == len(good)
    entries = [e for e in skips.snapshot() if e["path"].startswith(str(tmp_path))]
    assert sorted(e["path"] for e in entries) == sorted(str(p) for p in bad)
    assert all(set(e) == {"path", "reason"} for e in entries)
    in_stats = loader.stats()["skipped_files"]  # what the loader reports to the user
    assert [e for e in in_stats if e["path"].startswith(str(tmp_path))] == entries
    loader.close()
