"""Exception types that users of raydl may want to catch.

Errors raised by *user code* (``__getitem__``, ``collate_fn``, a transform) are
re-raised in the training process with their original type, as torch's
``DataLoader`` does; the types below are for failures that belong to raydl
itself or to the Ray cluster it runs on.
"""

from __future__ import annotations

__all__ = [
    "LoaderTimeoutError",
    "RayDLError",
    "RemoteReadError",
    "StateMismatchError",
    "WorkerDiedError",
]


class RayDLError(RuntimeError):
    """Base class of the errors raised by raydl itself.

    Example:
        >>> try:
        ...     raise WorkerDiedError("Ray worker 0 died")
        ... except RayDLError as err:
        ...     print(type(err).__name__)
        WorkerDiedError
    """


class LoaderTimeoutError(RayDLError):
    """No batch arrived within the loader's ``timeout`` (torch raises ``RuntimeError`` too).

    Example:
        >>> issubclass(LoaderTimeoutError, RuntimeError)
        True
    """


class WorkerDiedError(RayDLError):
    """A Ray worker process died (crash, ``os._exit``, OOM kill) more often than retries allow.

    The message names the worker and the sample indices or file it was loading.

    Example:
        >>> issubclass(WorkerDiedError, RuntimeError)
        True
    """


class StateMismatchError(RayDLError, ValueError):
    """A ``state_dict`` does not fit this loader (another version, seed or dataset length).

    Example:
        >>> issubclass(StateMismatchError, ValueError)
        True
    """


class NumWorkersMismatchError(StateMismatchError, AssertionError):
    """A state loaded into a loader with another ``num_workers`` than the epoch it holds needs.

    Raised by the ``iter()`` after ``load_state_dict()``, where torchdata's
    ``StatefulDataLoader`` raises its ``AssertionError`` (this is one); the loader is
    left as it was.

    Example:
        >>> issubclass(NumWorkersMismatchError, AssertionError)
        True
    """


class RemoteReadError(RayDLError, OSError):
    """A remote read still failed after every retry; the message names endpoint and key.

    Example:
        >>> issubclass(RemoteReadError, OSError)
        True
    """
