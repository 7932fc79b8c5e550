"""Batches without a copy (issue 16): what raydl's actors made for this consumer is used in place.

A batch that raydl's actors produced for this consumer alone becomes tensors over
Ray's object store memory; anything that may be read again (a Ray Data block) is
copied. Either way a trainer writing into its batch (``x.sub_(mean)``) must not
change what another epoch reads: each source kind is checked over two epochs.
"""

from __future__ import annotations

import gc
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import raydl
from raydl import RayDataLoader
from raydl._internal.workers.convert import array_to_tensor, numpy_to_tensors, tensors_to_numpy

pytestmark = pytest.mark.timeout(120)

ROWS = 48
SHAPE = (3, 64, 64)  # 48 KiB a row: 3 rows are over Ray's 100 KiB inline limit (in the store)
BATCH = 12


def _row(i: int) -> np.ndarray:
    return np.full(SHAPE, float(i), dtype=np.float32)


def _in_object_store(tensor: torch.Tensor) -> bool:
    """Whether the tensor's memory is one of Ray's shared-memory (plasma) mappings."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return len(parts) > 5 and "plasma" in parts[5]
    return False


class Rows(Dataset[dict[str, Any]]):
    """Row ``i``: ``x`` full of ``i``, and its id."""

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.from_numpy(_row(i)), "id": i}


class RowStream(IterableDataset[dict[str, Any]]):
    """The same rows, each worker its share."""

    def __iter__(self) -> Any:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, ROWS, step):
            yield {"x": torch.from_numpy(_row(i)), "id": i}


def _parse(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    ids = np.array([int(Path(p).stem) for p in batch["path"]], dtype=np.int64)
    return {"x": np.stack([_row(i) for i in ids]), "id": ids}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("zero_copy")
    for i in range(ROWS):
        (root / f"{i:04d}.bin").write_bytes(b"x")
    return root


def _epoch_writing_in_place(loader: Any) -> tuple[dict[int, float], list[bool]]:
    """One epoch: each row's value as delivered, then the batch overwritten in place."""
    seen: dict[int, float] = {}
    in_store: list[bool] = []
    for batch in loader:
        x, ids = batch["x"], batch["id"]
        for row, i in zip(x, ids.tolist(), strict=True):
            assert torch.all(row == row.flatten()[0]), f"row {i} is not one value"
            seen[int(i)] = float(row.flatten()[0])
        in_store.append(_in_object_store(x))
        x.sub_(1000.0)  # the trainer normalises in place
        x.fill_(-1.0)
    return seen, in_store


def _two_epochs(loader: Any) -> list[bool]:
    """Two epochs that each write into every batch; the second must read the original rows."""
    expected = {i: float(i) for i in range(ROWS)}
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "error", message=".*not writable.*"
        )  # torch's warning leaks no more
        first, stored = _epoch_writing_in_place(loader)
        second, _ = _epoch_writing_in_place(loader)
    assert first == expected
    assert second == expected
    return stored


def test_map_style_batches_are_the_object_stores_and_epochs_stay_intact() -> None:
    loader = RayDataLoader(  # every batch from the actors (none loaded in the trainer)
        Rows(), batch_size=BATCH, num_workers=2, persistent_workers=True, start_in_process=False
    )
    stored = _two_epochs(loader)
    assert all(stored), "a map-style batch was copied out of the object store"
    loader.close()


def test_map_style_batches_loaded_in_the_trainer_keep_epochs_intact_too() -> None:
    """The first batches load in the trainer while the actors start (``start_in_process``)."""
    loader = RayDataLoader(Rows(), batch_size=BATCH, num_workers=2, persistent_workers=True)
    stored = _two_epochs(loader)
    assert not stored[0], "the first batch did not load in the trainer"  # the actors start
    loader.close()


def test_iterable_batches_are_the_object_stores_and_epochs_stay_intact() -> None:
    loader = RayDataLoader(RowStream(), batch_size=BATCH, num_workers=2)
    stored = _two_epochs(loader)
    assert all(stored), "an iterable batch was copied out of the object store"
    loader.close()


def test_a_materialized_ray_dataset_is_copied_so_writes_do_not_reach_it() -> None:
    ds = ray.data.from_items([{"x": _row(i), "id": i} for i in range(ROWS)]).materialize()
    loader = RayDataLoader(ds, batch_size=BATCH)
    stored = _two_epochs(loader)
    assert not any(stored), "a Ray Data batch was handed over in the object store's memory"
    assert {int(r["id"]): float(r["x"].flat[0]) for r in ds.take_all()} == {
        i: float(i) for i in range(ROWS)
    }
    loader.close()


@pytest.mark.parametrize("shuffle", [False, True], ids=["streaming", "global"])
def test_raydl_direct_runs_are_not_copied_and_epochs_stay_intact(
    folder: Path, shuffle: bool
) -> None:
    ds = raydl.read_binary_files(str(folder), include_paths=True).map_batches(
        _parse, batch_size=8, batch_format="numpy"
    )
    # 48 files in 16 runs (direct.MIN_RUNS): 3-row blocks, so 3-row batches are blocks.
    # Every run on the actors: runs loaded in the trainer while they start are not in the store.
    loader = RayDataLoader(ds, batch_size=3, shuffle=shuffle, seed=0, start_in_process=False)
    stored = _two_epochs(loader)
    summary = str(loader.stats()["epochs"][-1]["ray_data"])
    assert "raydl actors" in summary, summary
    if not shuffle:  # the runs' blocks, used where they are
        assert all(stored), "a direct batch was copied out of the object store"
    else:  # the reduce gathered the rows into fresh memory; that one copy is all
        assert not any(stored)
    loader.close()


def test_an_owned_array_outlives_its_object_ref_and_the_store_does_not_reuse_it() -> None:
    ref = ray.put(tensors_to_numpy(torch.full((1 << 20,), 7.0)))  # 4 MiB, in the store
    tensor = numpy_to_tensors(ray.get(ref), owned=True)
    assert _in_object_store(tensor)
    del ref
    gc.collect()
    # Objects of the same size, put after ours was dropped, would land on its memory if
    # the store had freed it.
    others = [ray.put(np.full(1 << 20, float(k), dtype=np.float32)) for k in range(4)]
    arrays = [ray.get(other) for other in others]
    assert torch.all(tensor == 7.0)
    for array in arrays:
        assert not np.shares_memory(array, tensor.numpy())
    tensor.add_(1.0)  # the mapping is writable
    assert torch.all(tensor == 8.0)
    del arrays, others


def test_an_array_not_owned_is_copied_out_of_the_store() -> None:
    array = ray.get(ray.put(np.ones(1 << 18, dtype=np.float32)))
    assert not array.flags.writeable
    tensor = array_to_tensor(array, owned=False)
    assert not _in_object_store(tensor)
    tensor.zero_()
    assert array.sum() == 1 << 18
