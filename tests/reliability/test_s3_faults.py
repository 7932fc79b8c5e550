"""The S3 server dies while the loader reads from it (SeaweedFS ``weed mini`` on loopback).

* Down, then back within the retry budget: the epoch completes, every sample exactly once.
* Kept down: :class:`raydl.RemoteReadError` naming the endpoint and an object key,
  within a bounded time, whatever ``on_bad_file`` says (a dead server is not a bad file).

The server of this module is its own (these tests kill it), and so is its Ray instance.
Loaders run with ``overlap_epochs=False`` and are closed: an early next epoch would
keep reading (with the patient retry policy) after a test, into the next test's outage.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _private_ray import private_ray

import raydl
from raydl import sources
from raydl._internal.io import skips
from raydl.sources import RemoteReadError, RetryPolicy
from raydl.testing.s3 import SeaweedServer

pytestmark = [pytest.mark.s3, pytest.mark.slow]

# Enough bytes that reading them takes seconds on a 2-core box: a kill after the
# first batches lands while most objects are still to be read.
OBJECTS = 96
OBJECT_BYTES = 256 * 1024
# Generous: covers `weed mini` restarting (seconds) on a busy machine.
PATIENT = RetryPolicy(attempts=60, initial_backoff_s=0.2, max_backoff_s=1.0, deadline_s=120)
IMPATIENT = RetryPolicy(attempts=3, initial_backoff_s=0.1, max_backoff_s=0.5, deadline_s=5)


@pytest.fixture(scope="module")
def s3_server() -> Iterator[SeaweedServer]:
    server = SeaweedServer.start(bucket="raydl-faults")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[None]:
    with private_ray(num_cpus=2):
        yield


@pytest.fixture(scope="module")
def objects(s3_server: SeaweedServer) -> str:
    """``data/<i>.bin`` objects whose every 4-byte word is ``i``."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
    prefix = f"{s3_server.bucket}/data"
    fs.pipe(
        {
            f"{prefix}/{i:04d}.bin": i.to_bytes(4, "big") * (OBJECT_BYTES // 4)
            for i in range(OBJECTS)
        }
    )
    return prefix


@pytest.fixture
def server_up_after(s3_server: SeaweedServer, ray_instance: None) -> Iterator[SeaweedServer]:
    """The server, with Ray idle before the test and the server restarted after it if down.

    Waiting for idle CPUs keeps a read task that outlived an earlier test (Ray lets a
    running task finish after its pipeline shut down) out of this test's outage.
    """
    _wait_until_ray_is_idle(timeout_s=120)
    yield s3_server
    if s3_server.pid is None:
        s3_server.restart()


def _wait_until_ray_is_idle(timeout_s: float, quiet_s: float = 1.0) -> None:
    """Until every CPU has been free for ``quiet_s`` in a row (a task queued behind one
    that just ended would otherwise slip in right after a single look)."""
    import ray

    total = ray.cluster_resources().get("CPU", 0)
    deadline = time.monotonic() + timeout_s
    idle_since: float | None = None
    while True:
        now = time.monotonic()
        if ray.available_resources().get("CPU", 0) < total:
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= quiet_s:
            return
        if now > deadline:
            raise AssertionError(f"Ray tasks still hold CPUs {timeout_s}s after the last test")
        time.sleep(0.1)


def _value(blob: Any) -> int:
    data = bytes(blob)
    assert len(data) == OBJECT_BYTES
    value = int.from_bytes(data[:4], "big")
    assert data == value.to_bytes(4, "big") * (OBJECT_BYTES // 4), f"object {value} is garbled"
    return value


def _kill_after(
    server: SeaweedServer, batches_seen: threading.Event, *, restart_after_s: float | None
) -> tuple[threading.Thread, threading.Event, list[BaseException]]:
    """A named thread that SIGKILLs the server once ``batches_seen`` is set, then maybe restarts it."""
    restarted = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            batches_seen.wait(timeout=120)
            server.kill()
            if restart_after_s is not None:
                time.sleep(restart_after_s)
                server.restart()
                restarted.set()
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=run, name="test-s3-killer", daemon=True)
    thread.start()
    return thread, restarted, errors


@pytest.mark.timeout(300)
def test_server_killed_mid_read_and_restarted_yields_every_sample_once(
    server_up_after: SeaweedServer, objects: str
) -> None:
    ds = sources.read_binary_files(
        f"s3://{objects}/",
        storage_options=server_up_after.storage_options,
        retry=PATIENT,
        override_num_blocks=OBJECTS // 4,
    )
    first_batches = threading.Event()
    killer, restarted, errors = _kill_after(server_up_after, first_batches, restart_after_s=2.0)
    values: list[int] = []
    before_restart = 0
    loader = raydl.RayDataLoader(ds, batch_size=4, overlap_epochs=False)
    try:
        for i, batch in enumerate(loader):
            values += [_value(blob) for blob in batch["bytes"]]
            if not restarted.is_set():
                before_restart = len(values)
            if i == 1:
                first_batches.set()
            time.sleep(0.01)  # a training step
    finally:
        loader.close()
        killer.join(timeout=120)
    assert not errors, errors
    assert restarted.is_set()
    assert sorted(values) == list(range(OBJECTS))  # every sample exactly once
    # The kill really was mid-read: part of the epoch could only come from the restarted server.
    assert before_restart < OBJECTS


@pytest.mark.timeout(300)
def test_server_down_before_the_epoch_and_back_within_budget(
    server_up_after: SeaweedServer, objects: str
) -> None:
    ds = sources.read_binary_files(
        f"s3://{objects}/",
        storage_options=server_up_after.storage_options,
        retry=PATIENT,
        override_num_blocks=8,
    )  # listed here, while the server is up
    server_up_after.kill()
    restarter = threading.Timer(2.0, server_up_after.restart)
    restarter.name = "test-s3-restarter"
    restarter.start()
    # One epoch, closed at its end: an early-started next epoch would leave read tasks
    # (patient ones) running into the next test's outage.
    loader = raydl.RayDataLoader(ds, batch_size=8, overlap_epochs=False)
    try:
        values = [_value(b) for batch in loader for b in batch["bytes"]]
    finally:
        loader.close()
        restarter.join()
    assert sorted(values) == list(range(OBJECTS))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("on_bad_file", ["raise", "skip"])
def test_server_kept_down_raises_remote_read_error_naming_endpoint_and_key(
    server_up_after: SeaweedServer, objects: str, on_bad_file: str
) -> None:
    ds = sources.read_binary_files(
        f"s3://{objects}/",
        storage_options=server_up_after.storage_options,
        retry=IMPATIENT,
        override_num_blocks=OBJECTS // 4,
        on_bad_file=on_bad_file,  # type: ignore[arg-type]
    )
    first_batch = threading.Event()
    killer, _, errors = _kill_after(server_up_after, first_batch, restart_after_s=None)
    start = time.monotonic()
    received = 0
    loader = raydl.RayDataLoader(ds, batch_size=4, overlap_epochs=False)
    try:
        with pytest.raises(RemoteReadError) as info:
            for batch in loader:
                received += len(batch["bytes"])
                first_batch.set()
                time.sleep(0.01)
        took = time.monotonic() - start
    finally:
        loader.close()
        killer.join(timeout=60)
    assert not errors, errors
    assert received < OBJECTS
    assert took < 120, f"RemoteReadError took {took:.0f}s"
    message = str(info.value)
    assert server_up_after.endpoint in message
    assert re.search(re.escape(objects) + r"/\d{4}\.bin", message), message
    assert [e for e in skips.snapshot() if objects in e["path"]] == []  # nothing was skipped
