"""Item 12: empty, tiny and inconsistent inputs give a defined result or a clear error.

Where torch's ``DataLoader`` defines the result (map-style sources), raydl must
give the same batches or raise the same error; for Ray Data sources the result
is stated here. Nothing may hang: every loader runs with a ``timeout``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch
from _faulty import SizedData
from torch.utils.data import DataLoader, DistributedSampler

import raydl
from raydl import RayDataLoader, World
from raydl._internal.runtime import env as raydl_env

HERE = Path(__file__).parent


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster: None) -> None:
    """Every test of this module runs against the module's 2-CPU cluster."""


def _outcome(make: Any) -> Any:
    """The batches (as lists) a loader built by ``make()`` yields, or the error it raises."""
    try:
        loader = make()
        batches = [b.tolist() if isinstance(b, torch.Tensor) else b for b in loader]
    except Exception as err:
        return (type(err).__name__, str(err))
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    return batches


# ------------------------------------------------------------------ map-style, against torch

MAP_CASES = {
    "empty": (0, {"batch_size": 4}),
    "empty_shuffle": (0, {"batch_size": 4, "shuffle": True}),
    "empty_drop_last": (0, {"batch_size": 4, "drop_last": True}),
    "empty_unbatched": (0, {"batch_size": None}),
    "empty_workers": (0, {"batch_size": 4, "num_workers": 2}),
    "big_batch": (5, {"batch_size": 8}),
    "big_batch_drop_last": (5, {"batch_size": 8, "drop_last": True}),
    "big_batch_shuffle_drop_last": (5, {"batch_size": 8, "shuffle": True, "drop_last": True}),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(MAP_CASES))
def test_map_style_edge_input_matches_torch(case: str) -> None:
    n, kwargs = MAP_CASES[case]
    # torch's workers are processes of their own; the result does not depend on them
    torch_kwargs = {k: v for k, v in kwargs.items() if k != "num_workers"}
    expected = _outcome(lambda: DataLoader(SizedData(n), **torch_kwargs))
    # On Ray actors (num_workers=0 loads in this process, where a timeout cannot apply).
    on_actors = {"num_workers": 1, **kwargs}
    got = _outcome(lambda: RayDataLoader(SizedData(n), timeout=30, **on_actors))
    assert got == expected
    if isinstance(expected, list):
        assert len(RayDataLoader(SizedData(n), **on_actors)) == len(
            DataLoader(SizedData(n), **torch_kwargs)
        )


@pytest.mark.timeout(60)
def test_map_style_fewer_rows_than_ranks_pads_like_torch() -> None:
    """Two ranks built by hand, one row (no process group: map-style needs none with an address)."""
    address = ray.get_runtime_context().gcs_address
    for rank in range(2):
        sampler = DistributedSampler(SizedData(1), num_replicas=2, rank=rank, shuffle=False)
        expected = [b.tolist() for b in DataLoader(SizedData(1), batch_size=2, sampler=sampler)]
        loader = RayDataLoader(
            SizedData(1), batch_size=2, world=World(rank, 2), ray_address=address, timeout=30,
            num_workers=1,
        )  # fmt: skip
        assert [b.tolist() for b in loader] == expected == [[[0]]], rank
        assert len(loader) == len(expected)
        loader.close()


# ------------------------------------------------------------------ Ray Data, one rank


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("plain", {}),
        ("global_shuffle", {"shuffle": True}),
        ("blocks_shuffle", {"shuffle": True, "shuffle_mode": "blocks"}),
        ("drop_last", {"drop_last": True}),
    ],
)
def test_empty_ray_dataset_yields_no_batch(name: str, kwargs: dict[str, Any]) -> None:
    loader = RayDataLoader(ray.data.range(0), batch_size=4, timeout=30, seed=0, **kwargs)
    assert len(loader) == 0
    assert list(loader) == []
    assert list(loader) == []  # and again, next epoch
    loader.close()


@pytest.mark.timeout(60)
def test_ray_dataset_filtered_to_nothing_yields_no_batch() -> None:
    loader = RayDataLoader(ray.data.range(10).filter(lambda row: False), batch_size=4, timeout=30)
    with pytest.raises(TypeError, match="materialize"):
        len(loader)  # the row count is only known after executing
    assert list(loader) == []
    loader.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("drop_last", "expected"), [(False, [[0, 1, 2, 3, 4]]), (True, [])])
def test_ray_data_batch_larger_than_dataset(drop_last: bool, expected: list[list[int]]) -> None:
    loader = RayDataLoader(ray.data.range(5), batch_size=8, drop_last=drop_last, timeout=30)
    assert [b["id"].tolist() for b in loader] == expected
    assert len(loader) == len(expected)
    loader.close()


# ------------------------------------------------------------------ schema drift


def _parquet(tmp_path: Path, *tables: pa.Table) -> str:
    for i, table in enumerate(tables):
        pq.write_table(table, tmp_path / f"part-{i}.parquet")
    return str(tmp_path)


def _batches(path: str, reader: str = "ray") -> list[dict[str, Any]]:
    # Ray's reader packs these small files into one block (one task); raydl's reads
    # one file per task, so there the files meet only in the loader.
    ds = ray.data.read_parquet(path) if reader == "ray" else raydl.read_parquet(path)
    loader = RayDataLoader(ds, batch_size=4, timeout=30)
    batches = list(loader)
    loader.close()
    return batches


BASE = pa.table({"id": np.arange(4), "x": np.arange(4, dtype=np.float32)})


DRIFTED = pa.table(
    {"id": np.arange(4, 8), "x": np.arange(4, 8, dtype=np.float64), "y": np.arange(4)}
)


@pytest.fixture(scope="module", params=["ray", "raydl"])
def drifted(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    """One epoch over two files, the second with ``x`` as float64 (not float32) and ``y`` more.

    Read once per reader for the two tests below (a parquet read costs seconds here).
    Ray's V1 parquet reader (under raydl.read_parquet) took the first file's schema and
    dropped ``y`` without a word until raydl unified the footers' schemas itself.
    """
    return _batches(_parquet(tmp_path_factory.mktemp("drift"), BASE, DRIFTED), request.param)


@pytest.mark.timeout(60)
def test_schema_drift_wider_dtype_and_extra_column_are_unified(
    drifted: list[dict[str, Any]],
) -> None:
    batches = drifted
    assert all(set(b) == {"id", "x", "y"} for b in batches)
    assert {b["x"].dtype for b in batches} == {torch.float64}
    rows = {
        int(i): (x, y)
        for b in batches
        for i, x, y in zip(b["id"].tolist(), b["x"].tolist(), b["y"].tolist(), strict=True)
    }
    assert sorted(rows) == list(range(8))
    assert [rows[i][0] for i in range(8)] == [float(i) for i in range(8)]
    assert all(np.isnan(rows[i][1]) for i in range(4))  # the file without "y": nulls
    assert [rows[i][1] for i in range(4, 8)] == [0, 1, 2, 3]


@pytest.mark.timeout(60)
def test_schema_drift_missing_column_has_one_dtype_in_every_batch(
    drifted: list[dict[str, Any]],
) -> None:
    """Was float64 (NaN) in batches from the file without ``y`` and int64 in the others.

    raydl.read_parquet makes an integer column missing from some files float64 in its
    schema; with Ray's reader the files share a block here, so Arrow unifies them.
    """
    batches = drifted
    assert {b["y"].dtype for b in batches} == {torch.float64}, [b["y"].dtype for b in batches]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reader", ["ray", "raydl"])
def test_schema_drift_incompatible_types_is_a_clear_error(tmp_path: Path, reader: str) -> None:
    strings = pa.table({"id": np.arange(4, 8), "x": [str(i) for i in range(4)]})
    path = _parquet(tmp_path, BASE, strings)
    started = time.monotonic()
    with pytest.raises((pa.ArrowTypeError, pa.ArrowInvalid, TypeError, ValueError)) as info:
        _batches(path, reader)
    assert time.monotonic() - started < 30
    assert "x" in str(info.value) and "string" in str(info.value), info.value


# ------------------------------------------------------------------ Ray Data, two ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_two_ranks_with_fewer_rows_than_ranks_and_a_big_batch(tmp_path: Path) -> None:
    """Fewer rows than ranks and a batch larger than a rank's share, under torchrun.

    (Empty sources and ``drop_last`` are covered on one rank above; each case here
    costs a pipeline and a split coordinator, so the launch is kept to three.) The
    ranks join the module's cluster (its address and token), as jobs join a running
    cluster: a connection instead of a Ray start; rank 0's embedded start under
    torchrun is tests/multirank/test_torchrun.py's.
    """
    record = tmp_path / "edge"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    env["RAY_AUTH_TOKEN"] = raydl_env.ray_auth_token() or ""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}",
            str(HERE / "_edge_ranks.py"),
            str(record),
        ],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads(Path(f"{record}.rank{r}").read_text()) for r in (0, 1)]
    for case in ranks[0]:
        got = [ranks[r][case] for r in (0, 1)]
        assert all("error" not in g for g in got), (case, got)
        # the same number of batches on both ranks (a per-step all-reduce would not hang)
        assert got[0]["batches"] == got[1]["batches"] == got[0]["len"] == got[1]["len"], (case, got)
    # streaming_split(equal=True) drops up to world_size - 1 rows: one row is dropped
    assert [ranks[r]["ray_one_row"]["ids"] for r in (0, 1)] == [[], []]
    big = sorted(ranks[0]["ray_big_batch"]["ids"] + ranks[1]["ray_big_batch"]["ids"])
    assert big == list(range(10)) and ranks[0]["ray_big_batch"]["batches"] == 1
    # map-style: torch's DistributedSampler pads, so each rank gets the one row
    assert [ranks[r]["map_one_row"]["ids"] for r in (0, 1)] == [[0], [0]]
