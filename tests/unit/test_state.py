"""The versioned state: which saved positions count as an epoch under way, and what is refused."""

from __future__ import annotations

from typing import Any

import pytest

from raydl import StateMismatchError
from raydl._internal.epochs.state import STATE_VERSION, LoaderState

RNG = {"source": "global", "state": "AAAA"}


def _state(**fields: Any) -> LoaderState:
    base: dict[str, Any] = {
        "kind": "iterable",
        "epoch": 2,
        "batches_consumed": 3,
        "world_size": 1,
        "dataset_len": None,
        "seed": 0,
        "batch_size": 4,
    }
    return LoaderState.from_dict({**base, **fields, "version": fields.get("version", 4)})


def _check(state: LoaderState, **current: Any) -> None:
    values: dict[str, Any] = {
        "kind": "iterable",
        "dataset_len": None,
        "seed": 0,
        "world_size": 1,
        "batch_size": 4,
        "elastic": False,
    }
    state.check_matches(**{**values, **current})


def test_the_current_version_is_4() -> None:
    assert STATE_VERSION == 4
    assert LoaderState("map", 0, 0, 1, 10, 0).to_dict()["version"] == 4


@pytest.mark.parametrize(
    ("fields", "started"),
    [
        ({"version": 3, "batches_consumed": 0, "rng": RNG}, True),  # saved at batch 0
        ({"version": 3, "batches_consumed": 2}, True),
        ({"version": 3, "batches_consumed": 0}, False),  # between epochs (no rng then)
        ({"epoch_started": False, "batches_consumed": 0, "rng": RNG}, False),
        ({"epoch_started": True, "batches_consumed": 0}, True),
    ],
)
def test_an_epoch_is_under_way_as_the_state_says(fields: dict[str, Any], started: bool) -> None:
    assert _state(**fields).started is started


def test_an_iterable_epoch_under_way_refuses_another_num_workers_naming_both() -> None:
    state = _state(epoch_started=True, num_workers=3)
    with pytest.raises(
        StateMismatchError,
        match=r"num_workers=3, but this loader has num_workers=2\. .*num_workers=3 to resume it",
    ):
        _check(state, num_workers=2)
    _check(state, num_workers=3)


@pytest.mark.parametrize(
    "fields",
    [
        {"epoch_started": False, "batches_consumed": 0, "num_workers": 3},  # between epochs
        {"epoch_started": True, "num_workers": None},  # not recorded: an older state
    ],
)
def test_num_workers_may_change_where_no_epoch_of_theirs_is_under_way(
    fields: dict[str, Any],
) -> None:
    _check(_state(**fields), num_workers=2)


def test_map_style_epochs_take_another_num_workers() -> None:
    state = _state(kind="map", dataset_len=10, epoch_started=True, num_workers=3)
    _check(state, kind="map", dataset_len=10, num_workers=1)


def test_an_unknown_version_names_the_versions_readable() -> None:
    with pytest.raises(StateMismatchError, match=r"version 7 .*reads versions \(1, 2, 3, 4\)"):
        _state(version=7)


def test_an_out_of_order_epoch_resumes_at_exactly_the_positions_not_delivered() -> None:
    from raydl._internal.stream.batching import delivered_ahead, positioned

    count, ahead = delivered_ahead(0, [1, 3, 4, 6])
    assert (count, ahead) == (4, [1, 3, 4, 6])
    assert [p for p, _ in positioned(range(8), count, ahead)] == [0, 2, 5, 7]
    # After the resumed run delivered 0 and 2 as well: the prefix grows, ahead shrinks.
    assert delivered_ahead(count - len(ahead), [*ahead, 0, 2]) == (6, [6])
    assert [p for p, _ in positioned(range(8), 6, [6])] == [5, 7]
