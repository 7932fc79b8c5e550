"""A Ctrl-C ends the training process as an interrupted process, Ray or not.

Python exits an interrupted script by re-raising SIGINT once it has run its
``atexit`` handlers, so a shell or a scheduler sees "killed by SIGINT" (status
130 in a shell). But CPython forgets the interrupt when an ``atexit`` handler
runs ``exec``/``eval`` of a string, and Ray's handler (``ray.shutdown``, which
imports modules that build dataclasses) does: with Ray imported, a Ctrl-C
exits with status 1 as if the script had failed.

:func:`install` (run when this module is imported, which ``raydl/__init__.py``
does first, before anything imports Ray) wraps
``sys.excepthook`` to note an unhandled ``KeyboardInterrupt`` and registers an
``atexit`` handler that runs after Ray's: it flushes the standard streams and
logging and ends the process with SIGINT, as Python would have. Handlers that
were registered before raydl was imported run after it and are skipped then.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

_interrupted = False
_installed = False


def install() -> None:
    """Note unhandled Ctrl-Cs, and end an interrupted process by SIGINT (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(_exit_as_interrupted)  # before Ray's handler: it runs after it
    # Ray, imported later, wraps this hook in its own; imported earlier, it is wrapped here.
    sys.excepthook = _Chain(sys.excepthook)


class _Chain:
    """``sys.excepthook``: notes an unhandled interrupt, then calls the hook it replaced."""

    def __init__(
        self, before: Callable[[type[BaseException], BaseException, TracebackType | None], Any]
    ) -> None:
        self._before = before

    def __call__(
        self, kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        global _interrupted
        if issubclass(kind, KeyboardInterrupt):
            _interrupted = True
        self._before(kind, value, tb)


def interrupted() -> bool:
    """Whether the process is ending because of an unhandled Ctrl-C (``KeyboardInterrupt``)."""
    return _interrupted


def release_import_lock_left_held() -> int:
    """Release CPython's global import lock where this thread still holds it; returns how often.

    A Ctrl-C that lands inside importlib between its acquire of that lock and the
    ``try`` that releases it (``_get_module_lock``) leaves the lock held by the
    interrupted thread for good, and every other thread's next import waits forever
    (seen once in about 40 tries: a start of Ray for reads, at exit). Call it where this
    thread is inside no import, such as an ``atexit`` handler: any hold it has then is
    such a leftover. A lock held by another thread (an import under way there) is left.
    """
    import _imp

    released = 0
    while _imp.lock_held():
        try:
            _imp.release_lock()
        except RuntimeError:  # held by another thread
            break
        released += 1
    return released


def _exit_as_interrupted() -> None:
    if not _interrupted:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing left to flush
            continue
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


install()
