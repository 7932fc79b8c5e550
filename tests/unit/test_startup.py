"""The background start (``runtime/startup.py``) and torchrun's store rendezvous, without Ray."""

from __future__ import annotations

import datetime
import socket
import sys
import threading
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from raydl import RayDataLoader
from raydl._internal.runtime import env
from raydl._internal.runtime.startup import BackgroundStart, Warm
from raydl._internal.runtime.world import Rendezvous, World
from raydl.errors import RayDLError


def test_begin_returns_while_the_connect_step_still_runs() -> None:
    release, connected = threading.Event(), threading.Event()

    def connect() -> None:
        release.wait(30)
        connected.set()

    start = BackgroundStart.begin(connect, None)
    assert not start.done and not connected.is_set()  # begin() did not wait
    release.set()
    start.wait()
    assert start.done and connected.is_set()


def test_an_error_of_the_start_is_raised_by_wait_with_a_note() -> None:
    def connect() -> None:
        raise ConnectionError("no cluster at 10.0.0.1:6379")

    start = BackgroundStart.begin(connect, None)
    with pytest.raises(ConnectionError, match=r"no cluster at 10\.0\.0\.1:6379") as info:
        start.wait()
    assert any("in the background" in note for note in getattr(info.value, "__notes__", []))


def test_what_the_warm_step_built_is_adopted_unless_the_start_was_cancelled() -> None:
    adopted: list[str] = []
    discarded: list[str] = []
    warm = Warm(build=lambda: "actors", adopt=adopted.append, discard=discarded.append)
    BackgroundStart.begin(lambda: None, warm).wait()
    assert (adopted, discarded) == (["actors"], [])

    adopted.clear()
    release = threading.Event()
    start = BackgroundStart.begin(lambda: release.wait(30), warm)
    start.cancel()  # e.g. the loader was closed or collected during ray.init
    release.set()
    start.wait()
    assert adopted == [] and start.cancelled


def test_a_start_cancelled_while_it_builds_discards_what_it_built() -> None:
    adopted: list[str] = []
    discarded: list[str] = []
    building, release = threading.Event(), threading.Event()

    def build() -> str:
        building.set()
        release.wait(30)
        return "actors"

    start = BackgroundStart.begin(lambda: None, Warm(build, adopted.append, discarded.append))
    assert building.wait(30)
    start.cancel()
    release.set()
    start.wait()
    assert (adopted, discarded) == ([], ["actors"])


def test_the_option_follows_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.BACKGROUND_START, "0")
    assert RayDataLoader(list(range(4))).options.background_start is False
    monkeypatch.setenv(env.BACKGROUND_START, "1")
    assert RayDataLoader(list(range(4)), num_workers=0).options.background_start is True
    with pytest.raises(TypeError, match="background_start option should be a bool, got 'yes'"):
        RayDataLoader(list(range(4)), background_start="yes")  # type: ignore[arg-type]


def test_a_loader_loading_in_process_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.BACKGROUND_START, "1")
    loader = RayDataLoader(list(range(4)), batch_size=2, num_workers=0)
    assert loader._startup is None
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]


@pytest.fixture
def agent_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[dist.TCPStore]:
    """A store where torchrun's agent would host it, listening on loopback only."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        master_listen_fd=listener.fileno(),
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )
    for name, value in {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": "run-1",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }.items():
        monkeypatch.setenv(name, value)
    yield store
    listener.close()


def test_ranks_meet_through_torchruns_store_in_any_order(agent_store: dist.TCPStore) -> None:
    rank0 = Rendezvous.from_torchrun(World(0, 2))
    rank1 = Rendezvous.from_torchrun(World(1, 2))
    assert rank0 is not None and rank1 is not None
    seen: list[str] = []
    looker = threading.Thread(target=lambda: seen.append(rank1.lookup("cluster", 20, what="x")))
    looker.start()  # rank 1 asks before rank 0 has published: it waits
    rank0.publish("cluster", '["127.0.0.1:6379", "token"]')
    looker.join(30)
    assert seen == ['["127.0.0.1:6379", "token"]']
    assert agent_store.check(["raydl/run-1/0/cluster"])  # under this run and attempt


def test_a_restarted_job_never_reads_the_previous_attempts_value(
    agent_store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = Rendezvous.from_torchrun(World(0, 2))
    assert first is not None
    first.publish("cluster", "old")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = Rendezvous.from_torchrun(World(1, 2))
    assert again is not None
    with pytest.raises(RayDLError, match=r"rank 1: rank 0's Ray cluster was not published within"):
        again.lookup("cluster", 0.5, what="rank 0's Ray cluster")


def test_a_wait_for_rank_0_stops_when_told_and_never_blocks_in_the_store(
    agent_store: dist.TCPStore,
) -> None:
    """The wait polls (a thread woken in the store's C++ wait at exit aborts the process)."""
    rank1 = Rendezvous.from_torchrun(World(1, 2))
    assert rank1 is not None
    told = threading.Event()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            rank1.lookup("cluster", 60, what="rank 0's Ray cluster", stop=told.is_set)
        except BaseException as err:
            errors.append(err)

    looker = threading.Thread(target=wait)
    looker.start()
    looker.join(0.3)
    assert looker.is_alive()  # nothing published: still waiting
    told.set()  # the process exits
    looker.join(2)
    assert not looker.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], RayDLError)
    assert "the process is exiting; it no longer waits for rank 0's Ray cluster" in str(errors[0])


def test_outside_torchrun_there_is_no_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert Rendezvous.from_torchrun(World(1, 2)) is None


def test_ray_workers_started_by_a_rank_are_not_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    # cluster.py blanks torchrun's variables in Ray's worker processes (the raylet's environment).
    monkeypatch.setenv("RANK", "")
    monkeypatch.setenv("WORLD_SIZE", "")
    assert env.torchrun_world() is None


@pytest.mark.timeout(30)
def test_an_import_lock_this_thread_left_held_is_released_and_another_threads_is_left() -> None:
    import _imp

    from raydl._internal.runtime import interrupt

    sys.modules.pop("colorsys", None)  # so that the other thread's import needs the lock
    # Held twice by this thread, as an interrupt inside importlib leaves it (reentrant).
    _imp.acquire_lock()
    _imp.acquire_lock()
    try:
        imported = threading.Event()
        other = threading.Thread(target=lambda: (__import__("colorsys"), imported.set()))
        other.start()  # its import waits for the lock
        assert not imported.wait(0.2)
        assert interrupt.release_import_lock_left_held() == 2
    finally:  # never leave this process's imports blocked
        while _imp.lock_held():
            try:
                _imp.release_lock()
            except RuntimeError:
                break
    assert imported.wait(10) and not _imp.lock_held()
    other.join()

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        _imp.acquire_lock()
        held.set()
        release.wait(10)
        _imp.release_lock()

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    try:
        assert interrupt.release_import_lock_left_held() == 0  # another thread's: left
        assert _imp.lock_held()
    finally:
        release.set()
        holder.join()
    assert not _imp.lock_held()
