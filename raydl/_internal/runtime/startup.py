"""The loader's start on a daemon thread, from its construction to its first ``iter()``.

A training script spends seconds between building its loader and asking for the
first batch (building and moving the model, ``torch.compile``, DDP set-up, a
checkpoint). :class:`BackgroundStart` uses them: the thread connects this process
to Ray (:func:`raydl._internal.runtime.cluster.ensure_ray`, the embedded instance
by default) and then lets the epoch source warm what it can (its actors), so that
``iter()`` finds them ready and only waits for what is not.

Rules, each relied on elsewhere:

* Construction never blocks: :meth:`BackgroundStart.begin` starts a thread and
  returns.
* The thread makes no collective call. Under torchrun the ranks agree on rank 0's
  cluster through torchrun's key-value store (``cluster.ensure_ray``), never through
  a broadcast that could pair with the script's own collectives.
* ``iter()`` calls :meth:`wait` first. An error of the start is raised there, as
  raised in the thread, with a note saying where it came from; the next ``iter()``
  starts again in the trainer's thread.
* What the warm step builds is handed to the source only under this object's lock
  and only if the start was not cancelled; :meth:`cancel` (``close()``, garbage
  collection) takes the same lock, so a cancelled start never leaves actors behind.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from raydl._internal.runtime import cluster, forking
from raydl._internal.runtime.world import World

__all__ = ["BackgroundStart", "Warm", "begin_for", "connect"]

T = TypeVar("T")


class Warm(Generic[T]):
    """What a source warms after Ray is up: ``build`` it, then ``adopt`` it or ``discard`` it.

    ``build`` runs on the start's thread and must not touch the source's state;
    ``adopt`` hands the result to the source (under the start's lock);
    ``discard`` stops it when the start was cancelled meanwhile.
    """

    def __init__(
        self,
        build: Callable[[], T],
        adopt: Callable[[T], object],
        discard: Callable[[T], object],
    ) -> None:
        self.build = build
        self.adopt = adopt
        self.discard = discard


class BackgroundStart:
    """One loader's background start (see the module docstring)."""

    def __init__(self, connect: Callable[[], None], warm: Warm[Any] | None, name: str) -> None:
        self._connect = connect
        self._warm = warm
        self._lock = threading.Lock()
        self._cancelled = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @classmethod
    def begin(
        cls, connect: Callable[[], None], warm: Warm[Any] | None, name: str = "raydl-start"
    ) -> BackgroundStart:
        """Start the thread; returns at once."""
        start = cls(connect, warm, name)
        cluster.wait_for_starts_at_exit()  # before the thread can begin to start Ray
        start._thread.start()
        return start

    def _run(self) -> None:
        try:
            self._connect()
            warm = self._warm
            if warm is None or self.cancelled or cluster.exiting():
                return  # (the interpreter exits: no actors to make under Ray's shutdown)
            built = warm.build()
            with self._lock:
                adopted = not self._cancelled
                if adopted:
                    warm.adopt(built)
            if not adopted:
                warm.discard(built)
        except BaseException as err:  # handed to iter(), which raises it in the trainer
            self._error = err

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._cancelled

    @property
    def done(self) -> bool:
        """Whether the thread has finished (successfully or not)."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Wait for the start to finish; raise its error, if any, in this thread."""
        while self._thread.is_alive():
            # Sliced, so that Ctrl-C reaches the trainer's thread while it waits.
            self._thread.join(0.1)
        error = self._error
        if error is not None:
            add_note = getattr(error, "add_note", None)  # Python >= 3.11
            if add_note is not None:
                add_note(
                    "raised while raydl started Ray in the background (from the loader's "
                    "construction); see the cause above"
                )
            raise error

    def cancel(self) -> None:
        """Stop the start: what it has not handed over yet is discarded. Never blocks on Ray."""
        with self._lock:
            self._cancelled = True


class Warmable(Protocol):
    """An epoch source, as the background start sees it."""

    @property
    def in_process(self) -> bool:
        """Its epochs load in the training process: nothing to start."""
        ...

    def warm(self) -> Warm[Any] | None:
        """What to build once Ray is up."""
        ...

    @property
    def worker_modules(self) -> tuple[str, ...]:
        """What its Ray workers import, for an embedded instance to preload (``ensure_ray``)."""
        ...

    @property
    def shared_modules(self) -> tuple[str, ...]:
        """What its actors import, for the embedded instance's fork server to share
        (``runtime/forking.py``)."""
        ...


def connect(
    startup: BackgroundStart | None, address: str | None, world: World, preload: tuple[str, ...]
) -> None:
    """Wait for ``startup`` (raising its error), then make sure this process is on Ray."""
    if startup is not None:
        startup.wait()
    cluster.ensure_ray(address, world=world, preload=preload)


def begin_for(
    source: Warmable, address: str | None, world: World, enabled: bool | None
) -> BackgroundStart | None:
    """A loader's background start, or ``None`` when it has none to make.

    None when turned off, when the source loads in process, and for ranks outside
    torchrun (they meet over the process group, at ``iter()`` on the trainer's thread).
    """
    if source.in_process:
        return None
    forking.share(source.shared_modules)  # before Ray starts, with this start or a later one
    if not enabled:
        return None
    if not cluster.starts_without_collectives(address, world):
        return None
    connect = functools.partial(
        cluster.ensure_ray, address, world=world, preload=source.worker_modules
    )
    return BackgroundStart.begin(connect, source.warm())
