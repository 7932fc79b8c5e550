"""raydl: a drop-in torch ``DataLoader`` whose loading runs as a streaming Ray pipeline.

Example:
    >>> from raydl import RayDataLoader as DataLoader  # the one-line change

The public names are imported on first use (PEP 562): Ray's worker processes
import this package to run raydl's own code, and those that run only pyarrow
and numpy work (the direct path's actors, Ray Data's read tasks) never import
torch that way (about 130 MB of private memory each; docs/design/embedded-runtime.md, "Lean").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# First: a Ctrl-C must end the process as interrupted, also once Ray is imported.
from raydl._internal.runtime import interrupt as _interrupt  # noqa: F401

if TYPE_CHECKING:
    from raydl._internal.runtime.world import World
    from raydl.errors import (
        LoaderTimeoutError,
        NumWorkersMismatchError,
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
        FileDataset,
        RetryPolicy,
        label_from_path,
        read_binary_files,
        read_images,
        read_parquet,
    )

__version__ = "0.1.0"

#: Each public name -> the module that defines it.
_HOMES = {
    "CacheConfig": "raydl.sources",
    "CacheStats": "raydl.sources",
    "FileDataset": "raydl.sources",
    "LoaderOptions": "raydl.options",
    "LoaderTimeoutError": "raydl.errors",
    "NumWorkersMismatchError": "raydl.errors",
    "PerEpoch": "raydl.pipelines",
    "RayDLError": "raydl.errors",
    "RayDataLoader": "raydl.loader",
    "RemoteReadError": "raydl.errors",
    "RetryPolicy": "raydl.sources",
    "StateMismatchError": "raydl.errors",
    "WorkerDiedError": "raydl.errors",
    "World": "raydl._internal.runtime.world",
    "init": "raydl.session",
    "label_from_path": "raydl.sources",
    "read_binary_files": "raydl.sources",
    "read_images": "raydl.sources",
    "read_parquet": "raydl.sources",
    "shutdown": "raydl.session",
}

__all__ = [
    "CacheConfig",
    "CacheStats",
    "FileDataset",
    "LoaderOptions",
    "LoaderTimeoutError",
    "NumWorkersMismatchError",
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


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'raydl' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    """The module's names, the ones not yet imported included."""
    return sorted([*globals(), *_HOMES])
