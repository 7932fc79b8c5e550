"""Errors a newcomer can act on, end to end: a dataset that cannot travel, a module workers cannot import."""

from __future__ import annotations

import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from raydl import RayDataLoader

_MODULE = """
import torch
from torch.utils.data import Dataset, IterableDataset


class Squares(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, index):
        return torch.tensor([index * index])


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.tensor([i]) for i in range(6))


def double(batch):
    return {"id": batch["id"] * 2}
"""


class LockedData(Dataset[torch.Tensor]):
    """Holds a lock, as a dataset guarding a reader might: fine with torch's fork, not pickled."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        with self._lock:
            return torch.tensor([index])


@pytest.fixture
def script_module(tmp_path: Path) -> Iterator[Any]:
    """A module importable in this process only: its folder is put on ``sys.path`` at run time."""
    name = f"newcomer_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(_MODULE)
    sys.path.insert(0, str(tmp_path))
    try:
        yield __import__(name)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["Squares", "Stream"])
def test_a_module_the_workers_cannot_import_is_named(script_module: Any, kind: str) -> None:
    name = script_module.__name__
    folder = str(Path(script_module.__file__).parent)
    # Every batch on the actor: loaded in the trainer while it starts (start_in_process),
    # the first batches would come from the trainer's own import, the error once it is up.
    loader = RayDataLoader(
        getattr(script_module, kind)(), batch_size=2, num_workers=1, start_in_process=False
    )
    with pytest.raises(
        ModuleNotFoundError,
        match=rf"^Ray worker 0 could not import module '{name}' while unpickling the dataset, "
        rf"worker_init_fn and collate_fn \(ModuleNotFoundError: No module named '{name}'\): "
        r"the loader's Ray worker processes import the modules .* importable in this process "
        rf"only \(this process imports it from {folder}\); a folder put on sys\.path at run "
        r"time does not reach them\. Install it as a package, or put its folder on PYTHONPATH "
        rf"before starting the script \(PYTHONPATH={folder}\), or ship it with Ray's "
        r"runtime_env=\{'py_modules': \[\.\.\.\]\} or \{'working_dir': \.\.\.\} "
        r"\(worker_options=\{'runtime_env': \.\.\.\} or ray\.init\)$",
    ) as caught:
        list(loader)
    assert caught.value.name == name
    # In process, the trainer's own import is used: the same dataset loads.
    assert len(list(RayDataLoader(getattr(script_module, kind)(), batch_size=2))) == 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shuffle_mode", ["files", "global"])
def test_a_stage_module_raydls_actors_cannot_import_is_named(
    script_module: Any, tmp_path: Path, shuffle_mode: str
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    import raydl

    for part in range(40):  # enough files that listing them all would drown the message
        pq.write_table(pa.table({"id": [part]}), tmp_path / f"part-{part:03d}.parquet")
    name = script_module.__name__
    ds = raydl.read_parquet(str(tmp_path)).map_batches(script_module.double)
    # Every run on the actors (while they start, runs would load in the trainer, which
    # imports the module).
    loader = RayDataLoader(
        ds, batch_size=4, shuffle=True, shuffle_mode=shuffle_mode, start_in_process=False
    )
    try:
        _raises_naming_the_module(loader, name)
    finally:
        loader.close()


def _raises_naming_the_module(loader: RayDataLoader, name: str) -> None:
    with pytest.raises(
        ModuleNotFoundError,
        match=rf"^a raydl actor could not import module '{name}' while unpickling the epoch's "
        r"read and Ray Data stages \(their functions and arguments\) \(ModuleNotFoundError: "
        rf"No module named '{name}'\): .* put its folder on PYTHONPATH before starting the "
        r"script .* \(ray\.init\(runtime_env=\.\.\.\) before the first raydl read or "
        r"loader\)$",
    ) as caught:
        list(loader)
    assert caught.value.name == name
    assert "part-0" not in str(caught.value)  # no list of the run's files


@pytest.mark.timeout(120)
def test_a_lock_in_the_dataset_is_named_before_any_worker_starts() -> None:
    loader = RayDataLoader(LockedData(), batch_size=2, num_workers=2)
    with pytest.raises(
        TypeError,
        match=r"^dataset\._lock \(a _thread\.lock\) cannot be pickled: with num_workers > 0 "
        r"the dataset, worker_init_fn and collate_fn travel to the loader's Ray actors "
        r"pickled .* or pass num_workers=0 to load in this process"
        # The loader's background start pickled it (and says so in a note).
        r"\nraised while raydl started Ray in the background",
    ):
        next(iter(loader))
    # The next iter() starts again in the trainer's thread: the same error, without the note.
    with pytest.raises(TypeError, match=r"to load in this process$"):
        next(iter(loader))
    # The fix the message offers works.
    assert [b.tolist() for b in RayDataLoader(LockedData(), batch_size=2)] == [
        [[0], [1]],
        [[2], [3]],
    ]


@pytest.mark.timeout(120)
def test_a_text_file_in_the_dataset_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "labels.txt"
    path.write_text("cat\ndog\n")
    with path.open() as labels:
        dataset = [labels]  # a list is a map-style dataset for torch
        with pytest.raises(
            TypeError, match=r"^dataset\[0\] is a file open in text mode \('.*labels\.txt'\)"
        ):
            next(iter(RayDataLoader(dataset, batch_size=None, num_workers=1)))
