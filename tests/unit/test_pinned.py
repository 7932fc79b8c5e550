"""stream/pinned.py and the staged device copy: one copy into pooled pinned buffers, reused safely.

No CUDA here: the pinning allocator is injected (plain CPU bytes, counted) and the
device side is a fake whose copy is asynchronous: it reads the pinned buffer only
when its event is queried or waited for, as a DMA engine would. A buffer reused
too early would show up as a delivered batch with another batch's values.
"""

from __future__ import annotations

import ctypes
import threading
from collections import namedtuple
from collections.abc import Iterable
from typing import Any

import pytest
import torch

from raydl._internal.stream.device import DeviceCopy, StagedCopier
from raydl._internal.stream.epoch_iterator import EpochIterator, Producer
from raydl._internal.stream.handoff import Handoff
from raydl._internal.stream.pinned import PinnedPool

pytestmark = pytest.mark.timeout(30)

Pair = namedtuple("Pair", ["image", "label"])


class Bytes:
    """A fake pinning allocator: plain CPU bytes, each allocation recorded."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.sizes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


class Event:
    """A fence that completes when told (``finish``) or on the ``ready_after``-th query.

    Completing runs ``on_done`` (the copy landing) before the fence reads done.
    """

    def __init__(self, on_done: Any = None, ready_after: int = 1) -> None:
        self.queries = 0
        self.ready_after = ready_after
        self._on_done = on_done
        self._lock = threading.Lock()
        self.done = False

    def finish(self) -> None:
        with self._lock:
            if not self.done:
                if self._on_done is not None:
                    self._on_done()
                self.done = True

    def query(self) -> bool:
        with self._lock:
            self.queries += 1
            ready = self.queries >= self.ready_after
        if ready:
            self.finish()
        return self.done


def _pool(keep: int = 32) -> tuple[PinnedPool, Bytes]:
    allocate = Bytes()
    return PinnedPool(allocate, keep=keep), allocate


# -- the pool -------------------------------------------------------------------------


def test_a_batch_is_copied_once_into_pinned_buffers_and_keeps_its_structure() -> None:
    pool, allocate = _pool()
    source: dict[str, Any] = {
        "pair": Pair(torch.arange(6.0).view(2, 3), torch.tensor([1, 2])),
        "list": [torch.ones(4, dtype=torch.bool), "text", 7],
        "strided": torch.arange(12).view(3, 4)[:, ::2],
    }
    staged = pool.stage(source).batch
    assert isinstance(staged["pair"], Pair) and staged["list"][1:] == ["text", 7]
    for got, want in [
        (staged["pair"].image, source["pair"].image),
        (staged["pair"].label, source["pair"].label),
        (staged["list"][0], source["list"][0]),
        (staged["strided"], source["strided"]),
    ]:
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert got.data_ptr() != want.data_ptr()
    assert len(allocate.sizes) == 4 == pool.allocated


def test_buffers_are_reused_once_the_batch_is_dropped_and_its_copy_done() -> None:
    pool, allocate = _pool()
    first = pool.stage(torch.zeros(64))
    address = first.batch.data_ptr()
    event = Event(ready_after=99)
    first.fence(event)
    assert pool.stage(torch.zeros(64)).batch.data_ptr() != address  # still held
    del first
    held = pool.stage(torch.zeros(64))  # dropped, but its copy is still reading it
    assert held.batch.data_ptr() != address
    del held
    event.finish()
    again = pool.stage(torch.ones(64))
    assert again.batch.data_ptr() == address and torch.all(again.batch == 1)
    assert pool.reused >= 1 and pool.allocated == len(allocate.sizes) == 2


def test_a_view_the_trainer_kept_keeps_its_buffer_from_reuse() -> None:
    pool, _ = _pool()
    staged = pool.stage(torch.arange(10.0))
    kept = staged.batch[2:4]  # a view outlives the batch
    del staged
    fresh = pool.stage(torch.zeros(10))
    assert torch.equal(kept, torch.tensor([2.0, 3.0]))
    assert fresh.batch.untyped_storage().data_ptr() != kept.untyped_storage().data_ptr()


def test_shapes_and_dtypes_may_change_between_batches() -> None:
    pool, allocate = _pool()
    pool.stage(torch.zeros(8, 4, dtype=torch.float32))  # 128 bytes, dropped at once
    smaller = pool.stage(torch.arange(12, dtype=torch.int16).view(3, 4))  # 24 bytes: too small
    assert len(allocate.sizes) == 2  # the 128-byte buffer is more than twice 24 bytes
    del smaller
    last = pool.stage(torch.full((5, 4), 2.0, dtype=torch.float16))  # 40 bytes: a new one
    assert last.batch.shape == (5, 4) and last.batch.dtype == torch.float16
    assert torch.all(last.batch == 2.0)
    del last
    bigger = pool.stage(torch.ones(7, 4))  # 112 bytes: the 128-byte buffer
    assert len(allocate.sizes) == 3 and pool.reused == 1
    assert torch.all(bigger.batch == 1)
    empty = pool.stage(torch.zeros(0, 3)).batch
    assert empty.shape == (0, 3)


def test_the_pool_holds_at_most_keep_buffers() -> None:
    pool, allocate = _pool(keep=2)
    held = [pool.stage(torch.zeros(16)) for _ in range(5)]  # the trainer keeps them all
    assert len(pool) == 2 and len(allocate.sizes) == 5
    for staged, value in zip(held, range(5), strict=True):
        staged.batch.fill_(value)
    assert [int(s.batch[0]) for s in held] == [0, 1, 2, 3, 4]  # nobody shares a buffer


def test_device_tensors_pinned_ones_and_other_leaves_are_kept() -> None:
    pool, allocate = _pool()
    meta = torch.empty(3, device="meta")
    staged = pool.stage({"meta": meta, "n": None, "s": b"x"}).batch
    assert staged["meta"] is meta and staged["n"] is None and staged["s"] == b"x"
    assert allocate.sizes == []
    with pytest.raises(ValueError, match="keep must be at least 1, got 0"):
        PinnedPool(allocate, keep=0)


# -- the staged device copy -------------------------------------------------------------


class FakeDevice(StagedCopier):
    """'Device' tensors filled from the pinned buffers only when the copy's event completes.

    Like a DMA engine it holds no tensor of the buffer, only its address: a pool
    that reused the buffer before the event completed would have it read another
    batch's values.
    """

    def __init__(self, pool: PinnedPool, *, latency: int) -> None:
        super().__init__(pool)
        self.latency = latency  # queries before a copy completes
        self._pending: list[tuple[torch.Tensor, int]] = []
        self.copy_threads: set[str] = set()

    def move(self, batch: Any) -> Any:
        self.copy_threads.add(threading.current_thread().name)
        if isinstance(batch, torch.Tensor):
            out = torch.full_like(batch, -7)  # not the data until the copy completes
            self._pending.append((out, batch.data_ptr()))
            return out
        if isinstance(batch, dict):
            return {k: self.move(v) for k, v in batch.items()}
        return batch

    def record(self) -> Event:
        pending, self._pending = self._pending, []

        def land() -> None:
            for out, address in pending:
                nbytes = out.numel() * out.element_size()
                memory = (ctypes.c_uint8 * nbytes).from_address(address)
                out.view(-1).view(torch.uint8).copy_(torch.frombuffer(memory, dtype=torch.uint8))

        return Event(land, ready_after=self.latency)

    def wait(self, batch: Any, fence: Any) -> None:
        fence.finish()  # the trainer's stream waits for the copy


class Batches(Producer):
    """Hands over host batches made by ``make(i)`` from a thread."""

    def __init__(self, batches: Iterable[Any]) -> None:
        self.handoff = Handoff(maxsize=2)
        items = list(batches)

        def body() -> None:
            for item in items:
                self.handoff.put(item)

        self.handoff.start(body, name="raydl-test-batches")


def _batch(i: int, rows: int = 4) -> dict[str, torch.Tensor]:
    return {"x": torch.full((rows, 3, 8, 8), float(i)), "y": torch.full((rows,), i)}


@pytest.mark.parametrize("latency", [1, 3])
def test_device_copy_delivers_every_batch_intact_while_reusing_a_few_buffers(
    latency: int,
) -> None:
    pool, allocate = _pool(keep=16)  # every buffer in flight stays the pool's (alive)
    copier = FakeDevice(pool, latency=latency)
    sizes = [4] * 9 + [2]  # the last batch is smaller
    producer = Batches(_batch(i, rows) for i, rows in enumerate(sizes))
    iterator = EpochIterator(DeviceCopy(producer, copier, depth=2, name="raydl-test-copy"), epoch=0)
    held = []
    for i, batch in enumerate(iterator):
        held.append(batch)  # the trainer holds batch i while i+1 is copied
        if len(held) > 2:
            held.pop(0)
        assert torch.all(batch["x"] == float(i)) and torch.all(batch["y"] == i), i
        assert batch["x"].shape[0] == sizes[i]
    assert copier.copy_threads == {"raydl-test-copy"}
    assert pool.allocated < 2 * len(sizes)  # reused, not one allocation per batch
    assert pool.reused > 0
    assert len(allocate.sizes) == pool.allocated


def test_a_buffer_whose_copy_has_not_completed_is_not_overwritten() -> None:
    pool, _ = _pool()
    copier = FakeDevice(pool, latency=10**9)  # the copies complete only when waited for
    tokens = [copier.copy(_batch(i)) for i in range(4)]  # four copies in flight
    for i, token in enumerate(tokens):
        assert torch.all(copier.ready(token)["x"] == float(i))
    assert pool.reused == 0  # none was free: every copy was still reading its buffer


def test_host_arrays_reuse_memory_only_once_nothing_over_it_is_alive() -> None:
    import numpy as np

    from raydl._internal.stream.pinned import HostArrays

    arrays = HostArrays()
    small = arrays.empty((10,), np.dtype(np.float32))  # numpy's own
    first = arrays.empty((512, 1024), np.dtype(np.float32))  # 2 MiB: from the pool
    assert arrays.reused == 0 and first.flags.writeable and small.shape == (10,)
    address = first.__array_interface__["data"][0]
    second = arrays.empty((512, 1024), np.dtype(np.float32))
    assert not np.shares_memory(first, second)  # the first is alive: a new buffer
    tensor = torch.from_numpy(first[3:])  # a tensor over a view of it
    del first
    third = arrays.empty((512, 1024), np.dtype(np.float32))
    assert third.__array_interface__["data"][0] != address, "reused while a tensor held it"
    del tensor, second, third
    again = arrays.empty((1024, 256), np.dtype(np.float64))  # another shape and dtype
    assert arrays.reused == 1 and again.shape == (1024, 256) and again.dtype == np.float64


def test_batches_gathered_into_reused_memory_stay_as_they_were_delivered() -> None:
    """The local buffer's large rows go into pooled memory: batches kept are never written."""
    import numpy as np

    from raydl._internal.stream.batching import shuffle_rebatch
    from raydl._internal.stream.pinned import HostArrays

    def blocks() -> list[dict[str, np.ndarray]]:
        return [
            {"id": np.arange(i * 40, (i + 1) * 40), "x": np.full((40, 64, 128), i, np.float32)}
            for i in range(30)
        ]

    expected = list(shuffle_rebatch(iter(blocks()), 32, False, 96, 5))
    arrays = HostArrays()
    kept: list[tuple[dict[str, np.ndarray], torch.Tensor]] = []
    for i, batch in enumerate(shuffle_rebatch(iter(blocks()), 32, False, 96, 5, arrays.empty)):
        if i % 3 == 0:  # the trainer keeps every third batch (as tensors), drops the others
            kept.append((batch, torch.from_numpy(batch["x"])))
    assert arrays.reused > 0
    for batch, tensor in kept:
        want = next(e for e in expected if np.array_equal(e["id"], batch["id"]))
        assert np.array_equal(tensor.numpy(), want["x"])
        assert np.array_equal(tensor[:, 0, 0].numpy(), batch["id"] // 40)
