"""An exception caught in a Ray actor, carried to the trainer and raised there as torch would.

torch's ``ExceptionWrapper`` (``torch._utils``) is what a torch worker returns in
place of a batch whose loading raised; the training process re-raises it as the
original type, with the worker's traceback in the message ("Caught ValueError in
DataLoader worker process 2. Original Traceback: ..."). :class:`RemoteError` does
the same without importing torch: raydl's direct-path actors run only pyarrow and
numpy work, and importing torch costs each of them about 130 MB of private
memory (docs/design/embedded-runtime.md, "Lean"). Its ``reraise`` follows torch's rules: a
``KeyError`` keeps its message readable, an exception type with a ``message``
keyword gets it, and a type that cannot be built from one string becomes a
``RuntimeError`` with the same text.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, NoReturn


class _KeyErrorMessage(str):
    """A ``KeyError``'s text, shown as it is rather than as the ``repr`` of a key."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


class RemoteError:
    """The exception being handled, with its traceback as text, for raising elsewhere.

    Example:
        >>> try:
        ...     {}["x"]
        ... except KeyError:
        ...     error = RemoteError(where="in Ray worker 0")
        >>> error.exc_type.__name__
        'KeyError'
    """

    def __init__(self, where: str = "in background", exc_info: Any = None) -> None:
        """Wrap the exception being handled (or ``exc_info``), never its traceback object.

        Args:
            where: Where it happened ("in Ray worker 1 while loading index 7").
            exc_info: A ``sys.exc_info()`` triple; the current one when ``None``.
        """
        exc_type, value, tb = exc_info if exc_info is not None else sys.exc_info()
        self.exc_type: type[BaseException] = exc_type or RuntimeError
        self.exc_msg = "".join(traceback.format_exception(exc_type, value, tb))
        self.where = where

    def reraise(self) -> NoReturn:
        """Raise the wrapped exception's type in this process, with the remote traceback."""
        msg: str = f"Caught {self.exc_type.__name__} {self.where}.\nOriginal {self.exc_msg}"
        if self.exc_type is KeyError:
            msg = _KeyErrorMessage(msg)
        elif getattr(self.exc_type, "message", None):
            raise self.exc_type(message=msg)  # type: ignore[call-arg]
        try:
            exception = self.exc_type(msg)
        except Exception:
            raise RuntimeError(msg) from None
        raise exception
