"""Errors a newcomer can act on, without Ray: a payload that cannot travel, a listing that finds nothing.

The payload (dataset, ``worker_init_fn``, ``collate_fn``) is pickled before any actor
starts; what cannot be pickled is named by its path. The readers list their files
before Ray starts (this tier forbids ``ray.init``, so an error raised after it would
fail these tests with ``RayStartedInUnitTest``).
"""

from __future__ import annotations

import functools
import pickle
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from ray import cloudpickle

import raydl
from raydl._internal.workers import payload
from raydl._internal.workers.payload import pickle_payload

pytestmark = pytest.mark.timeout(60)


class _Reader:
    def __init__(self, owner: Any) -> None:
        self.owner = owner  # a cycle back to the dataset
        self.rows = list(range(100))
        self._lock = threading.Lock()


class _LockedDataset:
    def __init__(self) -> None:
        self.name = "locked"
        self.reader = _Reader(self)

    def __getitem__(self, index: int) -> int:
        return index

    def __len__(self) -> int:
        return 4


class _Slotted:
    __slots__ = ("handle", "size")

    def __init__(self, path: Path) -> None:
        self.size = 3
        self.handle = path.open("rb")


def test_a_lock_in_the_dataset_is_named_by_its_path() -> None:
    with pytest.raises(
        TypeError,
        match=r"^dataset\.reader\._lock \(a _thread\.lock\) cannot be pickled: with "
        r"num_workers > 0 the dataset, worker_init_fn and collate_fn travel to the loader's "
        r"Ray actors pickled .*Create it lazily in __getitem__ or in worker_init_fn .*"
        r"pass num_workers=0 to load in this process$",
    ) as caught:
        pickle_payload(_LockedDataset(), None, None)
    assert "cannot pickle '_thread.lock' object" in str(caught.value.__cause__)


def test_a_binary_file_in_slots_is_named(tmp_path: Path) -> None:
    (tmp_path / "data.bin").write_bytes(b"abc")
    dataset = _Slotted(tmp_path / "data.bin")
    with pytest.raises(TypeError, match=r"^dataset\.handle \(a _io\.BufferedReader\) cannot"):
        pickle_payload(dataset, None, None)
    dataset.handle.close()


def test_a_nested_one_is_named_through_containers(tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(b"abc")
    held = _Slotted(tmp_path / "x")
    with pytest.raises(TypeError, match=r"^dataset\['train'\]\[1\]\.handle \(a _io\.Buff"):
        pickle_payload({"train": [None, held]}, None, None)
    held.handle.close()


def test_a_text_file_is_refused_not_copied(tmp_path: Path) -> None:
    path = tmp_path / "labels.txt"
    path.write_text("cat\ndog\n")
    with path.open() as text:
        holder = {"labels": text}
        # What would happen otherwise: cloudpickle sends a StringIO copy of the contents.
        assert type(pickle.loads(cloudpickle.dumps(holder))["labels"]).__name__ == "StringIO"
        with pytest.raises(
            TypeError,
            match=r"^dataset\['labels'\] is a file open in text mode \('.*labels\.txt'\): .*"
            r"each worker would get a StringIO copy of its contents, not the file\. Keep its "
            r"path and open it lazily in __getitem__ or in worker_init_fn, or pass num_workers=0",
        ):
            pickle_payload(holder, None, None)


def test_functions_closures_globals_and_partials_are_named() -> None:
    lock = threading.Lock()

    def collate(batch: Any) -> Any:
        with lock:
            return batch

    with pytest.raises(TypeError, match=r"^collate_fn\.<locals>\.lock \(a _thread\.lock\)"):
        pickle_payload([1, 2], None, collate)
    with pytest.raises(TypeError, match=r"^worker_init_fn\.args\[0\] \(a _thread\.lock\)"):
        pickle_payload([1, 2], functools.partial(print, lock), None)
    with pytest.raises(TypeError, match=r"^worker_init_fn\.__self__\.reader\._lock "):
        pickle_payload([1, 2], _LockedDataset().__getitem__, None)


def test_a_picklable_payload_round_trips_and_needs_no_ray() -> None:
    found: list[Any] = []
    thread = threading.Thread(
        target=lambda: found.append(pickle_payload([1, "a"], None, len)), name="probe"
    )
    thread.start()
    thread.join()
    dataset, init_fn, collate_fn = pickle.loads(found[0])
    assert dataset == [1, "a"] and init_fn is None and collate_fn is len
    assert not ray.is_initialized()


def test_the_search_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(payload, "MAX_ITEMS", 5)
    lock = threading.Lock()
    # Past MAX_ITEMS the list itself is named; still a clear error, and quick.
    with pytest.raises(TypeError, match=r"^dataset\.items \(a list\) cannot be pickled"):
        pickle_payload(_Items([0] * 50 + [lock]), None, None)
    monkeypatch.setattr(payload, "MAX_DEPTH", 3)
    chain: Any = lock
    for _ in range(10):
        chain = [chain]
    with pytest.raises(TypeError, match=r"^dataset\[0\]\[0\]\[0\] \(a list\) cannot be pickled"):
        pickle_payload(chain, None, None)


class _Items:
    def __init__(self, items: list[Any]) -> None:
        self.items = items


# -- listing errors, before Ray starts -------------------------------------------------


def _table(path: Path) -> None:
    pq.write_table(pa.table({"x": [1, 2]}), path)


def test_read_parquet_of_a_folder_without_parquet_files_names_it(tmp_path: Path) -> None:
    (tmp_path / "notes.csv").write_text("x\n1\n")
    (tmp_path / "_SUCCESS").write_text("")
    with pytest.raises(
        FileNotFoundError,
        match=r"^read_parquet found no files ending in \.parquet under "
        rf"{str(tmp_path)!r}.*\(1 other file, e\.g\. '.*notes\.csv'; names starting with "
        r"'\.' or '_' are left out\)\. Point paths at the files or their folder, or pass "
        r"file_extensions=\[\.\.\.\] to read files named otherwise$",
    ):
        raydl.read_parquet(str(tmp_path))
    assert not ray.is_initialized()


def test_an_empty_folder_is_named_for_every_listing_reader(tmp_path: Path) -> None:
    for read in (raydl.read_parquet, raydl.read_binary_files, raydl.read_images):
        with pytest.raises(
            FileNotFoundError, match=rf"^{read.__name__} found no files .*under {str(tmp_path)!r}"
        ):
            read(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"found no files ending in \.png or \.jpg"):
        raydl.read_images(str(tmp_path), file_extensions=["png", "jpg"], on_bad_file="skip")
    with pytest.raises(FileNotFoundError, match=r"^read_binary_files found no files under"):
        raydl.read_binary_files(str(tmp_path), shuffle="files")  # Ray's own reader
    assert not ray.is_initialized()


def test_a_missing_path_is_named_as_written_before_ray_starts(tmp_path: Path) -> None:
    _table(tmp_path / "a.parquet")
    missing = f"file://{tmp_path}/no-such-dir"
    for read in (raydl.read_parquet, raydl.read_binary_files, raydl.read_images):
        with pytest.raises(
            FileNotFoundError,
            match=rf"^{read.__name__}: path {missing!r} does not exist\. Check its spelling "
            r"and that it is reachable from this machine, or pass ignore_missing_paths=True "
            r"to read the paths that exist$",
        ):
            read([str(tmp_path / "a.parquet"), missing])
    assert not ray.is_initialized()


def test_files_filtered_out_say_by_what(tmp_path: Path) -> None:
    _table(tmp_path / "a.parquet")
    with pytest.raises(FileNotFoundError, match=r"partition_filter left none of the 1 files"):
        raydl.read_parquet(str(tmp_path), partition_filter=lambda paths: [])
    with pytest.raises(FileNotFoundError, match=r"skip_paths left none of the 1 files"):
        raydl.read_parquet(str(tmp_path), skip_paths=[str(tmp_path / "a.parquet")])
    with pytest.raises(FileNotFoundError, match=r"no-such.*does not exist"):
        raydl.read_parquet(str(tmp_path / "no-such"), ignore_missing_paths=False)
    with pytest.raises(FileNotFoundError, match=r"found no files ending in \.parquet under"):
        raydl.read_parquet(str(tmp_path / "no-such"), ignore_missing_paths=True)
    assert not ray.is_initialized()
