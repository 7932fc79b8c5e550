"""Host-to-device prefetch: the next batches are already on the GPU when the step asks.

:class:`DevicePrefetcher` wraps an epoch iterator. A named background thread
takes host batches from it, pins them, and copies them to the device on a side
CUDA stream, ``depth`` batches ahead, recording an event per batch; the
consumer makes its current stream wait for that event, so the copy overlaps
the previous training step without a host synchronisation. Exceptions in the
thread are re-raised in the consumer; ``close()`` stops the thread.

Without CUDA there is nothing to prefetch to: :func:`resolve_device` warns once
(as torch does for ``pin_memory``) and batches stay on the host.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data._utils.pin_memory import pin_memory as pin_structure

from raydl._internal.stream.threads import put_until_stopped

_DONE = object()


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


class DevicePrefetcher(Iterator[Any]):
    """Yields the batches of ``source`` already copied to ``device`` (CUDA only)."""

    def __init__(self, source: Any, device: torch.device, *, depth: int, name: str) -> None:
        self._source = source
        self._device = device
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._stream = torch.cuda.Stream(device=device)
        self.num_yielded = 0
        self.exhausted = False
        self._thread = threading.Thread(target=self._produce, name=name, daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return len(self._source)

    def _produce(self) -> None:
        torch.cuda.set_device(self._device)
        try:
            for batch in self._source:
                if self._stop.is_set():
                    return
                with torch.cuda.stream(self._stream):
                    moved = to_device(pin_structure(batch), self._device, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self._stream)
                self._put((moved, event))
            self._put(_DONE)
        except BaseException as err:
            self._put(err)

    def _put(self, item: Any) -> None:
        put_until_stopped(self._queue, item, self._stop)

    def __next__(self) -> Any:
        if self._stop.is_set():
            raise StopIteration
        item = self._queue.get()
        if item is _DONE:
            self.exhausted = True
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        batch, event = item
        current = torch.cuda.current_stream(self._device)
        current.wait_event(event)
        _record_stream(batch, current)
        self.num_yielded += 1
        return batch

    def close(self) -> None:
        """Stop the copy thread and the epoch underneath."""
        self.__dict__.pop("loader", None)  # a closed epoch does not keep its loader alive
        self._stop.set()
        close = getattr(self._source, "close", None)
        if close is not None:
            close()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
