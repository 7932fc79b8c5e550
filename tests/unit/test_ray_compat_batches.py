"""A direct-path stage's batches without Ray Data: the same as Ray Data's own, and Ray Data unimported.

``ray_compat/batches.py`` cuts numpy batches of plain blocks itself and hands
everything else to Ray Data's ``batch_blocks``. Both ways must give a stage the
same rows, dtypes and values; an array Ray gives writable must be writable here.
No cluster: Ray Data's batching runs in this process.
"""

from __future__ import annotations

import copy
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
from ray import cloudpickle
from ray.data import DataContext
from ray.data._internal.block_batching.block_batching import batch_blocks

from raydl._internal.epochs.direct import EpochWork, Stage
from raydl._internal.io.readers import ParquetRuns
from raydl._internal.ray_compat import batches as ours

pytestmark = pytest.mark.timeout(120)


def _tables() -> list[pa.Table]:
    """Blocks of one schema with every kind of plain column, an empty one among them."""
    ints = pa.array([1, None, 3, 4, 5, 6, 7], type=pa.int64())  # a null: floats in its batches
    table = pa.table(
        {
            "i": ints,
            "f": pa.array(np.linspace(0, 1, 7), type=pa.float32()),
            "n": pa.array(np.arange(7, dtype=np.int64)),  # no null: a view of its buffer
            "u": pa.array(np.arange(7, dtype=np.uint16)),
            "h": pa.array(np.linspace(0, 1, 7).astype(np.float16)),
            "ls": pa.array([str(i) * i for i in range(7)], type=pa.large_string()),
            "lb": pa.array([None] + [bytes([i]) for i in range(6)], type=pa.large_binary()),
            "b": pa.array([True, False] * 3 + [True]),
            "s": pa.array(["a", "b", None, "d", "e", "f", "g"]),
            "bytes": pa.array([bytes([i]) * i for i in range(7)], type=pa.binary()),
            "list": pa.array([[i] * (i % 3) for i in range(7)], type=pa.list_(pa.int32())),
            "t": pa.array(np.arange(7).astype("datetime64[ms]")),
            "d": pa.array(["x", "y", "x", "z", "y", "x", "z"]).dictionary_encode(),
        }
    )
    chunked = pa.concat_tables([table.slice(0, 3), table.slice(3)])  # two chunks per column
    return [table, table.slice(0, 0), chunked, table.slice(5)]


def _dicts() -> list[dict[str, np.ndarray]]:
    """A previous stage's outputs: numeric arrays, one of them three-dimensional."""
    rng = np.random.default_rng(0)
    return [
        {"x": rng.random(n), "img": rng.integers(0, 255, (n, 2, 3), dtype=np.uint8)}
        for n in (5, 0, 9, 1)
    ]


def _same(mine: list[Any], theirs: list[Any]) -> None:
    assert len(mine) == len(theirs)
    for got, want in zip(mine, theirs, strict=True):
        assert list(got) == list(want)
        for name in want:
            assert got[name].dtype == want[name].dtype, name
            assert got[name].shape == want[name].shape, name
            if want[name].dtype == object:
                for a, b in zip(got[name], want[name], strict=True):
                    assert np.array_equal(np.asarray(a), np.asarray(b)), name
            else:
                np.testing.assert_array_equal(got[name], want[name], err_msg=name)
            if want[name].flags.writeable:
                assert got[name].flags.writeable, f"{name} is read-only here, writable in Ray Data"


def _ray(blocks: list[Any], batch_size: int | None, ensure_copy: bool) -> list[Any]:
    from ray.data.block import BlockAccessor

    arrow = [BlockAccessor.batch_to_block(b) if isinstance(b, dict) else b for b in blocks]
    return list(
        batch_blocks(
            iter(arrow), batch_size=batch_size, batch_format="numpy", ensure_copy=ensure_copy
        )
    )


def _mine(blocks: list[Any], batch_size: int | None, ensure_copy: bool) -> list[Any]:
    with ours.RayData(None) as ray_data:
        cut = ours.batches(
            blocks,
            batch_size=batch_size,
            batch_format="numpy",
            ensure_copy=ensure_copy,
            ray_data=ray_data,
        )
        return list(cut)


@pytest.mark.parametrize("batch_size", [None, 1, 3, 4, 100])
@pytest.mark.parametrize("ensure_copy", [False, True])
@pytest.mark.parametrize("blocks", [_tables, _dicts], ids=["arrow", "numeric_dicts"])
def test_plain_blocks_give_ray_datas_batches(
    blocks: Any, batch_size: int | None, ensure_copy: bool
) -> None:
    _same(_mine(blocks(), batch_size, ensure_copy), _ray(blocks(), batch_size, ensure_copy))


def test_whole_arrow_blocks_are_ray_datas_arrow_batches() -> None:
    """``batch_format="pyarrow"`` (or ``None``) without a batch size: each non-empty table as it
    is; a dict after the tables goes to Ray Data, which converts it."""
    tables = [*_tables(), pa.table({})]
    for batch_format in ("pyarrow", None):
        with ours.RayData(None) as ray_data:
            mine = list(
                ours.batches(
                    tables,
                    batch_size=None,
                    batch_format=batch_format,
                    ensure_copy=False,
                    ray_data=ray_data,
                )
            )
        theirs = list(batch_blocks(iter(tables), batch_size=None, batch_format=batch_format))
        assert len(mine) == len(theirs) == 3
        assert all(a.equals(b) for a, b in zip(mine, theirs, strict=True))
    table = pa.table({"x": np.arange(3, dtype=np.int64)})
    mixed = [table, {"x": np.arange(4, dtype=np.int64)}]
    with ours.RayData(None) as ray_data:
        mine = list(
            ours.batches(
                mixed,
                batch_size=None,
                batch_format="pyarrow",
                ensure_copy=False,
                ray_data=ray_data,
            )
        )
    assert [type(b) for b in mine] == [pa.Table, pa.Table]
    assert mine[1].column("x").to_pylist() == [0, 1, 2, 3]


@pytest.mark.parametrize("batch_size", [None, 4])
def test_a_block_it_does_not_batch_hands_the_rest_to_ray_data(batch_size: int | None) -> None:
    """Tensor columns (Ray's extension type), and a dict with an object column after plain
    tables: the rows not yet batched and the rest go to Ray Data, so the cut is Ray's."""
    from ray.data.block import BlockAccessor

    tensors = [
        BlockAccessor.batch_to_block({"x": np.arange(12, dtype=np.int64).reshape(6, 2)}),
        BlockAccessor.batch_to_block({"x": np.arange(6, dtype=np.int64).reshape(3, 2)}),
    ]
    _same(_mine(tensors, batch_size, False), _ray(tensors, batch_size, False))
    table = pa.table({"x": np.arange(3, dtype=np.int64), "s": ["a", "b", "c"]})
    mixed = [table, table, {"x": np.arange(3), "s": np.array(["d", "e", "f"], dtype=object)}]
    _same(_mine(mixed, batch_size, False), _ray(mixed, batch_size, False))


def test_dicts_ray_would_convert_are_converted_by_ray_data() -> None:
    """Complex numbers, another byte order and masked arrays become Python objects in Ray's
    round trip, and a read-only boolean array a writable copy: those go to Ray Data."""
    rows = 4
    odd = [
        {"c": np.arange(rows) * 1j},
        {"big_endian": np.arange(rows, dtype=">i8")},
        {"masked": np.ma.masked_array(np.arange(rows), mask=[0, 1, 0, 0])},
        {"flags": np.broadcast_to(np.True_, (rows,))},
    ]
    for block in odd:
        for batch_size in (None, 3):
            _same(_mine([block], batch_size, False), _ray([block], batch_size, False))


def test_a_table_with_a_repeated_column_name_fails_as_in_ray_data() -> None:
    column = pa.array([1, 2])
    table = pa.Table.from_arrays([column, column], names=["x", "x"])
    with pytest.raises(KeyError, match="exists 2 times"):
        _ray([table], None, False)
    with pytest.raises(KeyError, match="exists 2 times"):
        _mine([table], None, False)


def test_a_context_with_user_configs_is_current_for_the_whole_load() -> None:
    """A stage may read ``DataContext.get_current().get_config(...)``, as in Ray Data's tasks;
    a context without configs is made current only when Ray Data's code runs."""
    context = copy.deepcopy(DataContext.get_current())
    context.set_config("raydl_test_key", 7)
    travelled = pickle.loads(cloudpickle.dumps(ours.LazyContext(context)))
    assert travelled.eager
    previous = DataContext.get_current()
    with ours.RayData(travelled):
        assert DataContext.get_current().get_config("raydl_test_key") == 7
    assert DataContext.get_current() is previous
    plain = pickle.loads(cloudpickle.dumps(ours.LazyContext(copy.deepcopy(previous))))
    assert not plain.eager
    with ours.RayData(plain) as ray_data:
        assert DataContext.get_current() is previous
        ray_data.use()
        assert DataContext.get_current() is not previous
    assert DataContext.get_current() is previous


def test_whole_conversions_match_ray_data() -> None:
    from ray.data.block import BlockAccessor

    with ours.RayData(None) as ray_data:
        for table in _tables():
            want = BlockAccessor.for_block(table).to_batch_format("numpy")
            _same([ours.to_numpy(table, ray_data)], [want])
        output = {"x": np.arange(4), "s": np.array(["a", "b", "c", "d"], dtype=object)}
        want = BlockAccessor.for_block(BlockAccessor.batch_to_block(output)).to_batch_format(
            "numpy"
        )
        _same([ours.to_numpy(output, ray_data)], [want])  # an object column: Ray's round trip
        ours.validate_output(pa.table({"x": [1]}), ray_data)  # Ray's check lets a table pass
        with pytest.raises(ValueError, match="returned a value of type"):
            ours.validate_output(3, ray_data)
        with pytest.raises(ValueError, match="Returning a list of objects"):
            ours.validate_output([1], ray_data)


def _double_numpy(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"x": batch["x"] * 2}


def _double_arrow(table: pa.Table) -> dict[str, np.ndarray]:
    return {"x": table.column("x").to_numpy() * 2}


def _same_table(table: pa.Table) -> pa.Table:
    return table


@pytest.mark.parametrize(
    ("fn", "batch_format", "batch_size", "cut"),
    [
        (_double_numpy, "numpy", 4, [[0, 2, 4, 6], [8, 10, 12, 14], [16, 18]]),
        (_double_arrow, "pyarrow", None, [list(range(0, 20, 2))]),
        (_same_table, "pyarrow", None, [list(range(10))]),
    ],
    ids=["numpy", "pyarrow", "pyarrow_table_out"],
)
def test_an_actor_unpickles_and_runs_plain_work_without_importing_ray_data(
    tmp_path: Path, fn: Any, batch_format: str, batch_size: int | None, cut: list[list[int]]
) -> None:
    """An epoch's work (a parquet read, a stage, the epoch's context), in a fresh process."""
    path = tmp_path / "part.parquet"
    pq.write_table(pa.table({"x": np.arange(10, dtype=np.int64)}), path)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the stage, as __main__'s travel
    stage = Stage(
        name=f"MapBatches({fn.__name__})",
        fn=fn,
        fn_args=(),
        fn_kwargs={},
        batch_size=batch_size,
        batch_format=batch_format,
        zero_copy_batch=False,
    )
    schema = pq.read_schema(path)
    work = EpochWork(
        ParquetRuns(pafs.LocalFileSystem(), schema, False),
        (),
        (stage,),
        ours.LazyContext(DataContext.get_current()),
    )
    pickled = tmp_path / "work.pkl"
    try:
        pickled.write_bytes(cloudpickle.dumps(work))
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    code = (
        "import pickle, sys\n"
        f"work = pickle.loads(open({str(pickled)!r}, 'rb').read())\n"
        f"loaded = work.load([{str(path)!r}])\n"
        f"assert [b['x'].tolist() for b in loaded] == {cut!r}, loaded\n"
        "assert 'ray.data' not in sys.modules, 'Ray Data imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=90)
