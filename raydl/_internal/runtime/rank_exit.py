"""The end of a torchrun job: the other ranks leave rank 0's Ray cluster before it stops.

Under torchrun the other ranks join the Ray instance that rank 0 runs
(:mod:`raydl._internal.runtime.cluster`). When rank 0's process exits, Ray's exit
handlers stop that instance. A rank still connected to it then loses its GCS, and
``JOINER_RECONNECT_TIMEOUT_S`` (5) seconds later Ray's core worker ends that
process with status 1 ("Failed to connect to GCS within 5 seconds ... The program
will terminate"; no ``atexit`` handler runs): a job that delivered all its data
failed because rank 0 happened to end first.

So the ranks tell each other through torchrun's store
(:class:`~raydl._internal.runtime.world.Rendezvous`):

* A rank announces itself (``joined/<rank>``: its pid and start time) before it
  connects to rank 0's cluster, then checks that rank 0 is not closing it
  (``closing``); if it is, the rank does not connect (:func:`arrive`).
* At its exit that rank disconnects from Ray (``ray.shutdown``, from an ``atexit``
  handler registered after ``import ray``, so it runs before Ray's own, and after
  those raydl registers later, such as the early epochs' discard), then says so
  (``left/<rank>``).
* Rank 0, at its exit, before any ``atexit`` handler (threading's exit hook: Ray's
  handlers stop the instance), says that it closes, then waits until every rank
  that announced itself has left or is dead, for at most :data:`LEAVE_TIMEOUT_S`
  (:func:`hold_until_left`). A rank killed never says it left: its process is
  watched (the ranks on rank 0's instance share its machine: it listens on
  127.0.0.1 only). After an unhandled exception rank 0 does not wait: the job has
  failed, and another rank may be waiting for this one in a collective. Nor when the
  script stopped Ray itself before its end (``ray.shutdown``, ``raydl.shutdown``).

Each side writes its key before it reads the other's, so a rank that joins while
rank 0 closes is either waited for or does not join.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import threading
import time

from raydl._internal.runtime import reaper
from raydl._internal.runtime.world import Rendezvous

__all__ = ["LEAVE_TIMEOUT_S", "arrive", "hold_until_left"]

#: Seconds rank 0's exit waits, at most, for the other ranks to leave its cluster.
LEAVE_TIMEOUT_S = 60.0
#: The same, for a rank 0 that exits because of a Ctrl-C (the other ranks got it too).
INTERRUPTED_LEAVE_TIMEOUT_S = 5.0
#: Seconds between two looks at the other ranks while rank 0's exit waits.
POLL_S = 0.2
#: Seconds a rank's exit tries to reach torchrun's store to say it left.
LEFT_TIMEOUT_S = 10.0

_JOINED, _LEFT, _CLOSING = "joined/", "left/", "closing"

_lock = threading.Lock()
_arrived = False  # this rank announced itself (its exit leaves)
_holding = False  # this process's exit waits for the others (rank 0)
_log = logging.getLogger("raydl")


def arrive(rendezvous: Rendezvous) -> bool:
    """Announce this rank on rank 0's cluster (once per process), and leave it at exit.

    Called before the rank connects, or, where the script connected it already, before
    raydl uses that connection.

    Returns:
        ``False`` when rank 0 is closing its cluster already: then do not connect.
    """
    global _arrived
    with _lock:
        if _arrived:
            return True
        import ray  # noqa: F401  (registers Ray's exit handler first: this module's runs before it)

        me = [os.getpid(), reaper.started(os.getpid())]
        try:
            rendezvous.publish(_JOINED + str(rendezvous.world.rank), json.dumps(me))
        except Exception:  # torchrun's store failed: join unannounced (rank 0 will not wait)
            _log.debug("raydl could not announce this rank to rank 0", exc_info=True)
            return True
        atexit.register(_leave, rendezvous)
        _arrived = True
    try:
        return not rendezvous.peek([_CLOSING])
    except Exception:  # as above: rank 0 waits for this rank, which did announce itself
        _log.debug("raydl could not ask whether rank 0 is closing", exc_info=True)
        return True


def _leave(rendezvous: Rendezvous) -> None:
    """At this rank's exit: disconnect from rank 0's cluster, then say so."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        try:
            ray.shutdown()
        except Exception:  # Ray's own exit handler tries again
            _log.debug("raydl's disconnect from rank 0's Ray cluster failed", exc_info=True)
    with contextlib.suppress(Exception):  # torchrun's store is gone: rank 0 watches this process
        rendezvous.publish(_LEFT + str(rendezvous.world.rank), "1", LEFT_TIMEOUT_S)


def hold_until_left(rendezvous: Rendezvous) -> None:
    """Make this process's exit (rank 0's) wait for the other ranks to leave its cluster.

    Registered once, before rank 0 publishes its cluster, through threading's exit
    hook (CPython's ``threading._register_atexit``): it runs before every ``atexit``
    handler, among them Ray's, which stop the instance.
    """
    global _holding
    with _lock:
        if _holding:
            return
        try:
            threading._register_atexit(_wait_for_ranks, rendezvous)  # type: ignore[attr-defined]
        except RuntimeError:  # the interpreter is exiting already: no rank joins now
            return
        _holding = True


def _wait_for_ranks(rendezvous: Rendezvous) -> None:
    """At rank 0's exit: close the cluster to newcomers, wait for those on it to leave."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return  # the script stopped Ray itself: nothing left to hold
    ended_by = getattr(sys, "last_value", None)  # an unhandled exception, as printed
    if ended_by is not None and not isinstance(ended_by, KeyboardInterrupt):
        timeout_s = 0.0
    elif isinstance(ended_by, KeyboardInterrupt):
        timeout_s = INTERRUPTED_LEAVE_TIMEOUT_S
    else:
        timeout_s = LEAVE_TIMEOUT_S
    try:
        on_it = wait_for_ranks(rendezvous, timeout_s)
    except Exception:  # torchrun's store is gone (its agent ended): nothing to wait with
        _log.debug("raydl could not wait for the other ranks to leave Ray", exc_info=True)
        return
    if on_it and timeout_s > 0:
        _log.warning(
            "raydl: rank 0 stops the job's Ray cluster while rank(s) %s are still connected "
            "to it after %g s; Ray may end them with status 1. Let every rank finish within "
            "%g s of rank 0.",
            ", ".join(map(str, on_it)),
            timeout_s,
            LEAVE_TIMEOUT_S,
        )


def wait_for_ranks(rendezvous: Rendezvous, timeout_s: float) -> list[int]:
    """Close rank 0's cluster, then wait until the ranks on it left or died (rank 0's exit).

    Returns:
        The ranks still connected after ``timeout_s`` seconds.
    """
    rendezvous.publish(_CLOSING, "1", LEFT_TIMEOUT_S)  # before reading who joined
    others = [_JOINED + str(rank) for rank in range(1, rendezvous.world.world_size)]
    pending = {
        int(key.removeprefix(_JOINED)): tuple(json.loads(value))
        for key, value in rendezvous.peek(others).items()
    }
    deadline = time.monotonic() + timeout_s
    while True:
        left = rendezvous.peek([_LEFT + str(rank) for rank in pending])
        pending = {
            rank: (pid, start)
            for rank, (pid, start) in pending.items()
            if _LEFT + str(rank) not in left and _alive(pid, start)
        }
        if not pending or time.monotonic() >= deadline:
            return sorted(pending)
        time.sleep(POLL_S)


def _alive(pid: int, start: int | None) -> bool:
    """Whether the process ``pid`` that began at ``start`` (clock ticks) still runs."""
    if start is not None:
        return reaper.started(pid) == start
    try:
        os.kill(pid, 0)  # where there is no /proc: the pid alone
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
