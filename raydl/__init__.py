"""raydl: a drop-in torch ``DataLoader`` whose loading runs as a streaming Ray pipeline.

Example:
    >>> from raydl import RayDataLoader as DataLoader  # the one-line change
"""

from raydl._internal.world import World
from raydl.errors import LoaderTimeoutError, RayDLError, StateMismatchError, WorkerDiedError
from raydl.loader import LoaderOptions, RayDataLoader
from raydl.session import init, shutdown

__version__ = "0.1.0"

__all__ = [
    "LoaderOptions",
    "LoaderTimeoutError",
    "RayDLError",
    "RayDataLoader",
    "StateMismatchError",
    "WorkerDiedError",
    "World",
    "__version__",
    "init",
    "shutdown",
]
