"""raydl: a drop-in torch ``DataLoader`` whose loading runs as a streaming Ray pipeline.

Example:
    >>> from raydl import RayDataLoader as DataLoader  # the one-line change
"""

# First: a Ctrl-C must end the process as interrupted, also once Ray is imported.
from raydl._internal.runtime import interrupt as _interrupt  # noqa: F401
from raydl._internal.runtime.world import World
from raydl.errors import (
    LoaderTimeoutError,
    RayDLError,
    RemoteReadError,
    StateMismatchError,
    WorkerDiedError,
)
from raydl.loader import RayDataLoader
from raydl.options import LoaderOptions
from raydl.pipelines import PerEpoch
from raydl.session import init, shutdown
from raydl.sources import (
    CacheConfig,
    CacheStats,
    RetryPolicy,
    label_from_path,
    read_binary_files,
    read_images,
    read_parquet,
)

__version__ = "0.1.0"

__all__ = [
    "CacheConfig",
    "CacheStats",
    "LoaderOptions",
    "LoaderTimeoutError",
    "PerEpoch",
    "RayDLError",
    "RayDataLoader",
    "RemoteReadError",
    "RetryPolicy",
    "StateMismatchError",
    "WorkerDiedError",
    "World",
    "__version__",
    "init",
    "label_from_path",
    "read_binary_files",
    "read_images",
    "read_parquet",
    "shutdown",
]
