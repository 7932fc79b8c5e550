"""The actor processes' allocator: keep freed memory for the next batch.

A loader's actor allocates and frees the same large arrays over and over: a
decoded 224x224 float image is 600 KB, its batch 38 MB, each with a few
temporaries of its size. glibc's ``malloc`` serves such sizes with a fresh
``mmap`` (above ``M_MMAP_THRESHOLD``, 128 KB at first) and gives the memory back
to the kernel on ``free``, so every byte the actor produces is page-faulted in
and zeroed by the kernel again. Measured here (2 CPUs, the benchmark's JPEG
decode of 224x224 images, three runs each way): 158 page faults per image, and
the decode took 0.94-1.15 ms per image against 0.63-0.85 ms with both thresholds
raised through glibc's ``MALLOC_*_`` variables (256 MB and 1 GB; 7 faults per
image). The thresholds kept, 64 MB, are a middle measured on the whole loader
(docs/design.md).

So each actor raises both thresholds when it starts (``mallopt``): allocations up
to :data:`MMAP_THRESHOLD` come from the heap, and up to :data:`TRIM_THRESHOLD` of
free heap is kept for the next allocation rather than returned. The cost is that
an actor's resident memory stays near its high-water mark between batches
(docs/design.md, "What an actor's process does differently from a torch
worker's"). It applies to raydl's actors only, never to the training process; there,
:func:`release_freed_memory` only gives back what the trainer's stand-ins freed.
``RAYDL_KEEP_FREED_MEMORY=0`` leaves glibc's defaults; on other C libraries (musl,
macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Any

from raydl._internal.runtime import env

#: ``mallopt`` parameters (glibc's ``malloc.h``).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Allocations up to this size come from the heap, not from their own ``mmap``.
MMAP_THRESHOLD = 64 << 20

#: Free memory at the top of the heap kept for later allocations, at most.
TRIM_THRESHOLD = 64 << 20


@functools.cache
def _glibc(name: str, argtypes: tuple[Any, ...]) -> Any:
    """glibc's function ``name`` (returning an ``int``), or ``None`` on another C library."""
    try:
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):  # not glibc
        return None
    function.argtypes, function.restype = list(argtypes), ctypes.c_int
    return function


def keep_freed_memory() -> bool:
    """Raise this process's ``malloc`` thresholds (glibc only; see the module's text).

    Returns:
        Whether both thresholds were set.
    """
    if not sys.platform.startswith("linux") or not env.keep_freed_memory():
        return False
    mallopt = _glibc("mallopt", (ctypes.c_int, ctypes.c_int))
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def release_freed_memory() -> None:
    """Return the free pages of this process's heaps to the kernel (glibc's ``malloc_trim``).

    For the training process after each batch its stand-ins for a pool's workers
    loaded (``workers/emulated.py``): decoding there in the trainer's own heap, with
    glibc's defaults, left the benchmark's trainer at 660-830 MB PSS on full-size
    ``mapstyle_decode`` against 230 MB with it (docs/benchmarks.md, session 18).
    """
    trim = _glibc("malloc_trim", (ctypes.c_size_t,))
    if trim is not None:
        trim(0)
