"""The ``num_workers="auto"`` / ``prefetch_factor="auto"`` rule (stream/autotune.py), without Ray.

A simulated loader: ``k`` workers deliver ``per_worker`` batches/s each, the trainer
takes one every ``step`` s, and the trainer's wait per batch is what the slower of
the two leaves. The rule sees only those waits and times, as on the fetch thread.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from raydl._internal.runtime import env
from raydl._internal.stream import autotune
from raydl._internal.stream.autotune import AutoTuner, worker_budget
from raydl._internal.stream.dispatch import ResultTimeout
from raydl._internal.stream.pool_producers import MapStyleProducer

pytestmark = pytest.mark.timeout(30)


def run(
    tuner: AutoTuner,
    batches: int,
    *,
    per_worker: float,
    step: float,
    cores: float = 1e9,
    factor_helps: bool = False,
    clock: float = 0.0,
) -> float:
    """Feed ``batches`` batches; new workers are admitted at once. Returns the clock."""
    for _ in range(batches):
        workers = min(tuner.workers, cores)
        supply = workers * per_worker * (1.0 if not factor_helps else min(1.0, tuner.factor / 4))
        period = max(step, 1.0 / supply)
        waited = period - step
        clock += period
        tuner.observe(waited=waited, at=clock)
        if tuner.want > tuner.workers:
            tuner.admitted(tuner.want, at=clock)
    return clock


def tuner(**kw: object) -> AutoTuner:
    args: dict[str, object] = {
        "budget": 8,
        "workers": 1,
        "factor": 2,
        "auto_workers": True,
        "auto_factor": False,
    }
    args.update(kw)
    return AutoTuner(**args)  # type: ignore[arg-type]


def test_a_starved_trainer_gets_workers_until_it_is_fed() -> None:
    # The trainer takes 100 batches/s; each worker makes 30: four workers feed it.
    t = tuner()
    run(t, 400, per_worker=30, step=0.01)
    assert t.workers == 4
    assert [c.workers for c in t.changes if c.reason.startswith("starved")] == [2, 4]
    first = t.changes[0]
    assert first.stall > autotune.TARGET_STALL and first.epoch == 0 and first.batch > 1


def test_growth_is_proportional_to_the_stall_and_at_most_doubles() -> None:
    # Stall 0.25 with 3 workers: 3 / 0.75 = 4 workers keep up; an all-waiting trainer doubles.
    t = tuner(workers=3)
    run(t, 30, per_worker=25, step=0.01)  # 75/s of the 100/s wanted: one window
    assert t.want == 4
    t = tuner(workers=3)
    for i in range(30):  # the trainer only waits; the new workers are not in yet
        t.observe(waited=0.1, at=0.1 * i)
    assert t.want == 6


def test_the_budget_is_never_exceeded() -> None:
    t = tuner(budget=3)
    run(t, 500, per_worker=10, step=0.001)
    assert t.workers == t.want == 3
    assert max(c.workers for c in t.changes) == 3
    assert t.max_depth == 3 * 2


def test_a_fed_trainer_changes_nothing() -> None:
    t = tuner()
    run(t, 300, per_worker=200, step=0.01)
    assert (t.workers, t.factor, t.changes) == (1, 2, [])


def test_workers_that_gain_nothing_are_given_back_and_not_asked_for_again() -> None:
    # Two cores: a third and fourth worker add nothing, so the step to 4 is undone.
    t = tuner()
    run(t, 600, per_worker=30, step=0.0, cores=2)
    reasons = [c.reason for c in t.changes]
    assert t.workers == 2, reasons
    assert "no gain: back to workers 2" in reasons
    assert sum(r.startswith("starved: grow") for r in reasons) == 2  # 1 -> 2 -> 4, no more


def test_one_noisy_window_does_not_undo_a_step() -> None:
    t = tuner()
    clock = 0.0

    def window(period: float, batches: int = 10) -> None:
        nonlocal clock
        for _ in range(batches):
            clock += period
            t.observe(waited=period, at=clock)  # the trainer only waits

    window(0.1)  # 10 batches/s: grow to 2
    t.admitted(2, at=clock)
    window(0.1)  # no better (the machine was busy)
    assert t.workers == 2 and not any(c.reason.startswith("no gain") for c in t.changes)
    window(0.05)  # twice the rate: kept
    assert "kept" in [c.reason for c in t.changes] and t.workers == 2


def test_no_decision_while_new_workers_start() -> None:
    t = tuner()
    clock = 0.0
    for _ in range(200):  # never admitted: the actor is still importing torch
        clock += 0.05
        t.observe(waited=0.05, at=clock)
    assert (t.workers, t.want) == (1, 2)
    assert len(t.changes) == 1
    t.admitted(2, at=clock)
    assert t.changes[-1].reason == "admitted" and t.workers == 2


def test_auto_factor_grows_only_when_the_workers_cannot() -> None:
    # The factor matters here (supply scales with factor / 4) and the budget is 2.
    t = tuner(budget=2, auto_factor=True)
    run(t, 800, per_worker=60, step=0.01, factor_helps=True)
    assert t.workers == 2
    assert t.factor == 4 and t.depth == 8
    kinds = [c.reason for c in t.changes if c.reason.startswith("starved")]
    assert kinds[0].startswith("starved: grow") and kinds[-1] == "starved: factor 4"


def test_a_factor_step_that_gains_nothing_is_undone() -> None:
    t = tuner(budget=1, auto_factor=True)
    run(t, 400, per_worker=50, step=0.0)  # throughput-bound: depth cannot help
    assert t.factor == 2
    assert "no gain: back to factor 2" in [c.reason for c in t.changes]


def test_fixed_workers_with_auto_factor_never_grow_the_pool() -> None:
    t = tuner(budget=3, workers=3, auto_workers=False, auto_factor=True)
    assert t.max_depth == 3 * autotune.MAX_FACTOR  # how far ahead the trainer draws
    run(t, 300, per_worker=10, step=0.01)
    assert t.workers == t.want == 3
    assert [c.reason for c in t.changes][:2] == ["starved: factor 3", "no gain: back to factor 2"]


def test_the_first_batch_of_an_epoch_is_not_measured() -> None:
    t = tuner()
    t.start_epoch(5)
    t.observe(waited=10.0, at=10.0)  # the pipeline's fill
    clock = run(t, 50, per_worker=500, step=0.01, clock=10.0)
    assert t.changes == [] and clock > 10.0
    assert t.report()["changes"] == []


def test_epochs_shorter_than_a_window_add_up_without_the_gaps_between_them() -> None:
    t = tuner()
    clock = 0.0
    for epoch in range(8):  # four batches an epoch, a trainer that only waits
        t.start_epoch(epoch)
        clock += 5.0  # a long pause between epochs (evaluation): not counted
        for _ in range(4):
            clock += 0.1
            t.observe(waited=0.1, at=clock)
    grows = [c for c in t.changes if c.reason.startswith("starved")]
    assert grows and grows[0].epoch == 2 and grows[0].stall == 1.0, t.changes


def test_the_report_is_json_able_and_names_each_change() -> None:
    t = tuner()
    run(t, 200, per_worker=30, step=0.01)
    report = json.loads(json.dumps(t.report()))
    assert report["budget"] == 8 and report["workers"] == t.workers
    assert set(report["changes"][0]) == {
        "epoch",
        "batch",
        "workers",
        "depth",
        "stall",
        "rate",
        "reason",
    }


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="workers <= budget"):
        AutoTuner(budget=2, workers=3, factor=2, auto_workers=True, auto_factor=False)


@pytest.mark.parametrize(
    ("cpus", "per", "ranks", "expected"),
    [(8, 1, 1, 7), (2, 1, 1, 1), (1, 1, 1, 1), (18, 2, 2, 4), (4, 0, 0, 4), (3.5, 1, 0, 3)],
)
def test_worker_budget(cpus: float, per: float, ranks: int, expected: int) -> None:
    assert worker_budget(cpus, per, ranks=ranks) == expected


def test_cpu_budget_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.CPU_BUDGET, raising=False)
    assert env.cpu_budget_default() is None
    monkeypatch.setenv(env.CPU_BUDGET, "6")
    assert env.cpu_budget_default() == 6.0
    monkeypatch.setenv(env.CPU_BUDGET, "lots")
    with pytest.raises(ValueError, match="RAYDL_CPU_BUDGET should be a positive number"):
        env.cpu_budget_default()


def test_one_spare_worker_is_kept_started_while_the_rule_may_grow() -> None:
    t = tuner(budget=3)
    assert (t.workers, t.started) == (1, 2)
    run(t, 400, per_worker=30, step=0.01)  # grows to the budget
    assert t.workers == t.started == 3
    fixed = tuner(budget=4, workers=4, auto_workers=False, auto_factor=True)
    assert fixed.started == 4
    capped = tuner()
    run(capped, 600, per_worker=30, step=0.0, cores=2)  # 4 undone: 2 is the ceiling
    assert capped.workers == capped.started == 2


# -- the fetch thread's side (MapStyleProducer) over fake actors -------------------------


class _Actor:
    def __init__(self, name: str, start_s: float) -> None:
        self.name = name
        self.ready_at = time.monotonic() + start_s  # importing torch, unpickling
        self.free_at = self.ready_at


class _Ref:
    def __init__(self, ready_at: float, value: Any) -> None:
        self.ready_at, self.value = ready_at, value


class _Calls:
    """Each actor runs its calls one after another, ``work_s`` per batch."""

    def __init__(self, work_s: float) -> None:
        self.work_s = work_s
        self.sent: list[tuple[str, Any]] = []

    def submit(self, actor: _Actor, method: str, *args: Any) -> _Ref:
        if method == "ready":
            return _Ref(actor.ready_at, None)
        self.sent.append((actor.name, args[0]))
        actor.free_at = max(actor.free_at, time.monotonic()) + self.work_s
        return _Ref(actor.free_at, (tuple(args[0]), actor.name))

    def get(self, ref: _Ref, timeout: float) -> Any:
        wait = ref.ready_at - time.monotonic()
        if wait > timeout:
            time.sleep(timeout)
            raise ResultTimeout
        time.sleep(max(0.0, wait))
        return ref.value

    def wait(self, refs: Any, timeout: float) -> list[_Ref]:
        time.sleep(timeout)
        return [r for r in refs if r.ready_at <= time.monotonic()][:1]


class _Pool:
    def __init__(self, start: int, start_s: float) -> None:
        self.start_s = start_s
        self.actors = [_Actor(f"w{i}", 0.0) for i in range(start)]

    def add(self) -> _Actor:
        self.actors.append(_Actor(f"w{len(self.actors)}", self.start_s))
        return self.actors[-1]

    def restart(self, worker_id: int, dead: Any) -> Any:
        raise AssertionError("no worker dies here")

    def __len__(self) -> int:
        return len(self.actors)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start", ["workers", "started"])  # the spare: from the producer, or made
def test_a_pool_grown_mid_epoch_delivers_every_batch_once_in_order(start: str) -> None:
    t = tuner(budget=3)
    pool, calls = _Pool(getattr(t, start), start_s=0.3), _Calls(work_s=0.01)
    requests = [[2 * i, 2 * i + 1] for i in range(240)]
    producer = MapStyleProducer(
        pool, enumerate(requests), lookahead=t.depth, in_order=True, calls=calls, tuner=t
    )
    got = []
    outstanding = []
    try:
        while True:
            started = time.perf_counter()
            try:
                batch = producer.handoff.take(10.0)
            except StopIteration:
                break
            producer.taken(time.perf_counter() - started)
            got.append(batch)
            outstanding.append(len(calls.sent) - len(got))
    finally:
        producer.close()
    assert [list(indices) for indices, _ in got] == requests  # each once, in request order
    assert sorted(tuple(r) for _, r in calls.sent) == sorted(tuple(r) for r in requests)
    assert t.workers == 3 and len(pool.actors) == 3
    assert {who for _, who in got} == {"w0", "w1", "w2"}
    assert [who for _, who in got[:8]] == ["w0"] * 8  # the spare waits until it is wanted
    assert max(outstanding) <= t.max_depth
