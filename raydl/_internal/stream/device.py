"""Host-to-device prefetch: the next batches are already on the GPU when the step asks.

:class:`DeviceCopy` is a producer stage over any epoch's producer: a named thread
takes host batches from it, pins them and copies them to the device on a side
CUDA stream, ``depth`` batches ahead, recording an event per batch. With
``pin_memory=True`` and no device the same stage only pins (:class:`HostPinner`),
as torch's pin-memory thread does, so the copy into pinned memory overlaps the
trainer's step instead of delaying its ``next()``. When the
trainer takes a batch, its current stream waits for that event (no host
synchronisation) and the batch's memory is recorded as used by that stream, so
the copy overlaps the previous step and nothing is freed early. The epoch's
iterator (``epoch_iterator.py``) stays the one that counts batches, times the
trainer's wait and applies the timeout.

The copy step is injected (:class:`Copier`), so the stage's hand-off, counting
and lifetimes are tested on CPU; :class:`CudaCopier` is the real one. It is a
:class:`StagedCopier`: each host tensor is copied once, straight from the
object store (an owned batch, ``workers/convert.py``) into a pinned buffer of a
:class:`~raydl._internal.stream.pinned.PinnedPool`, and from there to the device;
the buffer is reused once the event recorded after its copy has completed.

Without CUDA there is nothing to prefetch to: :func:`resolve_device` warns once
(as torch does for ``pin_memory``) and batches stay on the host.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils.data._utils.pin_memory import pin_memory as pin_structure

from raydl._internal.stream.epoch_iterator import Producer
from raydl._internal.stream.handoff import Handoff, InlineHandoff
from raydl._internal.stream.pinned import Fence, PinnedPool


class PinMemory:
    """``pin_memory=True`` as torch honours it: pin when CUDA exists, else warn once and don't."""

    def __init__(self, requested: bool) -> None:
        self._requested = requested
        self._warned = False

    def use(self) -> bool:
        """Whether this epoch's host batches are pinned."""
        if not self._requested:
            return False
        if torch.cuda.is_available():
            return True
        if not self._warned:
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
                stacklevel=3,  # the caller of iter(loader)
            )
            self._warned = True
        return False


def resolve_device(device: str | torch.device | int | None) -> torch.device | None:
    """The CUDA device to prefetch batches to, or ``None`` to keep them on the host."""
    if device is None:
        return None
    target = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    if target.type != "cuda":
        return None if target.type == "cpu" else target
    if not torch.cuda.is_available():
        warnings.warn(
            f"device={str(target)!r} was requested but CUDA is not available; "
            "batches stay on the host (CPU).",
            stacklevel=3,
        )
        return None
    if target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    return target


def to_device(batch: Any, device: torch.device, *, non_blocking: bool) -> Any:
    """Move every tensor of a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking=non_blocking) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device, non_blocking=non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking=non_blocking) for v in batch)
    return batch


def _record_stream(batch: Any, stream: Any) -> None:
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, dict):
        for v in batch.values():
            _record_stream(v, stream)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            _record_stream(v, stream)


class Copier(Protocol):
    """One batch's copy to the device: started on the copy thread, finished on the trainer's."""

    def start(self) -> None:
        """Called once on the copy thread before its first copy."""
        ...

    def copy(self, batch: Any) -> Any:
        """Start copying the host ``batch``; a token for :meth:`ready` (copy thread)."""
        ...

    def ready(self, token: Any) -> Any:
        """The device batch of ``token``, safe to use on the trainer's stream (trainer thread)."""
        ...


class StagedCopier:
    """A :class:`Copier` that stages each batch in pooled pinned buffers, then moves it.

    ``copy`` (the copy thread): the batch's host tensors are copied into buffers of
    ``pool`` (one copy each; no host tensor in between), :meth:`move` starts their
    copy to the device, :meth:`record` marks its end, and the buffers are fenced by
    that mark: the pool reuses them once it completed. ``ready`` (the trainer's
    thread) hands the moved batch over after :meth:`wait`. Subclasses supply the
    device side (:class:`CudaCopier`; a fake in the CPU tests).
    """

    def __init__(self, pool: PinnedPool) -> None:
        self.pool = pool

    def start(self) -> None:
        """Called once on the copy thread before its first copy."""

    def side(self) -> contextlib.AbstractContextManager[Any]:
        """Where the copies are enqueued (the side stream)."""
        return contextlib.nullcontext()

    def move(self, batch: Any) -> Any:
        """Start copying the pinned ``batch`` to the device (asynchronously)."""
        raise NotImplementedError

    def record(self) -> Fence:
        """A mark after the copies started so far; done once they are."""
        raise NotImplementedError

    def wait(self, batch: Any, fence: Fence) -> None:
        """Make the trainer's work on ``batch`` wait for ``fence`` (trainer thread)."""

    def copy(self, batch: Any) -> Any:
        with self.side():
            staged = self.pool.stage(batch)
            moved = self.move(staged.batch)
            fence = self.record()
        staged.fence(fence)
        return moved, fence

    def ready(self, token: Any) -> Any:
        batch, fence = token
        self.wait(batch, fence)
        return batch


class CudaCopier(StagedCopier):
    """Host batches through pooled pinned buffers to a side CUDA stream, one event per batch."""

    def __init__(self, device: torch.device, pool: PinnedPool | None = None) -> None:
        super().__init__(pool if pool is not None else PinnedPool())
        self._device = device
        self._stream = torch.cuda.Stream(device=device)

    def start(self) -> None:
        torch.cuda.set_device(self._device)

    def side(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self._stream)

    def move(self, batch: Any) -> Any:
        return to_device(batch, self._device, non_blocking=True)

    def record(self) -> Fence:
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def wait(self, batch: Any, fence: Any) -> None:
        current = torch.cuda.current_stream(self._device)
        current.wait_event(fence)
        _record_stream(batch, current)


class HostPinner:
    """A :class:`Copier` for ``pin_memory=True`` without a device copy: pins on the stage's thread.

    As torch's pin-memory thread: each batch is copied once, from the object store
    into blocks of torch's caching host allocator (``pin_memory()``, reused once the
    copies torch recorded on them are done; the trainer may start its own
    ``non_blocking`` copy from the batch and drop it, see ``pinned.py``), on one
    intra-op thread and with the trainer's current CUDA device. The trainer gets the
    pinned batch as it is. ``pin`` is injected for the CPU tests.
    """

    def __init__(
        self, pin: Callable[[Any], Any] = pin_structure, device_index: int | None = None
    ) -> None:
        self._pin = pin
        self._device_index = device_index

    def start(self) -> None:
        torch.set_num_threads(1)  # as torch's pin thread (OpenMP: this thread's count)
        if self._device_index is not None:
            torch.cuda.set_device(self._device_index)

    def copy(self, batch: Any) -> Any:
        return self._pin(batch)

    def ready(self, token: Any) -> Any:
        return token


def copy_stage(
    producer: Producer,
    *,
    device: torch.device | None,
    pin: bool,
    depth: int,
    epoch: int,
) -> Producer:
    """``producer`` behind the stage that moves its batches to ``device``, or pins them, or as is.

    An epoch whose items are made on the trainer's thread is pinned there, inside
    ``next()``: one loading in process (``num_workers=0``, an ``InlineHandoff``), as
    torch pins without workers, and one whose first batches the trainer's stand-ins
    load (``loads_in_deliver``).
    """
    if device is not None:
        assert not producer.loads_in_deliver, "a device copy starts no stand-ins (lookahead)"
        copier: Copier = CudaCopier(device)
        name = f"raydl-epoch-{epoch}-to-{device}"
    elif pin:
        current = torch.cuda.current_device() if torch.cuda.is_available() else None
        copier, name = HostPinner(device_index=current), f"raydl-epoch-{epoch}-pin"
        if isinstance(producer.handoff, InlineHandoff) or producer.loads_in_deliver:
            return DeviceCopy(producer, copier, depth=depth, name=name, inline=True)
    else:
        return producer
    return DeviceCopy(producer, copier, depth=depth, name=name)


class DeviceCopy(Producer):
    """The batches of ``source``, copied ahead by ``copier`` (``depth`` of them queued).

    The trainer's ``taken()`` reaches ``source`` (a map-style sampler is drawn on
    the trainer's thread), and closing this stage closes ``source``. ``inline``: no
    thread; each batch is taken and copied inside the trainer's ``next()``
    (:class:`~raydl._internal.stream.handoff.InlineHandoff`, ``copier.start`` not called).
    """

    delivers_items = False  # its items are copies in flight; the batches come from ``deliver``

    def __init__(
        self, source: Producer, copier: Copier, *, depth: int, name: str, inline: bool = False
    ) -> None:
        self._source = source
        self._copier = copier
        if inline:
            self.handoff: Handoff = InlineHandoff(
                lambda: copier.copy(source.deliver(source.handoff.take(0)))
            )
            return
        self.handoff = Handoff(maxsize=max(1, depth))
        self.handoff.start(self._run, name=name)

    def _run(self) -> None:
        self._copier.start()
        source, copy, put = self._source, self._copier.copy, self.handoff.put
        while True:
            try:
                item = source.handoff.take(0)
            except StopIteration:
                if self.handoff.stopped:
                    return
                break
            put(copy(source.deliver(item)))

    def deliver(self, item: Any) -> Any:
        return self._copier.ready(item)

    def taken(self, waited: float) -> None:
        self._source.taken(waited)

    def summary(self) -> str | None:
        return self._source.summary()

    def close(self, *, stalled: bool = False) -> None:
        self.handoff.stop(join_s=0)
        self._source.close(stalled=stalled)
        self.handoff.stop(join_s=5)
