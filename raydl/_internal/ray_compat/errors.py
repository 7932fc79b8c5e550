"""Unwrapping Ray's errors into the exception the user's code raised.

Relies on ``RayTaskError.cause``, on ``RaySystemError.client_exc`` (what failed
while an object was unpickled) and on ``WorkerCrashedError``/``RayActorError``
meaning "the process died" (checked by :func:`check`).
"""

from __future__ import annotations

from collections.abc import Sequence

from raydl.errors import WorkerDiedError


def users_error(err: BaseException, stages: Sequence[str] = (), attempts: int = 1) -> BaseException:
    """The exception a user's Ray Data stage raised, rather than Ray's wrapper of it.

    torch re-raises a worker's exception with its own type, so raydl does too:
    epoch plans run with ``raise_original_map_exception``, so Ray's
    ``RayTaskError`` carries the user's exception as its ``cause``. The wrapper
    stays chained as the cause: its text names the stage and carries the
    worker-side traceback down to the user's frame.

    A worker process that died on every one of its ``attempts`` (Ray's
    ``WorkerCrashedError`` / ``RayActorError`` once the bounded retries are spent)
    becomes a :class:`WorkerDiedError` naming the plan's ``stages``; Ray does not
    say which stage's task it was, only its log does.
    """
    from ray.exceptions import RayActorError, RayTaskError, WorkerCrashedError

    if isinstance(err, (WorkerCrashedError, RayActorError)):
        died = WorkerDiedError(
            f"a Ray worker process running this epoch's Ray Data stages "
            f"({' -> '.join(stages) or 'unknown'}) died on all {attempts} attempts "
            "of the same task (a crash, os._exit, a segfault or an out-of-memory kill). An "
            "input that kills its worker every time cannot be loaded: find it from the "
            "stage's logs (Ray's raylet log names the dead worker), fix or filter it out; "
            "set max_retries in the stage's ray_remote_args to retry more often"
        )
        died.__cause__ = err
        return died
    if not isinstance(err, RayTaskError):
        return err
    cause = err.cause
    if not isinstance(cause, Exception) or isinstance(cause, RayTaskError):
        return err
    cause.__cause__ = err
    return cause


def unpickling_cause(err: BaseException) -> BaseException:
    """What failed while ``ray.get`` unpickled an object (a ``ModuleNotFoundError``, say).

    Ray raises such a failure as a ``RaySystemError`` whose ``client_exc`` is the
    exception itself; anything else is returned as it is.
    """
    from ray.exceptions import RaySystemError

    cause = getattr(err, "client_exc", None) if isinstance(err, RaySystemError) else None
    return cause if isinstance(cause, BaseException) else err


def check() -> None:
    """Fail if this Ray's task errors no longer carry their cause."""
    from ray.exceptions import RaySystemError, RayTaskError

    wrapped = RayTaskError("f", "traceback", ValueError("x"))
    if not isinstance(getattr(wrapped, "cause", None), ValueError):
        raise AttributeError("ray.exceptions.RayTaskError no longer carries .cause")
    missing = ModuleNotFoundError("No module named 'x'", name="x")
    if unpickling_cause(RaySystemError(missing, "traceback")) is not missing:
        raise AttributeError("ray.exceptions.RaySystemError no longer carries .client_exc")
