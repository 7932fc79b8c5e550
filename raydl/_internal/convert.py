"""Moving collated batches between Ray workers and the training process.

Ray ships numpy arrays through its shared-memory object store without pickling
their payload, while a ``torch.Tensor`` is pickled byte by byte. Workers
therefore turn every CPU tensor of a batch into a numpy array
(:func:`tensors_to_numpy`, zero-copy) and the training process turns them back
(:func:`numpy_to_tensors`). The nesting (dicts, lists, tuples, namedtuples) and
non-tensor leaves are kept as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

# Tensors of other dtypes (bfloat16, float8, complex32, ...) travel pickled.
_NUMPY_DTYPES = {
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
}


class _Wrapped:
    """A numpy array that stands for a tensor; remembers that it was one."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Wrapped, (self.array,))


def tensors_to_numpy(obj: Any) -> Any:
    """Replace each CPU tensor in ``obj`` by a numpy view of it (wrapped, so it comes back a tensor)."""
    if isinstance(obj, torch.Tensor):
        if _numpy_can_hold(obj):
            return _Wrapped(obj.numpy())
        return obj  # travels pickled, exactly as it is
    return _map_structure(obj, tensors_to_numpy)


def _numpy_can_hold(tensor: torch.Tensor) -> bool:
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and tensor.dtype in _NUMPY_DTYPES
        and not tensor.requires_grad
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def numpy_to_tensors(obj: Any) -> Any:
    """Undo :func:`tensors_to_numpy`: every wrapped array becomes a writable tensor again."""
    if isinstance(obj, _Wrapped):
        return array_to_tensor(obj.array)
    return _map_structure(obj, numpy_to_tensors)


def array_to_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor with the array's data; copies only when the array is read-only (object store)."""
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array)


def numpy_batch_to_tensors(batch: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Turn a Ray Data numpy batch (column -> array) into column -> tensor.

    Columns that torch cannot hold (strings, ragged objects) stay numpy arrays
    so that nothing is silently dropped.
    """
    out: dict[str, Any] = {}
    for name, column in batch.items():
        if column.dtype.kind in "biufc":
            out[name] = array_to_tensor(column)
        elif column.dtype == object and len(column) and _all_numeric_same_shape(column):
            out[name] = torch.from_numpy(np.stack(list(column)))
        else:
            out[name] = column
    return out


def _all_numeric_same_shape(column: np.ndarray) -> bool:
    first = column[0]
    if not isinstance(first, np.ndarray) or first.dtype.kind not in "biufc":
        return False
    return all(isinstance(x, np.ndarray) and x.shape == first.shape for x in column)


def _map_structure(obj: Any, fn: Any) -> Any:
    if isinstance(obj, Mapping):
        try:
            return type(obj)({k: fn(v) for k, v in obj.items()})  # type: ignore[call-arg]
        except TypeError:
            return {k: fn(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(fn(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(fn(v) for v in obj)
    return obj
