"""The epoch engine's thread logic without Ray: hand-off, epoch iterator, device copy, dispatch."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from raydl._internal.epochs.overlap import NextEpoch
from raydl._internal.epochs.record import EpochRecord, EpochStart
from raydl._internal.stream.device import DeviceCopy, HostPinner, copy_stage
from raydl._internal.stream.dispatch import Dispatcher, ResultTimeout, WorkerLost
from raydl._internal.stream.epoch_iterator import EpochIterator, Producer
from raydl._internal.stream.handoff import Handoff, InlineHandoff, ItemError, Stopped
from raydl.errors import LoaderTimeoutError, WorkerDiedError

pytestmark = pytest.mark.timeout(30)


class ListProducer(Producer):
    """Hands over ``items`` from a thread, ``delay_s`` apart; counts ``taken()`` calls."""

    def __init__(
        self, items: Iterable[Any], *, delay_s: float = 0.0, fail: Exception | None = None
    ):
        self.items = list(items)
        self.taken_calls = 0
        self.closed_with: bool | None = None
        self.handoff = Handoff(maxsize=2)

        def body() -> None:
            for item in self.items:
                if delay_s:
                    time.sleep(delay_s)
                self.handoff.put(item)
            if fail is not None:
                raise fail

        self.handoff.start(body, name="raydl-test-producer")

    def taken(self, waited: float) -> None:
        self.taken_calls += 1

    def close(self, *, stalled: bool = False) -> None:
        self.closed_with = stalled
        super().close(stalled=stalled)


# -- the hand-off -------------------------------------------------------------------


def test_handoff_carries_items_then_the_end() -> None:
    h = Handoff(maxsize=1)
    h.start(lambda: [h.put(i) for i in range(5)], name="raydl-test")
    assert [h.take(0) for _ in range(5)] == list(range(5))
    with pytest.raises(StopIteration):
        h.take(0)
    with pytest.raises(StopIteration):  # and again: the end is remembered
        h.take(0)


def test_handoff_reraises_the_producers_exception_described() -> None:
    def body() -> None:
        raise KeyError("inner")

    h = Handoff()
    h.start(body, name="raydl-test", describe_error=lambda err: ValueError(f"outer {err}"))
    with pytest.raises(ValueError, match="outer 'inner'"):
        h.take(0)


def test_handoff_times_out_with_torchs_message() -> None:
    h = Handoff()
    h.start(lambda: time.sleep(2), name="raydl-test")
    with pytest.raises(LoaderTimeoutError, match=r"DataLoader timed out after 0.2 seconds"):
        h.take(0.2)
    h.stop(join_s=0)


def test_handoff_names_a_thread_that_died_without_a_word() -> None:
    broken = Handoff()
    thread = threading.Thread(target=lambda: None, name="raydl-broken")
    broken._thread = thread
    thread.start()
    thread.join()
    with pytest.raises(RuntimeError, match="raydl-broken thread ended without a result"):
        broken.take(0)


def test_a_stopped_handoff_unblocks_its_producer_and_its_consumer() -> None:
    h = Handoff(maxsize=1)
    unwound = threading.Event()

    def body() -> None:
        try:
            while True:
                h.put("x")
        except Stopped:
            unwound.set()
            raise

    h.start(body, name="raydl-test")
    assert h.take(0) == "x"
    h.stop()
    assert unwound.is_set()
    assert h.thread is not None and not h.thread.is_alive()


def test_handoff_never_loses_a_wake_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The consumer waits on a lock the producer releases when it sees the consumer's flag;
    a wake-up lost between the flag and the wait would block the consumer for a whole
    slice. With the slice longer than the test's timeout, a lost one fails the test (it
    does without the consumer's look-again after raising its flag). The GIL is handed over
    every 10 us, so the two threads interleave at every bytecode or so. (A producer waiting
    for room looks again by itself every 1-10 ms, so its side cannot hang.)"""
    from raydl._internal.stream import handoff

    monkeypatch.setattr(handoff, "SLICE_S", 600.0)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        count = 20_000
        for maxsize in (1, 2):
            h = Handoff(maxsize=maxsize)
            h.start(lambda h=h: [h.put(i) for i in range(count)], name="raydl-test")
            assert [h.take(0) for _ in range(count)] == list(range(count))
            with pytest.raises(StopIteration):
                h.take(0)
    finally:
        sys.setswitchinterval(switch)


# -- the epoch iterator -------------------------------------------------------------


def test_epoch_iterator_counts_from_a_resumed_offset_and_calls_taken() -> None:
    producer = ListProducer(range(3))
    iterator = EpochIterator(producer, epoch=4, skip=7, length=10)
    assert list(iterator) == [0, 1, 2]
    assert iterator.num_yielded == 10
    assert iterator.exhausted
    assert producer.taken_calls == 3
    assert iterator.stats.batches == 3
    assert producer.closed_with is False


def test_an_exception_closes_the_epoch_and_is_raised() -> None:
    producer = ListProducer([1], fail=OSError("disk"))
    iterator = EpochIterator(producer, epoch=0)
    assert next(iterator) == 1
    with pytest.raises(OSError, match="disk"):
        next(iterator)
    assert producer.closed_with is False
    with pytest.raises(StopIteration):
        next(iterator)


def test_a_timeout_closes_the_producer_as_stalled() -> None:
    producer = ListProducer([1], delay_s=2.0)
    iterator = EpochIterator(producer, epoch=0, timeout=0.2)
    with pytest.raises(LoaderTimeoutError):
        next(iterator)
    assert producer.closed_with is True


def test_exhaustion_runs_on_exhausted_once_after_the_summary() -> None:
    calls: list[int] = []
    iterator = EpochIterator(ListProducer([1, 2]), epoch=0, on_exhausted=lambda: calls.append(1))
    assert list(iterator) == [1, 2]
    with pytest.raises(StopIteration):
        next(iterator)
    assert calls == [1]


# -- the device copy stage (its copy step injected) ------------------------------------


def test_handoff_notes_items_on_the_producers_thread() -> None:
    h = Handoff(maxsize=4)
    h.note_items(lambda item: (item * 10, threading.current_thread().name))
    error = ItemError(ValueError("bad sample"))
    h.start(lambda: [h.put(1), h.put(error), h.put(2)], name="raydl-test-producer")
    assert h.take(5) == 1 and h.last_note == (10, "raydl-test-producer")
    assert h.take(5) is error and h.last_note is None  # a failed item is raised, not read
    assert h.take(5) == 2 and h.last_note == (20, "raydl-test-producer")
    with pytest.raises(StopIteration):
        h.take(5)


def test_an_item_whose_note_fails_arrives_without_one() -> None:
    h = Handoff(maxsize=1)
    h.note_items(lambda item: 1 / item)
    h.start(lambda: [h.put(0), h.put(4)], name="raydl-test-producer")
    assert h.take(5) == 0 and h.last_note is None  # the consumer reads it itself
    assert h.take(5) == 4 and h.last_note == 0.25


class ReadBy:
    """A batch leaf that records which thread the epoch's statistics read it on."""

    def __init__(self, value: int) -> None:
        self.value = value
        self.threads: set[str] = set()

    def __repr__(self) -> str:  # what the fingerprint reads of a leaf it has no rule for
        self.threads.add(threading.current_thread().name)
        return f"ReadBy({self.value})"


class GatedProducer(Producer):
    """Hands over ``items`` from a thread once :attr:`go` is set."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.go = threading.Event()
        self.handoff = Handoff(maxsize=2)

        def body() -> None:
            self.go.wait(5)
            for item in items:
                self.handoff.put(item)

        self.handoff.start(body, name="raydl-test-producer")


@pytest.mark.parametrize("device_stage", [False, True])
def test_the_epochs_fingerprint_reads_batches_on_the_producers_thread(device_stage: bool) -> None:
    from raydl._internal.stream.metrics import fingerprint_step

    batches = [{"x": ReadBy(i)} for i in range(5)]
    source = GatedProducer(batches)
    producer: Producer = source
    if device_stage:  # the copy stage's items are copies in flight: the trainer reads batches
        producer = DeviceCopy(source, FakeCopier(), depth=2, name="raydl-test-copy")
    iterator = EpochIterator(producer, epoch=0)
    source.go.set()
    assert list(iterator) == batches
    trainer = threading.current_thread().name
    reader = trainer if device_stage else "raydl-test-producer"
    assert all(b["x"].threads == {reader} for b in batches)
    expected = ""  # the fingerprint, as the trainer's thread would have computed it
    for batch in batches:
        expected = fingerprint_step(expected, batch)
    assert iterator.stats.fingerprint == expected and iterator.stats.samples == 5


class FakeCopier:
    """Records which thread did what; the 'device' batch is the host batch tagged."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.copy_threads: set[str] = set()
        self.ready_threads: set[str] = set()
        self.started = 0

    def start(self) -> None:
        self.started += 1

    def copy(self, batch: Any) -> Any:
        self.copy_threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        return ("on-device", batch)

    def ready(self, token: Any) -> Any:
        self.ready_threads.add(threading.current_thread().name)
        return token[1]


class ThreadRecordingBar:
    def __init__(self) -> None:
        self.threads: set[str] = set()
        self.count = 0

    def update(self, n: int) -> None:
        self.threads.add(threading.current_thread().name)
        self.count += n

    def close(self) -> None:
        pass


def test_device_copy_counts_from_the_resumed_offset() -> None:
    """A state taken after a resume counts the batches before it (issue 14's device bug 1)."""
    source = ListProducer(range(4))
    copier = FakeCopier()
    iterator = EpochIterator(
        DeviceCopy(source, copier, depth=2, name="raydl-test-copy"), epoch=0, skip=5
    )
    assert next(iterator) == 0
    assert iterator.num_yielded == 6  # 5 consumed before the resume, 1 now
    assert list(iterator) == [1, 2, 3]
    assert iterator.num_yielded == 9
    assert copier.started == 1
    assert copier.copy_threads == {"raydl-test-copy"}
    assert copier.ready_threads == {threading.current_thread().name}


def test_device_copy_wait_and_progress_are_the_trainers() -> None:
    """The trainer's wait is timed in its own next(), not in the copy thread (device bug 2)."""
    copier = FakeCopier(delay_s=0.1)
    iterator = EpochIterator(
        DeviceCopy(ListProducer(range(3)), copier, depth=1, name="raydl-test-copy"), epoch=0
    )
    bar = iterator.progress = ThreadRecordingBar()
    assert list(iterator) == [0, 1, 2]
    assert bar.count == 3 and bar.threads == {threading.current_thread().name}
    # Each batch took the copy's 0.1 s to arrive, and the trainer waited for it.
    assert iterator.stats.wait_s >= 0.25


def test_device_copy_passes_taken_through_and_closes_its_source() -> None:
    source = ListProducer(range(10))
    iterator = EpochIterator(DeviceCopy(source, FakeCopier(), depth=2, name="t"), epoch=0)
    next(iterator)
    next(iterator)
    assert source.taken_calls == 2  # a map-style sampler is drawn on the trainer's thread
    iterator.close()
    assert source.closed_with is False
    assert source.handoff.stopped


def test_pin_memory_pins_on_the_stage_thread_with_one_intra_op_thread() -> None:
    """As torch's pin-memory thread: off the trainer's thread, one OpenMP thread, in order."""
    seen: list[tuple[str, int]] = []

    def pin(batch: Any) -> Any:
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return ("pinned", batch)

    threads = torch.get_num_threads()
    stage = DeviceCopy(ListProducer(range(5)), HostPinner(pin), depth=2, name="raydl-test-pin")
    assert list(EpochIterator(stage, epoch=0)) == [("pinned", i) for i in range(5)]
    assert seen == [("raydl-test-pin", 1)] * 5
    assert torch.get_num_threads() == threads  # the trainer's thread's count is untouched


def test_a_failed_batch_passes_the_pin_stage_and_the_epoch_goes_on() -> None:
    items = [0, ItemError(ValueError("bad sample 1")), 2]
    iterator = EpochIterator(
        DeviceCopy(ListProducer(items), HostPinner(), depth=2, name="raydl-test-pin"), epoch=0
    )
    assert next(iterator) == 0
    with pytest.raises(ValueError, match="bad sample 1"):
        next(iterator)
    assert next(iterator) == 2
    assert iterator.num_yielded == 3


class InlineProducer(Producer):
    """``num_workers=0``'s producer: each item made inside ``take``, on the caller's thread."""

    def __init__(self, items: Iterable[Any]) -> None:
        it = iter(items)
        self.made_on: list[str] = []

        def make() -> Any:
            self.made_on.append(threading.current_thread().name)
            return next(it)

        self.handoff = InlineHandoff(make)


def test_copy_stage_is_there_only_to_pin_or_to_move() -> None:
    source = ListProducer(range(2))
    assert copy_stage(source, device=None, pin=False, depth=2, epoch=0) is source
    pinned = copy_stage(ListProducer(range(2)), device=None, pin=True, depth=2, epoch=3)
    assert isinstance(pinned, DeviceCopy) and not isinstance(pinned.handoff, InlineHandoff)
    pinned.close()
    inline = copy_stage(InlineProducer(range(2)), device=None, pin=True, depth=2, epoch=0)
    assert isinstance(inline, DeviceCopy) and isinstance(inline.handoff, InlineHandoff)
    # The trainer's stand-ins load in deliver(), on the trainer's thread: pinned there too.
    standing_in = ListProducer(range(2))
    standing_in.loads_in_deliver = True
    here = copy_stage(standing_in, device=None, pin=True, depth=2, epoch=0)
    assert isinstance(here, DeviceCopy) and isinstance(here.handoff, InlineHandoff)
    assert list(EpochIterator(here, epoch=0)) == [0, 1]


def test_without_workers_batches_are_made_and_pinned_in_the_trainers_next() -> None:
    """As torch pins with ``num_workers=0``: no thread; the trainer's own thread count."""
    seen: list[tuple[str, int]] = []

    def pin(batch: Any) -> Any:
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return ("pinned", batch)

    source = InlineProducer(range(3))
    stage = DeviceCopy(source, HostPinner(pin), depth=2, name="unused", inline=True)
    assert list(EpochIterator(stage, epoch=0)) == [("pinned", i) for i in range(3)]
    me = threading.current_thread().name
    assert seen == [(me, torch.get_num_threads())] * 3
    assert source.made_on == [me] * 4  # the fourth take ended the epoch


# -- dispatch over fake calls -----------------------------------------------------------


class FakeRef:
    def __init__(self, actor: FakeActor, arg: Any) -> None:
        self.actor, self.arg = actor, arg
        self.ready_at = time.monotonic() + actor.delays.get(arg, 0.0)


class FakeActor:
    def __init__(self, name: str, delays: dict[Any, float], dies_on: set[Any]) -> None:
        self.name, self.delays, self.dies_on = name, delays, dies_on
        self.dead = False
        self.calls: list[Any] = []


class FakeCalls:
    def __init__(self) -> None:
        self.submitted: list[tuple[str, Any]] = []

    def submit(self, actor: FakeActor, method: str, *args: Any) -> FakeRef:
        self.submitted.append((actor.name, args[0]))
        actor.calls.append(args[0])
        return FakeRef(actor, args[0])

    def get(self, ref: FakeRef, timeout: float) -> Any:
        if ref.arg in ref.actor.dies_on or ref.actor.dead:
            ref.actor.dead = True
            raise WorkerLost("RayActorError")
        wait = ref.ready_at - time.monotonic()
        if wait > timeout:
            time.sleep(timeout)
            raise ResultTimeout
        time.sleep(max(0.0, wait))
        if isinstance(ref.arg, str) and ref.arg.startswith("raise"):
            raise ValueError(ref.arg)
        return f"{ref.arg}@{ref.actor.name}"

    def wait(self, refs: Sequence[FakeRef], timeout: float) -> list[FakeRef]:
        deadline = time.monotonic() + timeout
        while True:
            ready = [r for r in refs if r.ready_at <= time.monotonic() or r.actor.dead]
            if ready or time.monotonic() >= deadline:
                return sorted(ready, key=lambda r: r.ready_at)[:1]
            time.sleep(0.005)


class FakePool:
    def __init__(self, n: int, delays: dict[Any, float] | None = None, dies_on: Any = ()):
        self.delays = delays or {}
        self.dies_on = set(dies_on)
        self.restarts = 0
        self.actors = [FakeActor(f"w{i}", self.delays, self.dies_on) for i in range(n)]

    def restart(self, worker_id: int, dead: Any) -> Any:
        self.restarts += 1
        self.dies_on.clear()  # the fresh worker loads what killed the old one
        self.actors[worker_id] = FakeActor(f"w{worker_id}'", self.delays, self.dies_on)
        return self.actors[worker_id]

    def __len__(self) -> int:
        return len(self.actors)


def _dispatcher(pool: FakePool, calls: FakeCalls, between: Any = None) -> Dispatcher:
    return Dispatcher(
        pool,
        calls,
        method="fetch",
        describe=lambda a: f"request {a!r}",
        between=between or (lambda: None),
    )


def test_round_robin_and_replies_in_request_order_despite_a_slow_worker() -> None:
    pool, calls = FakePool(2, delays={0: 0.2}), FakeCalls()
    d = _dispatcher(pool, calls)
    for arg in range(4):
        d.send(arg)
    assert [name for name, _ in calls.submitted] == ["w0", "w1", "w0", "w1"]
    assert [d.collect() for _ in range(4)] == ["0@w0", "1@w1", "2@w0", "3@w1"]
    assert not d


def test_out_of_order_completion_is_taken_first_ready_when_asked() -> None:
    pool, calls = FakePool(2, delays={0: 0.3}), FakeCalls()
    d = _dispatcher(pool, calls)
    d.send(0)
    d.send(1)
    assert d.collect(in_order=False) == "1@w1"
    assert d.collect(in_order=False) == "0@w0"


def test_a_dead_worker_is_replaced_and_its_request_retried_alone_first() -> None:
    pool, calls = FakePool(2, dies_on={2}), FakeCalls()
    d = _dispatcher(pool, calls)
    for arg in range(6):
        d.send(arg)
    replies = [d.collect() for _ in range(6)]
    assert replies == ["0@w0", "1@w1", "2@w0'", "3@w1", "4@w0'", "5@w1"]
    assert pool.restarts == 1
    # The retry went out before the dead worker's held request 4 was sent again.
    resent = [arg for name, arg in calls.submitted if name == "w0'"]
    assert resent == [2, 4]


def test_a_request_that_kills_every_worker_is_named_after_the_retries() -> None:
    pool, calls = FakePool(1, dies_on={0}), FakeCalls()

    def restart_dying(worker_id: int, dead: Any) -> Any:
        pool.restarts += 1
        pool.actors[worker_id] = FakeActor(f"w{pool.restarts}", pool.delays, pool.dies_on)
        return pool.actors[worker_id]

    pool.restart = restart_dying  # type: ignore[method-assign]
    d = _dispatcher(pool, calls)
    d.send(0)
    with pytest.raises(WorkerDiedError, match=r"died while loading request 0 \(retried 2 times"):
        d.collect()
    assert pool.restarts == 2


def test_a_tasks_own_exception_is_raised_as_is() -> None:
    d = _dispatcher(FakePool(1), FakeCalls())
    d.send("raise me")
    with pytest.raises(ValueError, match="raise me"):
        d.collect()


def test_close_during_a_pending_request_stops_the_wait() -> None:
    stop = threading.Event()

    def between() -> None:
        if stop.is_set():
            raise Stopped

    d = _dispatcher(FakePool(1, delays={0: 10.0}), FakeCalls(), between)
    d.send(0)
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with pytest.raises(Stopped):
        d.collect()
    assert time.monotonic() - started < 5


def test_sending_to_a_stopped_pool_says_so() -> None:
    pool = FakePool(1)
    pool.actors = []
    with pytest.raises(RuntimeError, match=r"loader.close\(\)"):
        _dispatcher(pool, FakeCalls()).send(0)


# -- the early epoch ------------------------------------------------------------------------


def _started(epoch: int) -> tuple[EpochStart, ListProducer]:
    producer = ListProducer([epoch])
    return EpochStart(producer, EpochRecord(epoch=epoch)), producer


def test_next_epoch_hands_over_the_epoch_it_started() -> None:
    early = NextEpoch()
    started, _ = _started(3)
    assert early.start(3, lambda: started)
    assert not early.start(4, lambda: _started(4)[0])  # one at a time
    assert early.epoch == 3
    assert early.take(3) is started
    assert early.epoch is None


def test_next_epoch_closes_an_epoch_that_is_not_asked_for() -> None:
    early = NextEpoch()
    started, producer = _started(3)
    early.start(3, lambda: started)
    assert early.take(5) is None
    assert producer.closed_with is False


def test_a_failed_early_build_is_nothing_to_take() -> None:
    early = NextEpoch()

    def fails() -> EpochStart:
        raise OSError("listing failed")

    early.start(1, fails)
    assert early.take(1) is None


def test_tensors_pass_through_unchanged() -> None:
    batch = {"x": torch.arange(3)}
    iterator = EpochIterator(ListProducer([batch]), epoch=0)
    assert next(iterator) is batch


def test_discarding_from_the_build_thread_itself_does_not_wait_for_itself() -> None:
    """A loader collected on the prestart thread discards its early epoch from there."""
    early = NextEpoch()
    done = threading.Event()

    def build() -> EpochStart:
        early.discard()  # what a loader's __del__ does when the GC runs on this thread
        done.set()
        return _started(2)[0]

    early.start(2, build)
    assert done.wait(5)
    assert early.take(2) is None


def test_discard_waits_for_a_running_build_and_closes_what_it_built() -> None:
    early = NextEpoch()
    started, producer = _started(1)
    release = threading.Event()

    def build() -> EpochStart:
        release.wait(5)
        return started

    early.start(1, build)
    threading.Timer(0.2, release.set).start()
    early.discard()
    assert producer.closed_with is False  # built after the discard began, closed by it


# -- the Ray Data producer over a fake DataIterator ---------------------------------------


class FakeDataIterator:
    """Ray Data's iterator hooks that RayIteration wraps, over numpy blocks."""

    def __init__(self, blocks: int, delay_s: float) -> None:
        self.blocks, self.delay_s = blocks, delay_s
        self.stats_calls = 0

    def _to_ref_bundle_iterator(self) -> tuple[Any, Any, Any]:
        return (None, None, None)

    def _create_batch_iterator(self, *args: Any, **kwargs: Any) -> Any:
        return iter(())

    def iter_batches(self, **kwargs: Any) -> Any:
        for i in range(self.blocks):
            time.sleep(self.delay_s)
            yield {"x": np.arange(i * 4, i * 4 + 4)}

    def stats(self) -> str:
        self.stats_calls += 1
        return "stats"


def _ray_producer(source: FakeDataIterator, asked: list[int], **kwargs: Any) -> Any:
    from raydl._internal.stream.ray_producer import RayDataProducer

    return RayDataProducer(
        source,
        batch_size=4,
        drop_last=False,
        local_shuffle_buffer_size=None,
        local_shuffle_seed=None,
        collate=lambda batch: batch["x"].tolist(),
        prefetch=1,
        epoch=0,
        start_next=lambda: asked.append(1) is None,
        **kwargs,
    )


def test_a_ray_epoch_delivers_skips_and_asks_for_the_next_epoch_at_its_end() -> None:
    source, asked = FakeDataIterator(blocks=3, delay_s=0), []
    iterator = EpochIterator(_ray_producer(source, asked, skip=1), epoch=0, skip=1)
    assert list(iterator) == [[4, 5, 6, 7], [8, 9, 10, 11]]
    assert iterator.num_yielded == 3
    assert asked == [1] and source.stats_calls == 1
    assert iterator.stats.ray_data == "stats"


def test_a_ray_epoch_closed_early_asks_for_nothing_more() -> None:
    """A break stops the producer: no next epoch, no stats call (a Ray call on a split)."""
    source, asked = FakeDataIterator(blocks=50, delay_s=0.01), []
    iterator = EpochIterator(_ray_producer(source, asked), epoch=0)
    assert next(iterator) == [0, 1, 2, 3]
    iterator.close()
    assert asked == [] and source.stats_calls == 0


class RunCalls(FakeCalls):
    """Actors that load a run ``("run", i)`` as one block of rows ``i*10 .. i*10+9``.

    A warm-up (``"warm"``) answers after ``start_s`` (the actor's process and imports).
    """

    def __init__(self, start_s: float) -> None:
        super().__init__()
        self.start_s = start_s

    def submit(self, actor: FakeActor, method: str, *args: Any) -> FakeRef:
        ref = super().submit(actor, method, *args)
        ref.ready_at = time.monotonic() + (self.start_s if args[0] == "warm" else 0.0)
        return ref

    def get(self, ref: FakeRef, timeout: float) -> Any:
        super().get(ref, timeout)
        return [] if ref.arg == "warm" else _run_blocks(ref.arg)


def _run_blocks(request: tuple[str, int]) -> list[dict[str, np.ndarray]]:
    return [{"x": np.arange(request[1] * 10, request[1] * 10 + 10)}]


def _direct_epoch(
    calls: RunCalls,
    local: Any,
    *,
    ray_up: Any = None,
    made: list[Any] | None = None,
    start_next: Any = None,
) -> tuple[list[list[int]], Any]:
    """A direct epoch of 8 runs on fakes; with ``ray_up``, its actors are made (noted in
    ``made``) once it answers ``True``."""
    from raydl._internal.stream.batching import cut_batches
    from raydl._internal.stream.direct_producer import DirectProducer
    from raydl._internal.stream.dispatch import Actors, ActorStart, LateActors

    start = ActorStart("fetch", "warm") if local is not None else None

    def actors() -> Actors:
        if made is not None:
            made.append(time.monotonic())
        return Actors(FakePool(2), start=start)

    producer = DirectProducer(
        LateActors(actors, ray_up or (lambda: True), calls),
        [("run", i) for i in range(8)],
        window_per_actor=2,
        prefetch=2,
        cut=lambda blocks: cut_batches(blocks, batch_size=7, drop_last=False, buffer=30, seed=5),
        collate=lambda batch: batch["x"].tolist(),
        skip=0,
        start_next=start_next,
        window_bytes=1 << 30,
        size_of=lambda blocks: sum(b["x"].nbytes for b in blocks),
        describe=repr,
        description="runs",
        name="test-direct",
        calls=calls,
        local=local,
    )
    return list(EpochIterator(producer, epoch=0)), producer


def test_a_pools_first_runs_load_here_while_its_actors_start_with_the_same_batches() -> None:
    """The batches (local buffer included) are those of an epoch loaded on the actors alone."""
    on_actors, _ = _direct_epoch(RunCalls(start_s=0.0), local=None)
    here: list[Any] = []

    def local(request: tuple[str, int]) -> list[dict[str, np.ndarray]]:
        here.append(request)
        time.sleep(0.05)
        return _run_blocks(request)

    calls = RunCalls(start_s=0.12)
    bridged, producer = _direct_epoch(calls, local=local)
    assert bridged == on_actors
    assert sorted(x for batch in bridged for x in batch) == list(range(80))
    assert here and here == [("run", i) for i in range(len(here))]  # the first runs, in order
    assert len(here) < 8 and producer.loaded_here == len(here)
    sent = [arg for _, arg in calls.submitted]
    assert sent[:2] == ["warm", "warm"]  # every actor's warm-up first, then the other runs
    assert sent[2:] == [("run", i) for i in range(len(here), 8)]
    assert f"{len(here)} runs loaded in the training process" in (producer.summary() or "")


def test_when_the_actors_start_slower_than_the_epoch_it_all_loads_here() -> None:
    here: list[Any] = []

    def local(request: tuple[str, int]) -> list[dict[str, np.ndarray]]:
        here.append(request)
        return _run_blocks(request)

    calls = RunCalls(start_s=5.0)
    batches, producer = _direct_epoch(calls, local=local)
    assert sorted(x for batch in batches for x in batch) == list(range(80))
    assert len(here) == producer.loaded_here == 8 and [arg for _, arg in calls.submitted] == [
        "warm",
        "warm",
    ]


def test_runs_load_here_until_ray_is_up_then_the_actors_are_made_once() -> None:
    """An epoch started while Ray starts (a raydl read's plan): the same batches."""
    on_actors, _ = _direct_epoch(RunCalls(start_s=0.0), local=None)
    here: list[Any] = []

    def local(run: tuple[str, int]) -> list[dict[str, np.ndarray]]:
        here.append(run)
        time.sleep(0.05)
        return _run_blocks(run)

    up_at = time.monotonic() + 0.12
    made: list[float] = []
    calls = RunCalls(start_s=0.0)
    bridged, producer = _direct_epoch(
        calls, local=local, ray_up=lambda: time.monotonic() >= up_at, made=made
    )
    assert bridged == on_actors
    assert 0 < len(here) < 8 and here == [("run", i) for i in range(len(here))]
    assert len(made) == 1 and made[0] >= up_at  # made once, after Ray was up
    assert [arg for _, arg in calls.submitted][2:] == [("run", i) for i in range(len(here), 8)]
    assert f"{len(here)} runs loaded in the training process" in (producer.summary() or "")


def test_an_epoch_that_loaded_every_run_before_ray_is_up_ends_without_it() -> None:
    here: list[Any] = []
    asked: list[bool] = []

    def local(run: tuple[str, int]) -> list[dict[str, np.ndarray]]:
        here.append(run)
        return _run_blocks(run)

    def start_next() -> bool:
        asked.append(True)
        return True

    made: list[float] = []
    batches, producer = _direct_epoch(
        RunCalls(start_s=0.0), local=local, ray_up=lambda: False, made=made, start_next=start_next
    )
    assert sorted(x for batch in batches for x in batch) == list(range(80))
    assert len(here) == producer.loaded_here == 8 and not made  # Ray never came up
    assert asked == [True]  # the next epoch was still asked to start early


def test_epochs_that_share_a_pool_send_its_warm_ups_once() -> None:
    from raydl._internal.stream.dispatch import ActorStart

    start, calls, pool = ActorStart("fetch", "warm"), RunCalls(start_s=0.2), FakePool(2)
    assert start.starting(pool, calls) and start.starting(pool, calls)  # never waits
    time.sleep(0.25)
    assert not start.starting(pool, calls)
    assert [arg for _, arg in calls.submitted] == ["warm", "warm"]


class StandIns:
    """The trainer's stand-ins for a pool's workers (``EmulatedWorkers``' interface)."""

    def __init__(self, num_workers: int) -> None:
        self.spec = type("Spec", (), {"num_workers": num_workers})()
        self.loads: list[tuple[Any, int, str]] = []
        self.handed: list[int] = []

    def fetch(self, indices: Any, worker_id: int) -> Any:
        self.loads.append((indices, worker_id, threading.current_thread().name))
        time.sleep(0.03)
        return f"{indices}@here{worker_id}"

    def handover(self) -> dict[int, str]:
        workers = sorted({worker for _, worker, _ in self.loads})
        self.handed = workers
        return {worker: f"rng{worker}" for worker in workers}


class ReadyCalls(FakeCalls):
    """Actors whose ``ready`` answers after ``start_s``; ``fetch`` answers at once."""

    def __init__(self, start_s: float) -> None:
        super().__init__()
        self.start_s = start_s
        self.methods: list[tuple[str, str, Any]] = []

    def submit(self, actor: FakeActor, method: str, *args: Any) -> FakeRef:
        self.methods.append((actor.name, method, args[0] if args else None))
        ref = super().submit(actor, method, *(args or (method,)))
        ref.ready_at = time.monotonic() + (self.start_s if method == "ready" else 0.0)
        return ref


def _map_style_epoch(
    calls: ReadyCalls, stand_ins: StandIns, batches: int, tuner: Any = None
) -> list[Any]:
    from raydl._internal.stream.dispatch import ActorStart
    from raydl._internal.stream.pool_producers import MapStyleProducer

    start = ActorStart("ready")
    producer = MapStyleProducer(
        FakePool(2),
        enumerate(range(batches)),
        lookahead=4 if tuner is None else tuner.depth,
        in_order=True,
        calls=calls,
        tuner=tuner,
        here=stand_ins,  # type: ignore[arg-type]
        start_of=lambda pool: start,
    )
    assert producer.loads_in_deliver  # a copy stage must take its items on this thread
    got = []
    for batch in EpochIterator(producer, epoch=0):
        got.append(batch)
        time.sleep(0.02)  # the training step
    return got


def test_map_style_first_batches_load_on_the_trainers_thread_as_the_worker_torch_would_use() -> (
    None
):
    """Batch k is worker k % 2's, here or on its actor; actors go on from the stand-ins' RNG."""
    stand_ins, calls = StandIns(2), ReadyCalls(start_s=0.2)
    got = _map_style_epoch(calls, stand_ins, batches=40)
    here = len(stand_ins.loads)
    assert 0 < here < 40
    assert [(i, w) for i, w, _ in stand_ins.loads] == [(i, i % 2) for i in range(here)]
    assert {thread for _, _, thread in stand_ins.loads} == {threading.current_thread().name}
    # Batch k, from worker k % 2, in order: the first ones here, the rest on the actors.
    assert got == [f"{k}@here{k % 2}" if k < here else f"{k}@w{k % 2}" for k in range(40)]
    # Each actor was told its worker's RNG states before its first batch of the epoch.
    fetches = [(actor, method, arg) for actor, method, arg in calls.methods if method != "ready"]
    for worker in (0, 1):
        mine = [(method, arg) for actor, method, arg in fetches if actor == f"w{worker}"]
        assert mine[0] == ("continue_from", f"rng{worker}")
        assert [arg for _, arg in mine[1:]] == list(range(here + (worker - here) % 2, 40, 2))


def _recording_tuner(**args: Any) -> Any:
    """An ``AutoTuner`` that records its epoch starts and observations, in order."""
    from raydl._internal.stream.autotune import AutoTuner

    class Recording(AutoTuner):
        def __init__(self) -> None:
            super().__init__(**args)
            self.events: list[str] = []

        def start_epoch(self, epoch: int) -> None:
            self.events.append("start")
            super().start_epoch(epoch)

        def observe(self, *, waited: float, at: float) -> None:
            self.events.append("observe")
            super().observe(waited=waited, at=at)

    return Recording()


def test_with_auto_the_trainer_stands_in_for_worker_0_and_the_rule_measures_the_actors_only() -> (
    None
):
    stand_ins, calls = StandIns(2), ReadyCalls(start_s=0.3)
    tuner = _recording_tuner(budget=2, workers=1, factor=2, auto_workers=True, auto_factor=False)
    got = _map_style_epoch(calls, stand_ins, batches=40, tuner=tuner)
    here = len(stand_ins.loads)
    assert 0 < here < 40
    assert [(i, w) for i, w, _ in stand_ins.loads] == [(i, 0) for i in range(here)]
    assert got[:here] == [f"{k}@here0" for k in range(here)]
    assert [int(batch.split("@")[0]) for batch in got] == list(range(40))  # each once, in order
    assert all(batch.split("@")[1] in ("w0", "w1") for batch in got[here:])
    # Worker 0's actor goes on from the trainer's RNG states, before its first batch.
    fetches = [(actor, method, arg) for actor, method, arg in calls.methods if method != "ready"]
    assert fetches[0] == ("w0", "continue_from", "rng0")
    assert [method for _, method, _ in fetches].count("continue_from") == 1
    # The rule starts at the hand-over and sees the actors' batches only (the takes of the
    # last batches in flight may come after the fetch thread ended).
    assert tuner.events[0] == "start" and tuner.events.count("start") == 1
    assert 40 - here - tuner.max_depth <= tuner.events.count("observe") <= 40 - here


def test_prefetch_auto_with_a_fixed_count_loads_here_as_the_worker_torch_would_use() -> None:
    stand_ins, calls = StandIns(2), ReadyCalls(start_s=0.3)
    tuner = _recording_tuner(budget=2, workers=2, factor=2, auto_workers=False, auto_factor=True)
    got = _map_style_epoch(calls, stand_ins, batches=40, tuner=tuner)
    here = len(stand_ins.loads)
    assert 0 < here < 40
    assert [(i, w) for i, w, _ in stand_ins.loads] == [(i, i % 2) for i in range(here)]
    assert got == [f"{k}@here{k % 2}" if k < here else f"{k}@w{k % 2}" for k in range(40)]
    assert tuner.events[0] == "start"


def test_map_style_epoch_shorter_than_the_actors_start_loads_all_here_and_hands_nothing_over() -> (
    None
):
    stand_ins, calls = StandIns(2), ReadyCalls(start_s=5.0)
    got = _map_style_epoch(calls, stand_ins, batches=6)
    assert got == [f"{k}@here{k % 2}" for k in range(6)]
    assert stand_ins.handed == []  # a persistent pool's next epoch goes on from the stand-ins
    assert [method for _, method, _ in calls.methods] == ["ready", "ready"]


def test_actors_that_are_up_take_the_first_batches() -> None:
    stand_ins, calls = StandIns(2), ReadyCalls(start_s=0.0)
    got = _map_style_epoch(calls, stand_ins, batches=6)
    assert got == [f"{k}@w{k % 2}" for k in range(6)] and stand_ins.loads == []
