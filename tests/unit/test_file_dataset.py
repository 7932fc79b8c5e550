"""raydl's own plan of a raydl read (``FileDataset``) reads as Ray Data's plan of it would.

No Ray: Ray Data's plan of the same read is built without it (``to_ray`` with Ray
down builds as ``ray.data.read_datasource`` would), and compared field by field.
"""

from __future__ import annotations

import functools
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from raydl._internal.epochs.direct import direct_plan
from raydl._internal.epochs.plan import plan_epoch, stage_names
from raydl._internal.io.file_dataset import FileDataset, plan_of
from raydl._internal.io.files import FileListDatasource, own_source
from raydl._internal.io.parquet import read_dataset
from raydl._internal.io.readers import packed
from raydl._internal.ray_compat import plans
from raydl._internal.ray_compat.datasets import known_row_count


def double(batch: dict[str, Any], factor: int = 2) -> dict[str, Any]:
    return batch


class Scaler:
    def scale(self, batch: dict[str, Any]) -> dict[str, Any]:
        return batch

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        return batch


def _binary(tmp_path: Path, count: int = 5) -> FileDataset:
    files = []
    for i in range(count):
        path = tmp_path / f"{i:02d}.bin"
        path.write_bytes(bytes([i]) * (i + 1))
        files.append((str(path), i + 1))
    source = FileListDatasource(
        files, pafs.LocalFileSystem(), include_paths=True, on_bad_file="raise"
    )
    return FileDataset(source, read_options={}, cpus=2)


def _parquet(tmp_path: Path) -> FileDataset:
    files = []
    for i in range(3):
        path = tmp_path / f"part-{i}.parquet"
        pq.write_table(pa.table({"x": np.arange(10 * i, 10 * i + 7)}), path)
        files.append((str(path), path.stat().st_size))
    dataset = read_dataset(
        pafs.LocalFileSystem(),
        files,
        on_bad_file="raise",
        columns=None,
        include_paths=False,
        options={},
        cpus=2,
    )
    assert isinstance(dataset, FileDataset)
    return dataset


STAGES = {
    "defaults": (double, {}),
    "sized": (double, {"batch_size": 64}),
    "unsized": (double, {"batch_size": None}),
    "pandas": (double, {"batch_format": "pandas"}),
    "pyarrow": (double, {"batch_format": "pyarrow", "zero_copy_batch": False}),
    "no format": (double, {"batch_format": None}),
    "default format": (double, {"batch_format": "default"}),
    "arguments": (double, {"fn_args": (3,), "fn_kwargs": {"factor": 4}}),
    "half a cpu": (double, {"num_cpus": 0.5}),
    "one cpu": (double, {"num_cpus": 1}),
    "lambda": (lambda batch: batch, {"batch_size": 8}),
    "partial": (functools.partial(double, factor=3), {}),
    "method": (Scaler().scale, {}),
    "callable object": (Scaler(), {}),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(STAGES))
def test_a_recorded_stage_reads_as_ray_datas_own_plan_of_it(tmp_path: Path, case: str) -> None:
    fn, kwargs = STAGES[case]
    ours = _binary(tmp_path).map_batches(fn, **kwargs).map_batches(double, batch_size=16)
    assert isinstance(ours, FileDataset)
    theirs = plans.read_then_map_batches(ours.to_ray())
    mine = ours.plain_plan()
    assert theirs is not None and mine is not None
    (my_read, my_stages), (ray_read, ray_stages) = mine, theirs
    assert my_stages == ray_stages
    assert my_read.name == ray_read.name == "ReadBinaryFiles"
    assert own_source(ray_read.datasource) is my_read.datasource is ours.source
    assert (my_read.ray_remote_args, my_read.concurrency) == (
        ray_read.ray_remote_args,
        ray_read.concurrency,
    )
    assert stage_names(ours) == plans.stage_names(ours.to_ray())
    direct, via_ray = direct_plan(ours), direct_plan(ours.to_ray())
    assert direct is not None and via_ray is not None
    assert (direct.stages, direct.num_cpus, direct.concurrency, direct.names) == (
        via_ray.stages,
        via_ray.num_cpus,
        via_ray.concurrency,
        via_ray.names,
    )
    assert direct.source is ours.source and via_ray.source is ours.source


OTHER_CALLS = {
    "an actor class": (Scaler, {"concurrency": 1}),
    "concurrency": (double, {"concurrency": 2}),
    "gpus": (double, {"num_gpus": 0, "batch_size": 4}),
    "auto size": (double, {"batch_size": "auto"}),
    "remote args": (double, {"max_retries": 1}),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(OTHER_CALLS))
def test_any_other_map_batches_call_is_ray_datas(tmp_path: Path, case: str) -> None:
    import ray.data

    fn, kwargs = OTHER_CALLS[case]
    base = _binary(tmp_path).map_batches(double)
    out = base.map_batches(fn, **kwargs)
    assert isinstance(out, ray.data.Dataset)
    assert plans.stage_names(out) == plans.stage_names(base.to_ray().map_batches(fn, **kwargs))
    with pytest.raises(ValueError, match="Batch size can't be negative or 0"):
        base.map_batches(double, batch_size=0)  # Ray's own check and message


@pytest.mark.timeout(60)
def test_every_other_attribute_is_the_ray_plans_built_once(tmp_path: Path) -> None:
    import ray.data

    dataset = _binary(tmp_path).map_batches(double, batch_size=2)
    filtered = dataset.filter(lambda row: True)
    assert isinstance(filtered, ray.data.Dataset)
    assert dataset.to_ray() is dataset.to_ray()
    assert plans.stage_names(filtered)[:2] == ("ReadBinaryFiles", "MapBatches(double)")
    assert repr(dataset) == "FileDataset(ReadBinaryFiles -> MapBatches(double), 5 files)"
    assert bool(dataset)  # as Ray's Dataset, whose len() and iter() refuse with a hint
    with pytest.raises(AttributeError, match=r"Use `ds.count\(\)`"):
        len(dataset)
    with pytest.raises(TypeError, match=r"aren.t iterable.*raydl\.RayDataLoader"):
        iter(dataset)
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy._ray is None and stage_names(copy) == stage_names(dataset)
    with pytest.raises(AttributeError):
        copy.__missing_dunder__  # noqa: B018


@pytest.mark.timeout(60)
def test_its_context_is_the_ray_plans_and_reaches_the_direct_epochs(tmp_path: Path) -> None:
    dataset = _binary(tmp_path).map_batches(double)
    assert not hasattr(dataset, "_repr_mimebundle_") and dataset._ray is None  # not built
    options: dict[str, Any] = {
        "shuffle": False,
        "shuffle_mode": "files",
        "local_shuffle_buffer_size": None,
        "seed": 0,
        "epoch": 0,
        "deterministic": True,
    }
    dataset.context.retried_io_errors = ["a flaky store"]  # as on a ray.data.Dataset
    assert dataset.context is dataset.to_ray().context
    plan = plan_epoch(dataset, **options)
    direct = direct_plan(plan.dataset)
    assert isinstance(plan.dataset, FileDataset) and direct is not None
    assert direct.work(plan.context).retried == ("a flaky store",)


@pytest.mark.timeout(60)
def test_read_options_it_does_not_take_make_ray_datas_plan_at_once(tmp_path: Path) -> None:
    import ray.data

    source = _binary(tmp_path).source
    assert isinstance(plan_of(source, {"override_num_blocks": 2}, 2), FileDataset)
    ray_plan = plan_of(source, {"num_cpus": 0.5}, 2)
    assert isinstance(ray_plan, ray.data.Dataset)
    assert own_source(plans.read_then_map_batches(ray_plan)[0].datasource) is source  # type: ignore[index]
    with pytest.raises(ValueError, match="override_num_blocks should be a positive int, got 'x'"):
        plan_of(source, {"override_num_blocks": "x"}, 2)


def test_an_empty_run_packs_into_empty_columns() -> None:
    assert packed([], pa.binary()).to_pylist() == []
    assert packed([b"", b"ab"], pa.string()).to_pylist() == ["", "ab"]


@pytest.mark.timeout(60)
def test_rows_are_known_as_ray_data_knows_them(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "p").mkdir()
    for dataset, rows in ((_binary(tmp_path / "b"), 5), (_parquet(tmp_path / "p"), 21)):
        assert known_row_count(dataset) == rows == known_row_count(dataset.to_ray())
        staged = dataset.map_batches(double)
        assert known_row_count(staged) is None is known_row_count(staged.to_ray())


@pytest.mark.timeout(60)
def test_a_files_shuffle_permutes_the_files_as_ray_datas_plan_does(tmp_path: Path) -> None:
    dataset = _binary(tmp_path, count=12).map_batches(double)
    options: dict[str, Any] = {
        "shuffle": True,
        "shuffle_mode": "files",
        "local_shuffle_buffer_size": 100,
        "seed": 7,
        "epoch": 3,
        "deterministic": False,
    }
    ours = plan_epoch(dataset, **options)
    theirs = plan_epoch(dataset, **options, ray_data=True)
    assert isinstance(ours.dataset, FileDataset)
    assert not isinstance(theirs.dataset, FileDataset)
    mine, via_ray = direct_plan(ours.dataset), direct_plan(theirs.dataset)
    assert mine is not None and via_ray is not None
    assert mine.source.files == via_ray.source.files != dataset.source.files
    assert (ours.local_shuffle_buffer_size, ours.local_shuffle_seed) == (
        theirs.local_shuffle_buffer_size,
        theirs.local_shuffle_seed,
    )
    blocks = plan_epoch(dataset, **{**options, "shuffle_mode": "blocks"})
    assert not isinstance(blocks.dataset, FileDataset)  # Ray Data's shuffle stage


@pytest.mark.timeout(60)
def test_planning_and_loading_a_run_import_neither_ray_data_nor_pandas(tmp_path: Path) -> None:
    # What a trainer does with a raydl read on the direct path: plan the epoch, and load
    # a run itself while Ray starts (its files' bytes and paths through a numeric stage;
    # a stage returning other columns takes Ray Data's conversions, as in Ray Data).
    for i in range(4):
        (tmp_path / f"{i}.bin").write_bytes(bytes([i]) * 3)
    code = f"""
import sys
import numpy as np
import pyarrow.fs as pafs
from raydl._internal.epochs.direct import direct_plan, EpochWork
from raydl._internal.epochs.plan import plan_epoch
from raydl._internal.io.file_dataset import FileDataset, plan_of
from raydl._internal.io.files import FileListDatasource
from raydl._internal.ray_compat.datasets import known_row_count

def total(batch):
    assert batch["path"].dtype == object and batch["bytes"].dtype == object
    return {{"sum": np.array([sum(b) for b in batch["bytes"]]), "n": np.array([len(batch["path"])] * len(batch["path"]))}}

files = [(f"{tmp_path}/{{i}}.bin", 3) for i in range(4)]
source = FileListDatasource(files, pafs.LocalFileSystem(), include_paths=True, on_bad_file="raise")
dataset = FileDataset(source, read_options={{}}, cpus=2).map_batches(total, batch_size=2)
plan = plan_epoch(dataset, shuffle=True, shuffle_mode="files", local_shuffle_buffer_size=8,
                  seed=1, epoch=0, deterministic=False)
direct = direct_plan(plan.dataset)
from raydl._internal.ray_compat.context import DEFAULT_RETRIED_IO_ERRORS
assert known_row_count(dataset) is None and plan.context is None
work = direct.work(plan.context)
assert work.retried == DEFAULT_RETRIED_IO_ERRORS  # Ray Data's defaults, without it
rows = work.load([path for path, _ in direct.source.files], own_context=False)
assert sorted(int(s) for batch in rows for s in batch["sum"]) == [0, 3, 6, 9], rows
heavy = [m for m in ("ray.data", "pandas") if m in sys.modules]
assert not heavy, heavy
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)


@pytest.mark.timeout(60)
def test_a_parquet_read_and_an_arrow_stage_import_neither_ray_data_nor_pandas(
    tmp_path: Path,
) -> None:
    # The tabular shape: parquet rows through a pyarrow stage, loaded in the trainer.
    for i in range(3):
        pq.write_table(pa.table({"x": np.arange(10 * i, 10 * i + 10)}), tmp_path / f"{i}.parquet")
    code = f"""
import os, sys
import pyarrow.fs as pafs
from raydl._internal.epochs.direct import direct_plan
from raydl._internal.epochs.plan import plan_epoch
from raydl._internal.io.parquet import read_dataset
from raydl._internal.io.readers import packed

def firsts(table):  # each file's first rows (Python values in pyarrow calls import pandas)
    return table.slice(0, 5)

paths = sorted(os.path.join("{tmp_path}", name) for name in os.listdir("{tmp_path}"))
files = [(path, os.path.getsize(path)) for path in paths]
dataset = read_dataset(pafs.LocalFileSystem(), files, on_bad_file="raise", columns=None,
                       include_paths=True, options={{}}, cpus=2)
dataset = dataset.map_batches(firsts, batch_format="pyarrow")
plan = plan_epoch(dataset, shuffle=False, shuffle_mode="files", local_shuffle_buffer_size=None,
                  seed=0, epoch=0, deterministic=True)
direct = direct_plan(plan.dataset)
rows = direct.work(None).load([path for path, _ in direct.source.files], own_context=False)
expected = [x for start in (0, 10, 20) for x in range(start, start + 5)]
assert sorted(int(x) for batch in rows for x in batch["x"]) == expected, rows
assert all(batch["path"].dtype == object for batch in rows)
heavy = [m for m in ("ray.data", "pandas") if m in sys.modules]
assert not heavy, heavy
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)


def test_only_whole_file_reads_with_numpy_stages_are_planned_without_pandas(
    tmp_path: Path,
) -> None:
    """What the fork server shares: pandas, unless the direct plan's actors most likely
    never import it (``DirectPlan.without_pandas``)."""
    binary = _binary(tmp_path)
    plans_ = {
        "read": binary,
        "numpy stage": binary.map_batches(double),
        "numpy stages": binary.map_batches(double).map_batches(double, batch_format="numpy"),
        "arrow stage": binary.map_batches(double, batch_format="pyarrow"),
        "pandas stage": binary.map_batches(double).map_batches(double, batch_format="pandas"),
        "parquet": _parquet(tmp_path),
        "parquet, numpy stage": _parquet(tmp_path).map_batches(double),
    }
    without = {}
    for name, dataset in plans_.items():
        plan = direct_plan(dataset)
        assert plan is not None, name
        without[name] = plan.without_pandas
    assert without == {
        "read": True,
        "numpy stage": True,
        "numpy stages": True,
        "arrow stage": False,
        "pandas stage": False,
        "parquet": False,
        "parquet, numpy stage": False,
    }
