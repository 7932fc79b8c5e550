"""Moving collated batches between Ray workers and the training process.

Ray ships numpy arrays through its shared-memory object store without pickling
their payload, while a ``torch.Tensor`` is pickled byte by byte. Workers
therefore turn every CPU tensor of a batch into a numpy array
(:func:`tensors_to_numpy`, zero-copy) and the training process turns them back
(:func:`numpy_to_tensors`). The nesting (dicts, lists, tuples, namedtuples) and
non-tensor leaves are kept as they are. Tensors numpy cannot view (nested,
sparse, on a GPU, needing grad) travel pickled, as torch tensors.

A namedtuple class that pickle cannot find by its name (one defined inside a
class body: ``Dataset.Batch``, whose ``__qualname__`` is just ``Batch``; or any
class of the training script, which a Ray worker knows only by value) would
come back as a copy of the class, so ``isinstance(batch, Dataset.Batch)``
fails. Its instances travel as :class:`_Named` (module, name, fields, values)
and the training process rebuilds them with its own class, found in the module
or one class body down (:func:`_find_namedtuple`).

Ownership decides whether an array from the object store is copied. ``ray.get``
hands back read-only arrays over the store's shared memory, because the object
may be read again. A batch that raydl's own actors produced for this consumer
alone (a worker's reply, a direct run's blocks) is *owned*: nobody else reads
it, so its tensors are made over the store's memory without a copy
(:func:`writable_view`; the view keeps the store's buffer, and so the object,
alive until the last tensor over it is freed). Anything else (Ray Data's
blocks, which a materialized dataset or another consumer reads again) is copied
when read-only, so a trainer writing into its batch changes nobody else's data.
"""

from __future__ import annotations

import sys
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


# Same-size integer dtypes that carry the bits of dtypes numpy lacks (bfloat16, float8, ...).
_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Wrapped:
    """A numpy array that stands for a tensor; remembers that it was one, and its dtype."""

    __slots__ = ("array", "dtype")

    def __init__(self, array: np.ndarray, dtype: torch.dtype | None = None) -> None:
        self.array = array
        self.dtype = dtype  # set when the array carries the bits of a dtype numpy lacks

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Wrapped, (self.array, self.dtype))


def tensors_to_numpy(obj: Any) -> Any:
    """Replace each CPU tensor in ``obj`` by a numpy view of it (wrapped, so it comes back a tensor)."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields") and not _pickles_by_name(type(obj)):
        cls = type(obj)
        values = tuple(tensors_to_numpy(v) for v in obj)
        return _Named(cls.__module__, cls.__name__, tuple(cls._fields), values, cls)
    if isinstance(obj, torch.Tensor):
        if not _plain(obj):
            return obj  # sparse, conj/neg views, autograd, GPU: travels pickled, as it is
        if obj.dtype in _NUMPY_DTYPES:
            return _Wrapped(obj.numpy())
        carrier = _CARRIERS.get(obj.element_size())
        if carrier is not None and not obj.is_complex():
            return _Wrapped(obj.view(carrier).numpy(), obj.dtype)
        return obj
    return _map_structure(obj, tensors_to_numpy)


def _plain(tensor: torch.Tensor) -> bool:
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.is_nested
        and not tensor.requires_grad
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def numpy_to_tensors(obj: Any, *, owned: bool) -> Any:
    """Undo :func:`tensors_to_numpy`: every wrapped array becomes a writable tensor again.

    ``owned``: ``obj`` is this consumer's alone (a worker's reply to it), so the
    tensors are made over the arrays' memory, read-only or not, without a copy,
    except arrays :data:`DETACH_RATIO` times smaller than the reply's largest;
    otherwise read-only arrays are copied (see the module docstring).
    """
    smallest_view = _largest_array(obj) // DETACH_RATIO if owned else 0
    return _to_tensors(obj, owned, smallest_view)


#: An owned array this many times smaller than the largest one of its batch (or block) is
#: copied, not viewed: kept alone (the labels a trainer keeps for its epoch's metrics), a
#: view would keep the whole object in the store (a batch of images, a run's blocks) for a
#: few bytes of it. Copying it costs a few microseconds.
DETACH_RATIO = 64


def _to_tensors(obj: Any, owned: bool, smallest_view: int) -> Any:
    if isinstance(obj, _Wrapped):
        tensor = array_to_tensor(obj.array, owned=owned, smallest_view=smallest_view)
        return tensor if obj.dtype is None else tensor.view(obj.dtype)
    if isinstance(obj, _Named):
        return obj.rebuild(lambda value: _to_tensors(value, owned, smallest_view))
    return _map_structure(obj, lambda value: _to_tensors(value, owned, smallest_view))


def _largest_array(obj: Any) -> int:
    """Bytes of the largest array that stands for a tensor in ``obj``."""
    if isinstance(obj, _Wrapped):
        return int(obj.array.nbytes)
    values: Any = ()
    if isinstance(obj, _Named):
        values = obj.values
    elif isinstance(obj, Mapping):
        values = obj.values()
    elif isinstance(obj, (list, tuple)):
        values = obj
    return max((_largest_array(value) for value in values), default=0)


class _Named:
    """A namedtuple whose class pickle cannot find by name, as plain data (see the module doc)."""

    __slots__ = ("cls", "fields", "module", "name", "values")

    def __init__(
        self, module: str, name: str, fields: tuple[str, ...], values: tuple[Any, ...], cls: type
    ) -> None:
        self.module = module
        self.name = name
        self.fields = fields
        self.values = values
        self.cls = cls  # pickled by value: used when the trainer has no such class

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Named, (self.module, self.name, self.fields, self.values, self.cls))

    def rebuild(self, fn: Any) -> Any:
        cls = _find_namedtuple(self.module, self.name, self.fields) or self.cls
        return cls(*(fn(v) for v in self.values))


_FOUND: dict[tuple[str, str, tuple[str, ...]], type | None] = {}
_BY_NAME: dict[type, bool] = {}


def _pickles_by_name(cls: type) -> bool:
    """Whether pickle finds ``cls`` as ``module.qualname`` in this process (cached)."""
    known = _BY_NAME.get(cls)
    if known is None:
        found: Any = sys.modules.get(cls.__module__)
        for part in cls.__qualname__.split("."):
            found = getattr(found, part, None)
        known = _BY_NAME[cls] = found is cls
    return known


def _find_namedtuple(module: str, name: str, fields: tuple[str, ...]) -> type | None:
    """This process's namedtuple class ``name`` of ``module``: at its top or in a class body."""
    key = (module, name, fields)
    if key in _FOUND:
        return _FOUND[key]
    owner = sys.modules.get(module)
    found: type | None = None
    if owner is not None:
        places = [owner, *(v for v in vars(owner).values() if isinstance(v, type))]
        for place in places:
            candidate = vars(place).get(name)
            if (
                isinstance(candidate, type)
                and issubclass(candidate, tuple)
                and getattr(candidate, "_fields", None) == fields
            ):
                found = candidate
                break
    _FOUND[key] = found
    return found


def array_to_tensor(array: np.ndarray, *, owned: bool, smallest_view: int = 0) -> torch.Tensor:
    """A writable tensor with the array's data.

    A read-only array (the object store's) is copied unless ``owned`` (this
    consumer's alone: the tensor is made over its memory, see :func:`writable_view`)
    and at least ``smallest_view`` bytes (see :data:`DETACH_RATIO`).
    """
    if not array.flags.writeable:
        array = owned_array(array, smallest_view) if owned else array.copy()
    return torch.from_numpy(array)


def writable_view(array: np.ndarray) -> np.ndarray:
    """A writable array over ``array``'s memory (no copy), keeping ``array`` alive.

    For an array only this consumer reads: ``ray.get`` marks the object store's
    arrays read-only although the store's mapping is writable. The view's base
    holds ``array``, whose base holds Ray's buffer, which keeps the object in the
    store (pinned, not evicted or spilled) until the last view of it is freed.
    Unlike ``torch.from_numpy`` of the read-only array, this warns about nothing.
    Arrays of Python objects are returned as they are.

    Example:
        >>> frozen = np.arange(3)
        >>> frozen.flags.writeable = False
        >>> view = writable_view(frozen)
        >>> view.flags.writeable, np.shares_memory(view, frozen)
        (True, True)
    """
    if array.flags.writeable or array.dtype.hasobject:
        return array
    return np.asarray(_WritableInterface(array))


class _WritableInterface:
    """``array``'s memory described to numpy as writable (``__array_interface__``)."""

    __slots__ = ("__array_interface__", "array")

    def __init__(self, array: np.ndarray) -> None:
        self.array = array  # the new array's base: it keeps this one (and its buffer) alive
        interface = dict(array.__array_interface__)
        interface["data"] = (interface["data"][0], False)  # (address, read-only)
        self.__array_interface__ = interface


def owned_blocks(blocks: Any) -> Any:
    """Blocks (column -> array dicts, in a list) that only this consumer reads, made writable.

    For raydl's direct runs: the actors' blocks were made for this epoch's
    consumer alone, so their numeric columns become writable views
    (:func:`writable_view`) and :func:`numpy_batch_to_tensors` does not copy the
    batches cut from them; columns :data:`DETACH_RATIO` times smaller than the
    block's largest are copied instead. Other blocks (Arrow tables, ...) are
    returned as they are.
    """
    if isinstance(blocks, list):
        return [owned_blocks(block) for block in blocks]
    if isinstance(blocks, dict):
        arrays = [c.nbytes for c in blocks.values() if isinstance(c, np.ndarray)]
        smallest_view = max(arrays, default=0) // DETACH_RATIO
        return {
            name: owned_array(column, smallest_view) if isinstance(column, np.ndarray) else column
            for name, column in blocks.items()
        }
    return blocks


def owned_array(array: np.ndarray, smallest_view: int) -> np.ndarray:
    """An owned array, writable: a view of it, or a copy if read-only and under ``smallest_view`` bytes.

    The one rule of :data:`DETACH_RATIO`, for replies (:func:`array_to_tensor`) and
    blocks (:func:`owned_blocks`) alike.
    """
    if array.nbytes < smallest_view and not array.flags.writeable:
        return array.copy()
    return writable_view(array)


def numpy_batch_to_tensors(
    batch: Mapping[str, np.ndarray], *, owned: bool = False
) -> dict[str, Any]:
    """Turn a Ray Data numpy batch (column -> array) into column -> tensor.

    Read-only columns are copied unless ``owned`` (see :func:`array_to_tensor`);
    a batch cut from :func:`owned_blocks` is writable already and is not copied.
    Columns that torch cannot hold (strings, ragged objects) stay numpy arrays
    so that nothing is silently dropped.
    """
    out: dict[str, Any] = {}
    for name, column in batch.items():
        if column.dtype.kind in "biufc":
            out[name] = array_to_tensor(column, owned=owned)
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
