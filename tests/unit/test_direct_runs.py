"""How a simple file plan is cut into runs and how one run is loaded (no Ray cluster)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from ray.data import DataContext

from raydl._internal.epochs import direct
from raydl._internal.epochs.direct import DirectPlan, EpochWork, Stage, runs
from raydl._internal.io.files import FileListDatasource
from raydl._internal.ray_compat import batches


def _listed(count: int, size: int | None) -> list[tuple[str, int | None]]:
    return [(f"/data/{i:05d}.jpg", size) for i in range(count)]


@pytest.mark.timeout(30)
def test_runs_cover_every_file_once_in_order() -> None:
    listed = _listed(5000, 700)
    cut = runs(listed)
    assert [path for run in cut for path in run] == [path for path, _ in listed]
    sizes = {len(run) for run in cut}
    assert max(sizes) - min(sizes) <= 1  # equal shares
    assert len(cut) == direct.MIN_RUNS  # 5,000 files are 16 runs of 312-313
    assert runs(listed) == cut  # a pure function of the list


@pytest.mark.timeout(30)
def test_runs_are_bounded_by_files_and_bytes_and_never_empty() -> None:
    many = runs(_listed(20 * direct.FILES_PER_RUN, None))
    assert len(many) == 20 and all(len(run) == direct.FILES_PER_RUN for run in many)
    big = runs(_listed(40, direct.BYTES_PER_RUN // 2))  # two files per run at most
    assert len(big) == 20
    few = runs(_listed(3, 10))
    assert [len(run) for run in few] == [1, 1, 1]
    assert runs([]) == []


def _double(batch: dict[str, np.ndarray], factor: int) -> dict[str, np.ndarray]:
    return {"n": np.array([len(b) for b in batch["bytes"]]) * factor, "path": batch["path"]}


def _work(tmp_path: Path, stages: tuple[Stage, ...], on_bad_file: str = "raise") -> EpochWork:
    source = FileListDatasource(
        [], pafs.LocalFileSystem(), include_paths=True, on_bad_file=on_bad_file
    )
    return DirectPlan(source, stages, 1.0, None, ()).work(DataContext.get_current())


def _stage(fn: Any, batch_size: int | None, *args: Any) -> Stage:
    return Stage(
        name=f"MapBatches({fn.__name__})",
        fn=fn,
        fn_args=args,
        fn_kwargs={},
        batch_size=batch_size,
        batch_format="numpy",
        zero_copy_batch=True,
    )


@pytest.mark.timeout(30)
def test_a_run_is_read_then_mapped_batch_by_batch_in_file_order(tmp_path: Path) -> None:
    paths = []
    for i in range(7):
        path = tmp_path / f"{i}.bin"
        path.write_bytes(b"x" * (i + 1))
        paths.append(str(path))
    seen: list[int] = []

    def count(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        seen.append(len(batch["bytes"]))
        return batch

    blocks = _work(tmp_path, (_stage(count, 3), _stage(_double, None, 10))).load(paths)
    assert seen == [3, 3, 1]  # the first stage's batch_size
    assert np.concatenate([b["n"] for b in blocks]).tolist() == [10 * (i + 1) for i in range(7)]
    assert np.concatenate([b["path"] for b in blocks]).tolist() == paths
    # No stage: the read's block, as Ray Data's numpy batch.
    (only,) = _work(tmp_path, ()).load(paths[:2])
    assert only["bytes"].tolist() == [b"x", b"xx"]


@pytest.mark.timeout(30)
def test_a_stages_bad_output_gets_ray_datas_error(tmp_path: Path) -> None:
    path = tmp_path / "a.bin"
    path.write_bytes(b"a")

    def returns_a_list(batch: dict[str, np.ndarray]) -> Any:
        return [1, 2]

    with pytest.raises(ValueError, match="Returning a list of objects from `map_batches`"):
        _work(tmp_path, (_stage(returns_a_list, None),)).load([str(path)])


@pytest.mark.timeout(30)
def test_numeric_outputs_are_kept_and_others_go_through_arrow(tmp_path: Path) -> None:
    image = np.arange(12, dtype=np.float32).reshape(3, 1, 2, 2)
    with batches.RayData(None) as ray_data:
        kept = batches.to_numpy({"image": image, "id": np.arange(3)}, ray_data)
        assert kept["image"] is image
        table = batches.to_numpy(pa.table({"s": ["a", "b"]}), ray_data)
        assert table["s"].tolist() == ["a", "b"]
        with pytest.raises(Exception, match=r"length|same"):  # unequal columns: Ray's own error
            batches.to_numpy({"a": np.arange(3), "b": np.arange(2)}, ray_data)
