"""Ray Data's ``map_batches`` machinery, used to run stages outside Ray Data (direct execution).

Relies on these private parts of Ray Data (checked by :func:`check`):

* ``batch_blocks`` (``ray.data._internal.block_batching.block_batching``): Ray's
  cutting of blocks into formatted batches, with ``batch_size``, ``batch_format``
  and ``ensure_copy``;
* ``_validate_batch_output`` (``ray.data._internal.planner.plan_udf_map_op``):
  the check ``map_batches`` applies to what a function returns;
* ``DataContext._set_current``, which installs a context in a worker (and
  returns the one it replaces).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["batches", "check", "current_context", "validate_output"]


def batches(
    blocks: Iterable[Any], *, batch_size: int | None, batch_format: Any, ensure_copy: bool
) -> Iterator[Any]:
    """``blocks`` cut into batches as ``map_batches`` cuts a task's input.

    Args:
        blocks: Ray Data blocks (Arrow tables, pandas frames).
        batch_size: Rows per batch (``None``: one batch per block).
        batch_format: ``"numpy"``, ``"pandas"``, ``"pyarrow"``, or ``None`` for the
            block as it is.
        ensure_copy: Copy the rows (``zero_copy_batch=False`` with a batch size).

    Relies on Ray Data's ``batch_blocks``.
    """
    from ray.data._internal.block_batching.block_batching import batch_blocks

    return batch_blocks(
        iter(blocks), batch_size=batch_size, batch_format=batch_format, ensure_copy=ensure_copy
    )


def validate_output(output: Any) -> None:
    """Raise Ray Data's own error if ``output`` is not what a ``map_batches`` function may return.

    Relies on Ray Data's ``_validate_batch_output``.
    """
    from ray.data._internal.planner.plan_udf_map_op import _validate_batch_output

    _validate_batch_output(output)


@contextlib.contextmanager
def current_context(context: Any) -> Iterator[None]:
    """Make ``context`` (a ``ray.data.DataContext``) the current one meanwhile.

    Relies on ``DataContext._set_current``, which Ray Data's own workers use.
    """
    from ray.data import DataContext

    previous = DataContext._set_current(context)
    try:
        yield
    finally:
        DataContext._set_current(previous)


def check() -> None:
    """Batch a small block and check an output, as a stage would (no cluster needed)."""
    import pyarrow as pa
    from ray.data import DataContext

    with current_context(DataContext.get_current()):
        cut = list(
            batches(
                [pa.table({"x": [1, 2, 3]})], batch_size=2, batch_format="numpy", ensure_copy=True
            )
        )
    if [len(batch["x"]) for batch in cut] != [2, 1]:
        raise ValueError(f"batch_blocks cut 3 rows into batches of 2 as {cut}")
    validate_output({"x": cut[0]["x"]})
    try:
        validate_output([1, 2])
    except ValueError:
        pass
    else:
        raise ValueError("_validate_batch_output accepted a list")
