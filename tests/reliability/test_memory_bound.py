"""Item 8: a dataset 5x larger than the object store, a slow consumer, bounded memory.

The module's Ray caps the object store at 100 MiB and writes the raylet's debug
state (pinned primary copies, spilled bytes) every 200 ms; a sampler thread reads
it, the spill directory and the trainer's private memory while the epoch runs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from _faulty import BlobData
from _probes import object_store_bytes, private_memory

from raydl import RayDataLoader

pytestmark = pytest.mark.slow

MIB = 2**20
CAP = 100 * MIB
DATASET_MIB = 500  # 5x the object store


@pytest.fixture(scope="module", autouse=True)
def capped_ray() -> Iterator[None]:
    """A private 2-CPU Ray whose object store holds 100 MiB."""
    saved = os.environ.get("RAY_TMPDIR")
    tmp = tempfile.mkdtemp(prefix="rdl")
    os.environ["RAY_TMPDIR"] = tmp
    try:
        ray.init(
            address="local",
            num_cpus=2,
            object_store_memory=CAP,
            include_dashboard=False,
            logging_level="WARNING",
            _system_config={"debug_dump_period_milliseconds": 200},
        )
        ray.data.DataContext.get_current().enable_progress_bars = False
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved


class MemorySampler:
    """Peak object-store use, spill and trainer memory, sampled while an epoch runs."""

    def __init__(self) -> None:
        self._session = Path(ray._private.worker._global_node.get_session_dir_path())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self.samples = 0
        self.pinned = 0  # primary copies in the object store (the raylet's view)
        self.spilled = 0  # bytes spilled at once (the raylet's view)
        self.spill_files = 0  # bytes in the spill directory at once
        self.private = 0  # the trainer's resident memory not shared with the store

    def __enter__(self) -> MemorySampler:
        self.private_before = private_memory()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            store = object_store_bytes()
            if store is not None:
                self.samples += 1
                self.pinned = max(self.pinned, store[0])
                self.spilled = max(self.spilled, store[1])
            self.spill_files = max(self.spill_files, self._spill_dir_bytes())
            self.private = max(self.private, private_memory())
            time.sleep(0.1)

    def _spill_dir_bytes(self) -> int:
        total = 0
        for folder in self._session.glob("ray_spilled_objects*"):
            for root, _, files in os.walk(folder):
                for name in files:
                    try:
                        total += os.path.getsize(os.path.join(root, name))
                    except OSError:
                        continue
        return total

    def report(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "pinned_mib": self.pinned / MIB,
            "spilled_mib": max(self.spilled, self.spill_files) / MIB,
            "private_growth_mib": (self.private - self.private_before) / MIB,
        }


def _check(sampler: MemorySampler) -> None:
    report = sampler.report()
    assert sampler.samples >= 3, report  # the raylet's state was really read
    assert sampler.pinned <= CAP, report
    # Streaming keeps the epoch in the store: nothing (or a little) goes to disk.
    assert max(sampler.spilled, sampler.spill_files) <= CAP // 4, report
    # The trainer holds a few batches, not the dataset.
    assert sampler.private - sampler.private_before <= CAP, report


@pytest.mark.timeout(180)
def test_ray_data_epoch_five_times_the_object_store_stays_bounded() -> None:
    rows = DATASET_MIB  # 1 MiB per row
    ds = ray.data.range_tensor(rows, shape=(128, 1024), override_num_blocks=50)
    loader = RayDataLoader(ds, batch_size=10)
    seen = 0
    with MemorySampler() as sampler:
        for batch in loader:
            seen += int(batch["data"].shape[0])
            time.sleep(0.02)  # the training step
        loader.close()
    assert seen == rows
    _check(sampler)


@pytest.mark.timeout(180)
def test_map_style_epoch_five_times_the_object_store_stays_bounded() -> None:
    samples = DATASET_MIB // 10  # 10 MiB per sample
    loader = RayDataLoader(BlobData(samples, mib=10), batch_size=1, num_workers=2)
    seen = []
    with MemorySampler() as sampler:
        for batch in loader:
            seen.append(int(batch[0, 0]))
            time.sleep(0.02)
        loader.close()
    assert seen == list(range(samples))
    _check(sampler)


def _blob_rows(batch: dict[str, Any]) -> dict[str, Any]:
    """Binary files -> (id, 1 MiB of uint8) rows; a file's first 8 bytes are its id."""
    import numpy as np

    data = np.stack([np.frombuffer(b, dtype=np.uint8) for b in batch["bytes"]])
    return {"id": data[:, :8].copy().view(np.int64)[:, 0], "data": data}


@pytest.mark.timeout(240)
def test_global_shuffle_of_an_epoch_past_the_object_store_spills_and_stays_bounded(
    tmp_path: Path,
) -> None:
    # The exchange keeps a whole epoch in the object store (its map phase must end before
    # the first batch): past the store, Ray spills it; the store and the trainer stay bounded.
    import numpy as np

    import raydl

    files = 250  # 2.5x the object store, 1 MiB each
    for i in range(files):
        body = np.random.default_rng(i).integers(0, 255, MIB - 8, dtype=np.uint8).tobytes()
        (tmp_path / f"{i:04d}.bin").write_bytes(np.int64(i).tobytes() + body)
    ds = raydl.read_binary_files(str(tmp_path)).map_batches(_blob_rows, batch_format="numpy")
    loader = RayDataLoader(ds, batch_size=4, shuffle=True, seed=0)  # 4 MiB batches
    seen = []
    with MemorySampler() as sampler:
        for batch in loader:
            seen.extend(batch["id"].tolist())
            time.sleep(0.02)  # the training step
        summary = str(loader.stats()["epochs"][-1]["ray_data"])
        loader.close()
    assert "global shuffle" in summary, summary  # it ran on raydl's actors
    assert sorted(seen) == list(range(files)) and seen != sorted(seen)
    report = sampler.report()
    print(report, summary)  # for docs/design/shuffle-and-order.md
    assert sampler.samples >= 3, report
    assert sampler.pinned <= CAP, report
    assert max(sampler.spilled, sampler.spill_files) >= CAP // 2, report  # Ray spilled it
    assert sampler.private - sampler.private_before <= CAP, report
