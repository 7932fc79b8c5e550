"""Hand-off between a named producer thread and the training loop."""

from __future__ import annotations

import queue
import threading
from typing import Any


def put_until_stopped(q: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """Put ``item`` into the bounded ``q``, giving up once ``stop`` is set.

    A producer blocked on a full queue must still notice ``close()``: it waits in
    short slices and re-checks ``stop`` between them.

    Returns:
        Whether the item was put.
    """
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False
