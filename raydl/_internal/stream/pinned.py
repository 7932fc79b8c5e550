"""Pinned host buffers for the copy to the device, reused from a small pool.

An owned batch (``workers/convert.py``) is a set of tensors over Ray's object
store. With a device copy (``device.py``) each of its tensors is copied once,
straight into a pinned buffer, and from there to the device on the side stream:
no intermediate host tensor. The buffers come from a :class:`PinnedPool` rather
than one allocation per batch, and a buffer is reused only once

* nothing outside the pool refers to its memory (no tensor or view of it is
  alive: the storage's use count is back to the pool's own), and
* its fence (the event recorded after the batch's host-to-device copy was
  enqueued) has completed, so the copy engine no longer reads it.

While the trainer holds batch i on the device, batch i+1's buffers are being
copied and i+2's filled: a pool sized for a few batches is reused in turn.
Shapes and dtypes may change from batch to batch (the last, smaller batch;
images of other sizes): a buffer is raw bytes, taken by the smallest free one
that holds the tensor and is at most twice its size.

Without a device copy (``pin_memory=True`` alone) the pinned batch is the
trainer's, who may start its own ``non_blocking`` copy from it and drop it at
once; only torch's caching host allocator sees that copy's stream. So that path
keeps ``tensor.pin_memory()`` (``device.py``'s ``HostPinner``, on the copy stage's
thread as torch's pin-memory thread): one copy from the object store into a block
of torch's allocator, which caches its blocks and reuses one once the copies it
recorded on it are done; not this pool.

The allocator is injected (``torch.empty(..., pin_memory=True)`` fails without
CUDA), so the pool's reuse and lifetimes are tested on CPU. The same pool over
plain host memory (:class:`HostArrays`) gives the local shuffle buffer's gathered
batches memory that is reused rather than mapped afresh for every batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data._utils.pin_memory import pin_memory as pin_structure

#: ``nbytes`` -> a 1-D ``uint8`` tensor of that many pinned bytes.
Allocate = Callable[[int], torch.Tensor]


class Fence(Protocol):
    """What a buffer waits for before reuse: ``torch.cuda.Event`` (``query()``: done)."""

    def query(self) -> bool: ...


def cuda_pinned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory (needs CUDA)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _uses(data: torch.Tensor) -> int:
    """How many tensors (and storage objects) share ``data``'s storage.

    torch's ``_storage_Use_Count`` (the StorageImpl's reference count; a view shares
    its base's storage, so every view of a handed-out buffer counts).
    """
    return int(torch._C._storage_Use_Count(data.untyped_storage()._cdata))


class _Buffer:
    __slots__ = ("data", "fence", "own_uses")

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.fence: Fence | None = None
        self.own_uses = _uses(data)  # the pool's own reference, counted the same way

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def free(self) -> bool:
        if _uses(self.data) > self.own_uses:
            return False  # a tensor over it is alive (the batch, or a view of it)
        if self.fence is not None:
            if not self.fence.query():
                return False  # its copy to the device is still reading it
            self.fence = None
        return True


class Staged:
    """One batch copied into pinned buffers: ``batch`` (same structure), and its buffers."""

    __slots__ = ("_buffers", "batch")

    def __init__(self, batch: Any, buffers: list[_Buffer]) -> None:
        self.batch = batch
        self._buffers = buffers

    def fence(self, fence: Fence) -> None:
        """Keep the buffers from reuse until ``fence`` completes (the copy that reads them)."""
        for buffer in self._buffers:
            buffer.fence = fence


class PinnedPool:
    """Pinned buffers for batches on their way to the device (see the module docstring).

    Args:
        allocate: ``nbytes`` -> pinned bytes (:func:`cuda_pinned`; a fake in tests).
        keep: Buffers the pool holds at most. A full pool makes room for a new
            size by dropping a free buffer of another size; when every buffer is in
            use, a tensor gets a buffer of its own, freed with it.

    Example:
        >>> pool = PinnedPool(lambda n: torch.empty(n, dtype=torch.uint8))
        >>> staged = pool.stage({"x": torch.ones(2, 3)})
        >>> staged.batch["x"].shape, pool.allocated
        (torch.Size([2, 3]), 1)
    """

    def __init__(self, allocate: Allocate = cuda_pinned, *, keep: int = 32) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep!r}")
        self._allocate = allocate
        self._keep = keep
        self._buffers: list[_Buffer] = []
        self.allocated = 0  # buffers allocated so far
        self.reused = 0  # tensors staged into a buffer allocated earlier

    def __len__(self) -> int:
        return len(self._buffers)

    def stage(self, batch: Any) -> Staged:
        """``batch`` with each CPU tensor copied into a pinned buffer (one copy per tensor).

        Nested dicts, lists, tuples and namedtuples keep their structure; other
        leaves are kept as they are, or pinned by torch (custom ``pin_memory()``
        types, sparse tensors). Tensors on a device, or already pinned, are kept.
        """
        buffers: list[_Buffer] = []
        staged = self._stage(batch, buffers)
        return Staged(staged, buffers)

    def _stage(self, obj: Any, buffers: list[_Buffer]) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu" or obj.is_pinned():
                return obj
            if obj.layout != torch.strided or obj.is_nested or obj.requires_grad:
                return obj.pin_memory()
            return self._copy_in(obj, buffers)
        if isinstance(obj, Mapping):
            items = {k: self._stage(v, buffers) for k, v in obj.items()}
            try:
                return type(obj)(items)  # type: ignore[call-arg]
            except TypeError:
                return items
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(self._stage(v, buffers) for v in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._stage(v, buffers) for v in obj)
        if hasattr(obj, "pin_memory"):
            return pin_structure(obj)
        return obj

    def _copy_in(self, tensor: torch.Tensor, buffers: list[_Buffer]) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        buffer = self.take(max(1, nbytes))
        buffers.append(buffer)
        out = buffer.data[:nbytes].view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        return out

    def take(self, nbytes: int) -> _Buffer:
        """A free buffer of at least ``nbytes`` (and at most twice that), or a new one."""
        best: _Buffer | None = None
        spare: _Buffer | None = None  # a free buffer of the wrong size, to replace
        for buffer in self._buffers:
            if not buffer.free():
                continue
            if nbytes <= buffer.nbytes <= 2 * nbytes:
                if best is None or buffer.nbytes < best.nbytes:
                    best = buffer
            elif spare is None:
                spare = buffer
        if best is not None:
            self.reused += 1
            return best
        fresh = _Buffer(self._allocate(nbytes))
        self.allocated += 1
        if len(self._buffers) >= self._keep and spare is not None:
            self._buffers.remove(spare)  # full: a free buffer of another size makes room
        if len(self._buffers) < self._keep:
            self._buffers.append(fresh)
        return fresh


def host_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of plain host memory (a 1-D ``uint8`` tensor)."""
    return torch.empty(nbytes, dtype=torch.uint8)


class HostArrays:
    """New numpy arrays for batches made in this process, in memory reused from a pool.

    The local shuffle buffer gathers each batch of large rows into a new array
    (``batching.gather``). Memory freshly mapped for each one costs the kernel a page
    fault and a zeroed page per 4 KiB written, more than the copy itself: for a
    64x3x224x224 float32 batch, clearing pages was an eighth of the whole machine's
    CPU in the ``images_rgb224`` benchmark. So arrays of at least :data:`MIN_BYTES`
    come from a :class:`PinnedPool` over :func:`host_bytes`: a buffer is reused once
    no array or tensor over it is alive (the batch, a view of it, a tensor
    ``torch.from_numpy`` made of it: each holds the buffer's storage). It holds at
    most ``keep`` buffers: those alive at once, and free ones of another size until a
    new size needs their place (the last, short batch; the local buffer's compacted
    blocks are not made here). One pool per epoch, used on its producer thread (not
    thread-safe).
    """

    #: Smaller arrays come from numpy's own allocator (its cache, or the heap).
    MIN_BYTES = 1 << 20

    def __init__(self, keep: int = 16) -> None:
        self._pool = PinnedPool(host_bytes, keep=keep)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """An uninitialised array, like ``np.empty(shape, dtype)``; never of ``object`` dtype."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.MIN_BYTES or dtype.hasobject:
            return np.empty(shape, dtype=dtype)
        data = self._pool.take(nbytes).data[:nbytes]
        return data.numpy().view(dtype).reshape(shape)

    @property
    def reused(self) -> int:
        """Arrays made in memory an earlier array used."""
        return self._pool.reused
