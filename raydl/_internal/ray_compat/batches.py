"""``map_batches``'s batching and conversions, to run stages outside Ray Data (direct execution).

A direct-path run goes from a read's Arrow tables through each stage's function
to numpy batches, as a Ray Data task would take it. The common cases are done here
without importing Ray Data (about 60 MB and a CPU-second per actor, pandas
included): Arrow batches of whole Arrow blocks (``batch_format="pyarrow"`` without
a batch size: each block as it is), and numpy batches (``batch_format="numpy"``,
the default) of

* Arrow tables whose columns Ray converts with pyarrow's own ``to_numpy``
  (numbers, strings, bytes, lists, timestamps: every type but Ray's extension
  types and the null type), converted by that same call, and
* a stage's output that is a dict of numeric arrays of one length, which Ray's
  round trip through an Arrow block gives back unchanged, kept as it is.

Their batches have the same rows and equal arrays as Ray's (:func:`check` and
``tests/unit/test_ray_compat_batches.py`` compare them); an array Ray gives
read-only may here be writable, never the reverse. Anything else (another
batch format, a pandas frame, an extension column) goes to Ray Data's own code,
imported on first need, with the epoch's ``DataContext`` current from then on
(:class:`RayData`). Relies on these private parts of Ray Data:

* ``batch_blocks`` (``ray.data._internal.block_batching.block_batching``): Ray's
  cutting of blocks into formatted batches, with ``batch_size``, ``batch_format``
  and ``ensure_copy``;
* ``_validate_batch_output`` (``ray.data._internal.planner.plan_udf_map_op``):
  the check ``map_batches`` applies to what a function returns;
* ``DataContext._set_current``, which installs a context in a worker (and
  returns the one it replaces).
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["LazyContext", "RayData", "batches", "check", "to_block", "to_numpy", "validate_output"]

#: Column bytes above which combining a column's chunks may overflow Arrow's 32-bit offsets:
#: Ray then combines them in parts; such columns take Ray's own conversion.
_COMBINE_LIMIT = (1 << 31) - 1


class LazyContext:
    """A ``ray.data.DataContext`` that travels pickled and is unpickled on first use.

    Unpickling a ``DataContext`` imports Ray Data; an actor whose runs never need Ray
    Data's conversions never pays for it.
    """

    def __init__(self, context: Any) -> None:
        """Carry ``context`` (``None``: none; a load keeps the process's current one)."""
        import ray.cloudpickle

        self._pickled = ray.cloudpickle.dumps(context)
        self._context: Any = context
        #: Whether the user set configs (``set_config``) that a stage may read: then the
        #: context is made current for a whole load, as in Ray Data's own tasks.
        self.eager = bool(getattr(context, "_kv_configs", None))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_context": None}

    def get(self) -> Any:
        """The context (this process's own object where it was made)."""
        if self._context is None:
            self._context = pickle.loads(self._pickled)
        return self._context


class RayData:
    """Ray Data's conversions for one load, with ``context`` current once one is used.

    ``context``: ``None`` leaves the process's current context alone (the training
    process, whose other threads may read it); one with user configs
    (:attr:`LazyContext.eager`) is made current at once. Close it (or use it as a context
    manager) to put the previous context back.
    """

    def __init__(self, context: LazyContext | None) -> None:
        self._context = context
        self._previous: Any = None
        self._entered = False
        if context is not None and context.eager:
            self.use()

    def use(self) -> None:
        """Import Ray Data and make the context current, once (a carried ``None``: the
        process's current context stays)."""
        if self._entered:
            return
        context = None if self._context is None else self._context.get()
        if context is None:  # the process's own (Ray Data's defaults, if none was made yet)
            from raydl._internal.ray_compat import context as data_context

            data_context.get_current()  # made, if not yet, without Ray's state API
            return
        from ray.data import DataContext

        self._previous = DataContext._set_current(context)
        self._entered = True

    def close(self) -> None:
        if self._entered:
            from ray.data import DataContext

            DataContext._set_current(self._previous)
            self._entered = False

    def __enter__(self) -> RayData:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _numeric(output: Any) -> bool:
    """A non-empty dict of numeric arrays of one length: Ray's round trip gives it back as it is.

    Plain arrays (not masked ones) of booleans, integers or floats in native byte order:
    Ray's Arrow conversion keeps those (complex numbers and other byte orders become
    Python objects there). A read-only boolean array is left to Ray, whose conversion of
    booleans copies (its batch is writable).
    """
    if type(output) is not dict or not output:
        return False
    columns = list(output.values())
    return (
        all(
            type(c) is np.ndarray
            and c.ndim
            and c.dtype.kind in "biuf"
            and c.dtype.isnative
            and (c.flags.writeable or c.dtype.kind != "b")
            for c in columns
        )
        and len({len(c) for c in columns}) == 1
    )


def _plain_type(kind: pa.DataType) -> bool:
    return not isinstance(kind, pa.BaseExtensionType) and not pa.types.is_null(kind)


def _arrow_to_numpy(table: pa.Table) -> dict[str, np.ndarray] | None:
    """``table`` (of plain columns, :func:`_kind`) as Ray's numpy batch of it, by Ray's own
    calls, or ``None`` where Ray does more."""
    out = {}
    for name, column in zip(table.column_names, table.columns, strict=True):
        if column.num_chunks > 1:  # Ray's combine_chunked_array; one chunk stays as it is
            if column.nbytes > _COMBINE_LIMIT:
                return None
            column = column.combine_chunks()
        elif column.num_chunks == 0:
            column = pa.array([], type=column.type)
        converted = _without_pandas(column)
        out[name] = column.to_numpy(zero_copy_only=False) if converted is None else converted
    return out


def _without_pandas(column: pa.ChunkedArray | pa.Array) -> np.ndarray | None:
    """``column.to_numpy(zero_copy_only=False)`` for binary and string columns and for one
    chunk of integers or floats without nulls, made without the pandas that call imports
    (pyarrow converts through its pandas code: 41 MB of a training process that loads runs
    itself); ``None`` for any other column. Binary and string values become Python
    objects (``None`` for a null); numbers a read-only view of the chunk's buffer."""
    type = column.type
    if (
        pa.types.is_binary(type)
        or pa.types.is_large_binary(type)
        or pa.types.is_string(type)
        or pa.types.is_large_string(type)
    ):
        values = np.empty(len(column), dtype=object)
        values[:] = column.to_pylist()
        return values
    if not (pa.types.is_integer(type) or pa.types.is_floating(type)):
        return None
    chunk = column if isinstance(column, pa.Array) else column.chunk(0)  # one chunk here
    if chunk.null_count:
        return None  # integers with nulls become floats
    kind = "f" if pa.types.is_floating(type) else "i" if pa.types.is_signed_integer(type) else "u"
    dtype = np.dtype(f"{kind}{type.bit_width // 8}")
    data = chunk.buffers()[1]
    if data is None:
        return None
    view = np.frombuffer(data, dtype=dtype, count=len(chunk), offset=chunk.offset * dtype.itemsize)
    view.flags.writeable = False  # as pyarrow's zero-copy view
    return view


def _kind(block: Any) -> Any:
    """What a block this module batches must share with the blocks batched with it, else ``None``.

    An Arrow table of plain columns: its schema (a batch across tables is their
    concatenation). A dict of numeric arrays: its columns' names, dtypes and shapes
    past the first axis.
    """
    if isinstance(block, pa.Table):
        names = block.column_names
        plain = (
            names
            and len(set(names)) == len(names)  # Ray refuses a repeated name
            and all(_plain_type(field.type) for field in block.schema)
        )
        return block.schema if plain else None
    if _numeric(block):
        return tuple((name, c.dtype, c.shape[1:]) for name, c in block.items())
    return None


def _rows(block: Any) -> int:
    if isinstance(block, pa.Table):
        return int(block.num_rows)
    return len(next(iter(block.values())))


def _rest(block: Any, start: int) -> Any:
    """``block`` from row ``start`` on."""
    if not start:
        return block
    if isinstance(block, pa.Table):
        return block.slice(start)
    return {name: column[start:] for name, column in block.items()}


def batches(
    blocks: Iterable[Any],
    *,
    batch_size: int | None,
    batch_format: Any,
    ensure_copy: bool,
    ray_data: RayData,
) -> Iterator[Any]:
    """``blocks`` cut into batches as ``map_batches`` cuts a task's input.

    Args:
        blocks: Ray Data blocks (Arrow tables, pandas frames), or a previous stage's
            dicts of numeric arrays.
        batch_size: Rows per batch (``None``: one batch per non-empty block).
        batch_format: ``"numpy"``, ``"pandas"``, ``"pyarrow"``, or ``None`` for the
            block as it is.
        ensure_copy: Copy the rows (``zero_copy_batch=False`` with a batch size).
        ray_data: Where Ray Data's ``batch_blocks`` comes from when it is needed: a
            format other than numpy, or a block this module does not batch with the
            ones before it (those rows not yet batched and the rest go there, so the
            cut is the same).
    """
    source = iter(blocks)
    if batch_format in ("pyarrow", None) and batch_size is None and not ensure_copy:
        yield from _whole_tables(source, batch_format, ray_data)
        return
    if batch_format != "numpy":
        yield from _ray_batches(source, batch_size, batch_format, ensure_copy, ray_data)
        return
    held: list[tuple[Any, int]] = []  # blocks not wholly batched yet, from which row
    kind = None
    rows = 0
    for block in source:
        this = _kind(block)
        if this is None or (kind is not None and this != kind):
            rest = itertools.chain((_rest(b, start) for b, start in held), [block], source)
            yield from _ray_batches(rest, batch_size, batch_format, ensure_copy, ray_data)
            return
        count = _rows(block)
        if not count:  # Ray's batcher drops empty blocks
            continue
        kind = this
        if batch_size is None:
            yield _numpy_batch([block], ensure_copy, ray_data)
            continue
        held.append((block, 0))
        rows += count
        while rows >= batch_size:
            yield _numpy_batch(_take(held, batch_size), ensure_copy, ray_data)
            rows -= batch_size
    if rows:
        yield _numpy_batch(_take(held, rows), ensure_copy, ray_data)


def _whole_tables(source: Iterator[Any], batch_format: Any, ray_data: RayData) -> Iterator[Any]:
    """Arrow blocks as Arrow batches, one per non-empty block: each block as it is (Ray's
    ``to_batch_format("pyarrow")`` of a table is the table). From the first block that is
    not a table on, Ray Data's (it would pass that block on converted)."""
    for block in source:
        if not isinstance(block, pa.Table):
            rest = itertools.chain([block], source)
            yield from _ray_batches(rest, None, batch_format, False, ray_data)
            return
        if block.num_columns and block.num_rows:  # Ray's batcher drops empty blocks
            yield block


def _take(held: list[tuple[Any, int]], count: int) -> list[Any]:
    """The first ``count`` held rows, as slices of their blocks; ``held`` keeps the rest."""
    pieces = []
    while count:
        block, start = held[0]
        size = _rows(block) - start
        take = min(size, count)
        if isinstance(block, pa.Table):
            pieces.append(block.slice(start, take))
        else:
            pieces.append({name: column[start : start + take] for name, column in block.items()})
        count -= take
        if take == size:
            held.pop(0)
        else:
            held[0] = (block, start + take)
    return pieces


def _numpy_batch(pieces: list[Any], ensure_copy: bool, ray_data: RayData) -> dict[str, np.ndarray]:
    """One batch of ``pieces`` (slices of one kind, :func:`_kind`), as Ray formats it.

    Tables are concatenated, then converted as a whole, as Ray converts a batch (a
    column's dtype depends on the batch's rows: an integer column with a null in the
    batch becomes floats); dicts' arrays are concatenated.
    """
    if isinstance(pieces[0], pa.Table):
        table = pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)
        columns = to_numpy(table, ray_data)
    elif len(pieces) == 1:
        columns = pieces[0]
    else:
        return {name: np.concatenate([piece[name] for piece in pieces]) for name in pieces[0]}
    return {name: column.copy() for name, column in columns.items()} if ensure_copy else columns


def _ray_batches(
    blocks: Iterator[Any],
    batch_size: int | None,
    batch_format: Any,
    ensure_copy: bool,
    ray_data: RayData,
) -> Iterator[Any]:
    """Ray Data's ``batch_blocks`` over ``blocks``: Ray's blocks, and the numeric dicts
    :func:`to_block` kept, which Ray converts here."""
    ray_data.use()
    from ray.data._internal.block_batching.block_batching import batch_blocks
    from ray.data.block import BlockAccessor

    return batch_blocks(
        (BlockAccessor.batch_to_block(b) if type(b) is dict else b for b in blocks),
        batch_size=batch_size,
        batch_format=batch_format,
        ensure_copy=ensure_copy,
    )


def to_block(output: Any, ray_data: RayData) -> Any:
    """A stage's output as the next stage's input block (Ray's ``batch_to_block``).

    An Arrow table, or a dict of numeric arrays (Ray's round trip gives it back), is
    kept as it is.
    """
    if isinstance(output, pa.Table) or _numeric(output):
        return output
    ray_data.use()
    from ray.data.block import BlockAccessor

    return BlockAccessor.batch_to_block(output)


def to_numpy(output: Any, ray_data: RayData) -> dict[str, np.ndarray]:
    """A stage's output (or a read's table) as Ray Data's numpy batch of it."""
    if _numeric(output):
        return output
    if isinstance(output, pa.Table) and _kind(output) is not None:
        columns = _arrow_to_numpy(output)
        if columns is not None:
            return columns
    ray_data.use()
    from ray.data.block import BlockAccessor

    block = BlockAccessor.batch_to_block(output)
    return BlockAccessor.for_block(block).to_batch_format("numpy")


def validate_output(output: Any, ray_data: RayData) -> None:
    """Raise Ray Data's own error if ``output`` is not what a ``map_batches`` function may return.

    An Arrow table or a dict of numpy arrays passes Ray's check; anything else is checked
    by Ray Data's ``_validate_batch_output``.
    """
    if isinstance(output, pa.Table) or (
        type(output) is dict and all(isinstance(c, np.ndarray) for c in output.values())
    ):
        return
    ray_data.use()
    from ray.data._internal.planner.plan_udf_map_op import _validate_batch_output

    _validate_batch_output(output)


def check() -> None:
    """Batch blocks and check outputs as a stage would, both ways, and compare (no cluster)."""
    from ray.data import DataContext
    from ray.data.block import BlockAccessor

    table = pa.table({"x": [1, 2, 3], "s": ["a", "b", None], "b": [b"1", b"2", b"3"]})
    with RayData(LazyContext(DataContext.get_current())) as ray_data:
        ours = list(
            batches(
                [table], batch_size=2, batch_format="numpy", ensure_copy=True, ray_data=ray_data
            )
        )
        theirs = list(_ray_batches(iter([table]), 2, "numpy", ensure_copy=True, ray_data=ray_data))
    if [len(batch["x"]) for batch in theirs] != [2, 1]:
        raise ValueError(f"batch_blocks cut 3 rows into batches of 2 as {theirs}")
    for mine, ray in zip(ours, theirs, strict=True):
        if mine.keys() != ray.keys() or not all(
            mine[k].dtype == ray[k].dtype and np.array_equal(mine[k], ray[k]) for k in mine
        ):
            raise ValueError(f"raydl's numpy batches {ours} differ from Ray Data's {theirs}")
    whole = BlockAccessor.for_block(table).to_batch_format("numpy")
    if {k: v.tolist() for k, v in whole.items()} != {
        k: v.tolist() for k, v in to_numpy(table, RayData(None)).items()
    }:
        raise ValueError("raydl's numpy conversion of a table differs from Ray Data's")
    from ray.data._internal.planner.plan_udf_map_op import _validate_batch_output

    _validate_batch_output({"x": ours[0]["x"]})
    try:
        _validate_batch_output([1, 2])
    except ValueError:
        pass
    else:
        raise ValueError("_validate_batch_output accepted a list")
