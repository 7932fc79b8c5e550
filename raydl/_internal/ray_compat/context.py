"""Ray Data's current ``DataContext``, made without importing Ray's state API.

``DataContext()`` builds its ``issue_detectors_config`` at once, and the module of
that configuration imports Ray Data's issue detectors, which import Ray's state API
(``ray.util.state``, pydantic models and all): 0.9 s of a cold start on this project's
2-CPU machine, in the trainer, before a raydl read returns. Only Ray Data's streaming
executor reads that configuration (its issue detectors), and raydl's direct path never
runs it. So :func:`get_current` creates the process's context, when none exists yet, with
an :class:`IssueDetectorsOnUse` in its place, which builds Ray's configuration the first
time anything reads it (the executor's first run, or a user's script).

Relies on these private parts of Ray Data (checked by :func:`check`):

* ``ray.data.context._default_context`` and ``_context_lock``, the process's context
  and the lock ``DataContext.get_current`` takes to create it;
* ``IssueDetectorsConfiguration`` (``ray.data._internal.issue_detection``), and
  ``DataContext.__post_init__`` writing fields of its ``hash_shuffle_detector_config``
  (the only access while the context is built).
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = [
    "DEFAULT_RETRIED_IO_ERRORS",
    "DEFAULT_SCHEDULING_STRATEGY",
    "IssueDetectorsOnUse",
    "check",
    "get_current",
]

#: ``DataContext().scheduling_strategy``: the scheduling of a read's tasks (Ray's
#: ``read_datasource`` puts it in the read's remote arguments; :func:`check` compares).
DEFAULT_SCHEDULING_STRATEGY = "SPREAD"

#: ``DataContext().retried_io_errors``: what a plan made without Ray Data retries
#: (``io/file_dataset.py``; :func:`check` compares it with Ray's).
DEFAULT_RETRIED_IO_ERRORS = (
    "AWS Error INTERNAL_FAILURE",
    "AWS Error NETWORK_CONNECTION",
    "AWS Error SLOW_DOWN",
    "AWS Error UNKNOWN (HTTP status 503)",
    "AWS Error SERVICE_UNAVAILABLE",
)

#: Orders the builds of every stand-in and the writes they record (a lock cannot be
#: copied or pickled with one).
_build_lock = threading.RLock()


def get_current() -> Any:
    """``ray.data.DataContext.get_current()``, created, if none exists, with its issue
    detectors' configuration built on first use.

    Call it wherever raydl would first ask for the context (a read's plan, the start
    of Ray): a context created by anything else is returned as it is.
    """
    from ray.data import DataContext
    from ray.data import context as ray_context

    with ray_context._context_lock:
        if ray_context._default_context is None:
            stand_in: Any = IssueDetectorsOnUse()  # typed as Ray's configuration
            ray_context._default_context = DataContext(issue_detectors_config=stand_in)
    return DataContext.get_current()


class IssueDetectorsOnUse:
    """Ray Data's ``IssueDetectorsConfiguration``, built when something first uses it.

    Reading or writing any of its fields builds it (importing Ray's state API then)
    and forwards to it, as do comparing it and printing it built. One field is
    different: ``hash_shuffle_detector_config`` is handed out as a recorder until
    then, whose fields' writes (``DataContext.__post_init__`` writes two) are kept
    and applied to the configuration when it is built, and whose reads build it.
    Copies (``DataContext.copy``) and pickles (the context travels to Ray's workers
    with a plan) carry what was recorded.
    """

    __hash__ = None  # type: ignore[assignment]  # as the dataclass it stands for

    def __init__(self) -> None:
        self._real: Any = None
        self._hash_shuffle = _RecordedWrites(self)

    def resolve(self) -> Any:
        """The real configuration: built now if it was not yet."""
        with _build_lock:
            if self._real is None:
                from ray.data._internal.issue_detection.issue_detector_configuration import (
                    IssueDetectorsConfiguration,
                )

                real = IssueDetectorsConfiguration()
                for name, value in self._hash_shuffle._written.items():
                    setattr(real.hash_shuffle_detector_config, name, value)
                self._real = real
            return self._real

    @property
    def hash_shuffle_detector_config(self) -> Any:
        """The recorder until the configuration is built (see the class), then its own."""
        if self._real is None:
            return self._hash_shuffle
        return self._real.hash_shuffle_detector_config

    def __getattr__(self, name: str) -> Any:
        # Only for names not found on this object; private and special names (copy's and
        # pickle's look-ups, before __init__ ran) are never forwarded.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.resolve(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.resolve(), name, value)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IssueDetectorsOnUse):
            if self._real is None and other._real is None:
                return self._hash_shuffle._written == other._hash_shuffle._written
            other = other.resolve()
        return bool(self.resolve() == other)

    def __repr__(self) -> str:
        if self._real is None:
            return f"IssueDetectorsOnUse(not built yet; recorded {self._hash_shuffle._written})"
        return repr(self._real)


class _RecordedWrites:
    """``hash_shuffle_detector_config`` before the configuration is built: keeps writes.

    Reading a field, comparing or printing it builds the configuration and answers
    for the real ``hash_shuffle_detector_config``.
    """

    __hash__ = None  # type: ignore[assignment]  # as the dataclass it stands for

    def __init__(self, owner: IssueDetectorsOnUse) -> None:
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_written", {})

    def _resolved(self) -> Any:
        """The real ``hash_shuffle_detector_config`` (building the configuration)."""
        return self._owner.resolve().hash_shuffle_detector_config

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._resolved(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        with _build_lock:
            if self._owner._real is None:
                self._written[name] = value
                return
        setattr(self._resolved(), name, value)

    def __eq__(self, other: object) -> bool:
        return bool(
            self._resolved() == (other._resolved() if isinstance(other, _RecordedWrites) else other)
        )

    def __repr__(self) -> str:
        return repr(self._resolved())


def check() -> None:
    """Fail if this Ray lacks the context internals used here."""
    import dataclasses

    from ray.data import DataContext
    from ray.data import context as ray_context

    if not hasattr(ray_context, "_default_context") or not hasattr(ray_context, "_context_lock"):
        raise AttributeError("ray.data.context has no _default_context / _context_lock")
    names = {f.name for f in dataclasses.fields(DataContext)}
    if "issue_detectors_config" not in names:
        raise AttributeError("ray.data.DataContext has no issue_detectors_config field")
    later = IssueDetectorsOnUse()
    stand_in: Any = later
    DataContext(issue_detectors_config=stand_in)
    hash_shuffle = later.resolve().hash_shuffle_detector_config
    for name, value in later._hash_shuffle._written.items():
        if getattr(hash_shuffle, name) != value:
            raise AttributeError(f"hash_shuffle_detector_config has no field {name!r}")
    default = DataContext(issue_detectors_config=stand_in)
    if tuple(default.retried_io_errors) != DEFAULT_RETRIED_IO_ERRORS:
        raise ValueError(f"Ray Data's default retried_io_errors are {default.retried_io_errors}")
    if default.scheduling_strategy != DEFAULT_SCHEDULING_STRATEGY:
        raise ValueError(f"Ray Data's default scheduling is {default.scheduling_strategy!r}")
