"""The dealing rule of streaming epochs under several ranks (``epochs/deal.py``), without Ray."""

from __future__ import annotations

import random

import numpy as np
import pytest

from raydl._internal.epochs.deal import Deal, Dealer, deal
from raydl._internal.stream.deal_producers import dealt_blocks


def _rows(deals: list[Deal]) -> list[tuple[int, int]]:
    """The (run, row) pairs of ``deals``, in order."""
    return [(d.run, row) for d in deals for row in range(d.start, d.stop)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_every_rank_gets_the_same_rows_and_at_most_world_minus_one_are_left_out(
    world: int,
) -> None:
    rng = random.Random(world)
    for _ in range(200):
        # run sizes as filters leave them: empty runs, tiny ones, large ones
        counts = [
            rng.choice([0, 1, 2, rng.randint(0, 50), rng.randint(100, 400)])
            for _ in range(rng.randint(0, 20))
        ]
        per_rank = deal(counts, world)
        total = sum(counts)
        sizes = [sum(d.rows for d in mine) for mine in per_rank]
        assert sizes == [total // world] * world
        dealt = [pair for mine in per_rank for pair in _rows(mine)]
        everything = [(run, row) for run, rows in enumerate(counts) for row in range(rows)]
        assert len(set(dealt)) == len(dealt)  # nothing twice
        assert set(dealt) <= set(everything)
        left_out = sorted(set(everything) - set(dealt))
        assert len(left_out) == total % world < world
        assert left_out == everything[len(everything) - len(left_out) :]  # the epoch's last rows
        for mine in per_rank:  # each rank's rows come in run order
            assert _rows(mine) == sorted(_rows(mine))
            assert all(d.rows > 0 for d in mine)


@pytest.mark.timeout(30)
def test_after_each_run_every_rank_holds_the_rows_loaded_over_the_world_size() -> None:
    rng = random.Random(0)
    dealer = Dealer(3)
    held = [0, 0, 0]
    loaded = 0
    for _ in range(100):
        rows = rng.randint(0, 30)
        loaded += rows
        for each in dealer.add(rows):
            held[each.rank] += each.rows
        assert held == [loaded // 3] * 3  # no rank ever waits for another's rows
        assert dealer.left_out == loaded % 3
        # the runs before first_waiting are dealt in full: their batches can be let go
        assert dealer.first_waiting <= dealer.loaded


@pytest.mark.timeout(30)
def test_the_deal_is_a_pure_function_of_the_run_sizes_and_the_world_size() -> None:
    counts = [7, 0, 13, 1, 40, 2]
    assert deal(counts, 2) == deal(counts, 2)
    assert deal(counts, 2) != deal(counts, 3)
    # dealt run by run (as rank 0 does while runs arrive) or at once: the same deals
    dealer = Dealer(2)
    incremental: list[list[Deal]] = [[], []]
    for rows in counts:
        for each in dealer.add(rows):
            incremental[each.rank].append(each)
    assert incremental == deal(counts, 2)


@pytest.mark.timeout(30)
def test_a_deal_is_cut_as_views_of_the_runs_batches() -> None:
    run = [{"x": np.arange(0, 3)}, {"x": np.arange(3, 3)}, {"x": np.arange(3, 10)}]
    counts = [3, 0, 7]
    pieces = dealt_blocks(run, counts, 2, 6)
    assert [p["x"].tolist() for p in pieces] == [[2], [3, 4, 5]]
    assert all(
        np.shares_memory(p["x"], b["x"]) for p, b in zip(pieces, [run[0], run[2]], strict=True)
    )


@pytest.mark.timeout(30)
def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="world_size must be at least 1, got 0"):
        Dealer(0)
    with pytest.raises(ValueError, match="a run has at least 0 rows, got -1"):
        Dealer(2).add(-1)


@pytest.mark.timeout(30)
def test_the_board_hands_each_rank_its_deals_once_and_drops_an_abandoned_starts() -> None:
    from raydl._internal.epochs.board import Board

    board = Board(world_size=3)  # the actor's class, called in this process
    assert board.dealt(0, 1, wait_s=0) is None  # nothing opened yet
    old = board.open(0, (40, 7))
    board.deal(0, old, [[], ["a"], ["b"]], ended=False)
    new = board.open(0, (40, 7))  # rank 0 started epoch 0 again
    board.deal(0, old, [[], ["stale"], ["stale"]], ended=True)  # the old start's post: dropped
    assert board.dealt(0, 1, wait_s=0) is None
    board.deal(0, new, [[], ["c"], []], ended=False)
    assert board.dealt(0, 1, wait_s=0) == (new, (40, 7), ["c"], False)
    assert board.dealt(0, 1, wait_s=0) is None  # handed over once
    board.deal(0, new, [[], ["d"], ["e"]], ended=True)
    assert board.dealt(0, 1, wait_s=0) == (new, (40, 7), ["d"], True)
    assert board.dealt(0, 2, wait_s=0) == (new, (40, 7), ["e"], True)
    assert board.dealt(0, 2, wait_s=0) == (new, (40, 7), [], True)  # the end stays readable
    board.open(1, None)
    board.open(2, None)  # two epochs on: epoch 0's entry is gone
    assert board.dealt(0, 1, wait_s=0) is None


@pytest.mark.timeout(30)
def test_the_board_hands_rank_zeros_failure_to_every_rank_instead_of_rows() -> None:
    """A run that failed on rank 0 reaches the other ranks, not a wait for rows that never come."""
    from raydl._internal.epochs.board import Board, Failed, failed
    from raydl.errors import RayDLError

    board = Board(world_size=3)
    old = board.open(0, None)
    new = board.open(0, None)  # rank 0 started epoch 0 again
    board.deal(0, new, [[], ["a"], []], ended=False)
    assert board.dealt(0, 1, wait_s=0) == (new, None, ["a"], False)
    board.fail_deals(old, failed(0, ValueError("stale")))  # an abandoned start's: dropped
    assert board.dealt(0, 2, wait_s=0) is None
    cause = ValueError("bad row (files ['part-2.parquet'])")
    board.fail_deals(new, failed(0, cause))
    for rank in (1, 2):  # every rank, each time it asks, whatever it was dealt before
        reply = board.dealt(0, rank, wait_s=0)
        assert reply == Failed(0, "ValueError: bad row (files ['part-2.parquet'])")
    error = reply.error(2)
    assert isinstance(error, RayDLError)
    assert str(error) == (
        "rank 2: rank 0 failed to load epoch 0, whose rows this rank was to take: "
        "ValueError: bad row (files ['part-2.parquet'])"
    )
    again = board.open(0, None)  # a new start of the epoch: its own deals, no failure
    board.deal(0, again, [[], ["b"], []], ended=True)
    assert board.dealt(0, 1, wait_s=0) == (again, None, ["b"], True)


@pytest.mark.timeout(30)
def test_the_board_hands_a_failed_map_phase_to_every_rank_once() -> None:
    from raydl._internal.epochs.board import Board, Failed, failed

    board = Board(world_size=3)
    assert board.fetch(4, 1, wait_s=0) is None  # not posted yet
    board.fail_phase(failed(4, RuntimeError("actor died")))
    assert board.fetch(4, 1, wait_s=0) == Failed(4, "RuntimeError: actor died")
    assert board.fetch(5, 1, wait_s=0) is None  # only that epoch
    assert board.fetch(4, 2, wait_s=0) == Failed(4, "RuntimeError: actor died")
    # Every other rank was told: a rank that tries epoch 4 again waits for the new map phase.
    assert board.fetch(4, 1, wait_s=0) is None
    board.fail_phase(failed(4, RuntimeError("again")))
    assert board.fetch(4, 2, wait_s=0) == Failed(4, "RuntimeError: again")
    board.post(4, None, [1], [None])  # type: ignore[arg-type]  # rank 0 ran it once more
    assert board.fetch(4, 1, wait_s=0) == (None, [1], [None])  # the failure is gone with it
