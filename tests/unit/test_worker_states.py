"""Snapshots of Stateful workers: which requests carry a state, which snapshot a state records."""

from __future__ import annotations

from raydl._internal.stream.worker_states import NO_STATE, Snapshot, StateTracker, asks_state
from raydl._internal.workers import stateful


def test_each_worker_is_asked_once_per_n_steps_round_robin() -> None:
    asked = [p for p in range(24) if asks_state(p, every=6, workers=3)]
    assert asked == [3, 4, 5, 9, 10, 11, 15, 16, 17, 21, 22, 23]
    assert {p % 3 for p in asked[:3]} == {0, 1, 2}
    assert all(asks_state(p, every=1, workers=2) for p in range(5))
    assert not any(asks_state(p, every=None, workers=2) for p in range(5))
    assert not any(asks_state(p, every=0, workers=2) for p in range(5))


def _tracker(every: int | None, asked_only: bool = True) -> StateTracker:
    """Two workers, round-robin from worker 0, batches 0-7 loaded, states where asked."""
    tracker = StateTracker(every, 2, base=Snapshot(0, 0, ["w0@start", "w1@start"]))
    for position in range(8):
        worker = position % 2
        asked = tracker.asks(position) or not asked_only
        tracker.loaded(position, worker, f"w{worker}@{position}" if asked else NO_STATE)
    return tracker


def test_the_latest_complete_snapshot_within_what_was_delivered() -> None:
    assert _tracker(4).snapshot(7) == Snapshot(4, 0, ["w0@2", "w1@3"])
    assert _tracker(4).snapshot(8) == Snapshot(8, 0, ["w0@6", "w1@7"])
    assert _tracker(4).snapshot(3) == Snapshot(0, 0, ["w0@start", "w1@start"])
    assert _tracker(1).snapshot(5) == Snapshot(5, 1, ["w0@4", "w1@3"])
    assert _tracker(None).snapshot(8) == Snapshot(0, 0, ["w0@start", "w1@start"])


def test_a_snapshot_whose_worker_state_is_missing_falls_back_to_an_earlier_one() -> None:
    tracker = StateTracker(2, 2, base=Snapshot(0, 0, ["a", "b"]))
    tracker.loaded(0, 0, "a0")
    tracker.loaded(1, 1, "b1")
    tracker.loaded(2, 0, "a2")
    tracker.loaded(3, 1)  # its reply carried no state: step 4 is not complete
    assert tracker.snapshot(4) == Snapshot(2, 0, ["a0", "b1"])


def test_snapshots_round_trip_through_their_dict() -> None:
    snapshot = Snapshot(6, 1, [{"dataset": {"n": 3}}, None])
    assert Snapshot.from_dict(snapshot.to_dict()) == snapshot


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def test_what_a_worker_captures_follows_torchdatas_rules() -> None:
    dataset = _Counter()
    dataset.n = 4
    assert stateful.capture(dataset, None, iterable=False) == {"dataset": {"n": 4}}
    assert stateful.capture(object(), None, iterable=False) is None
    iterator = _Counter()
    iterator.n = 2
    both = stateful.capture(dataset, iterator, iterable=True)  # type: ignore[arg-type]
    assert both == {"iterator": {"n": 2}, "dataset": {"n": 4}}
    # An iterable dataset that is its own iterator: its state is the iterator's.
    assert stateful.capture(dataset, dataset, iterable=True) == {"iterator": {"n": 4}}  # type: ignore[arg-type]
    fresh = _Counter()
    stateful.restore_dataset(fresh, both)
    assert fresh.n == 4
