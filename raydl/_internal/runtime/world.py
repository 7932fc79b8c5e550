"""Who this process is in a multi-rank job, and the channel ranks coordinate over.

:class:`World` is a plain value: tests build one by hand; :meth:`World.detect`
reads an initialised ``torch.distributed`` process group or torchrun's
variables. :class:`Channel` carries the few messages raydl exchanges between
ranks (the Ray cluster address, an epoch's split iterators, end-of-epoch
barriers) over a dedicated gloo group, so it works whatever backend (nccl,
gloo) the training uses, and its barrier has a timeout that names a dead rank.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from raydl._internal.runtime import env
from raydl.errors import RayDLError


@dataclass(frozen=True)
class World:
    """Rank, world size and local rank of this process.

    Example:
        >>> World(rank=1, world_size=2).is_distributed
        True
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank must be in [0, world_size), got rank={self.rank!r}, "
                f"world_size={self.world_size!r}"
            )

    @property
    def is_distributed(self) -> bool:
        """More than one rank."""
        return self.world_size > 1

    @classmethod
    def detect(cls) -> World:
        """The world of this process: the process group if initialised, else torchrun's variables."""
        import torch.distributed as dist

        from_env = env.torchrun_world()
        local_rank = from_env[2] if from_env else 0
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), local_rank)
        if from_env is not None:
            return cls(*from_env)
        return cls()


_channel: Channel | None = None


class Channel:
    """Collective messages between ranks over a gloo group of their own (created once)."""

    def __init__(self, world: World) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RayDLError(
                f"raydl runs as rank {world.rank} of {world.world_size} but "
                "torch.distributed is not initialised, so the ranks cannot share one Ray "
                "cluster and one pipeline; call torch.distributed.init_process_group() before "
                "iterating the loader (or set RAY_ADDRESS and pass a sampler per rank)."
            )
        self.world = world
        self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    @classmethod
    def get(cls, world: World) -> Channel:
        """The process-wide channel (every rank creates it at the same point: its first epoch)."""
        global _channel
        if _channel is None or _channel.world != world:
            _channel = cls(world)
        return _channel

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        import torch.distributed as dist

        box = [obj if self.world.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj``, in rank order, on rank 0 (``None`` on the others)."""
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world.world_size if self.world.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self._group)
        return out

    def barrier(self, timeout_s: float, what: str) -> None:
        """Wait until every rank got here; fail within ``timeout_s`` naming the missing rank."""
        import torch.distributed as dist

        try:
            dist.monitored_barrier(group=self._group, timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as err:
            raise RayDLError(
                f"rank {self.world.rank}: not every rank reached {what} within {timeout_s:g} s "
                f"({err}). A rank has died or fell behind; see its log. Raise the loader's "
                "`timeout` if ranks legitimately take longer."
            ) from err


class Rendezvous:
    """Values the ranks publish and look up, through torchrun's agent store: rank 0's
    cluster, and who is on it at the job's end (``runtime/rank_exit.py``).

    No collective: any thread may use it, in any order against the script's own
    collectives (a broadcast from a background thread on the default process group
    could pair with the wrong call or deadlock). Only under torchrun, whose agent
    hosts the store for the whole run (:func:`raydl._internal.runtime.env.torchrun_store`).
    """

    def __init__(self, world: World, host: str, port: int, prefix: str) -> None:
        self.world = world
        self._address = (host, port)
        self._prefix = prefix

    @classmethod
    def from_torchrun(cls, world: World) -> Rendezvous | None:
        """The run's rendezvous, or ``None`` outside torchrun (no agent store to use)."""
        store = env.torchrun_store()
        return None if store is None else cls(world, *store)

    def _store(self, timeout_s: float) -> Any:
        import torch.distributed as dist

        host, port = self._address
        return dist.TCPStore(
            host,
            port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )

    def publish(self, key: str, value: str, timeout_s: float = 60) -> None:
        """Set ``key`` for this run; fail after ``timeout_s`` without torchrun's store."""
        self._store(timeout_s).set(self._prefix + key, value)

    def peek(self, keys: Iterable[str], timeout_s: float = 10) -> dict[str, str]:
        """The values of those of ``keys`` that are set now (no wait for the others)."""
        store = self._store(timeout_s)
        found = {}
        for key in keys:
            if store.check([self._prefix + key]):
                found[key] = bytes(store.get(self._prefix + key)).decode()
        return found

    def lookup(
        self, key: str, timeout_s: float, *, what: str, stop: Callable[[], bool] = lambda: False
    ) -> str:
        """``key``'s value once rank 0 published it; fail within ``timeout_s`` naming ``what``.

        Polled (``check``, then a short sleep in Python), never a blocking ``get``: a
        thread that wakes from the store's C++ wait while the interpreter exits is ended
        by CPython through C++ frames, which aborts the process (``terminate called
        without an active exception``; rank 0's exit publishes late when it waits for its
        own start). ``stop()`` true (this process exits) ends the wait with an error.
        """
        name = self._prefix + key
        deadline = time.monotonic() + timeout_s
        try:
            store = self._store(timeout_s)
            while not store.check([name]):
                if stop():
                    raise RayDLError(
                        f"rank {self.world.rank}: the process is exiting; it no longer waits "
                        f"for {what}."
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no {name!r} after {timeout_s:g} s")
                time.sleep(LOOKUP_POLL_S)
            return bytes(store.get(name)).decode()
        except RayDLError:
            raise
        except RuntimeError as err:  # torch's DistStoreError is a RuntimeError
            raise RayDLError(
                f"rank {self.world.rank}: {what} was not published within {timeout_s:g} s "
                f"through torchrun's store ({err}). Rank 0 has died or is still starting; "
                "see its log."
            ) from err


#: Seconds between a lookup's checks of torchrun's store.
LOOKUP_POLL_S = 0.05
