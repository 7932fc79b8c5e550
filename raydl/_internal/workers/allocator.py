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
image).

So each actor raises both thresholds when it starts (``mallopt``): allocations up
to :data:`MMAP_THRESHOLD` come from the heap, and up to :data:`TRIM_THRESHOLD` of
free heap is kept for the next allocation rather than returned. A direct run's
reply larger than that (250 decoded 224x224 images are 150 MB) would still be
given back to the kernel once sent, and faulted in again for the next one (49
faults per image, a sixth of the actor's CPU in system time). So a direct run's
reply is sent in parts (``direct.RunLoader.parts``), and before it sends each
part the actor raises the trim threshold to twice the memory it has in use
(:func:`keep_working_set`; the stage's temporaries are freed already; at most
:data:`MAX_TRIM_THRESHOLD`): what one part and its temporaries needed is kept for
the next, and free memory kept never exceeds what the actor once had in use. A
map-style actor's batches stay under the initial threshold (a 64x3x224x224 float
batch is 38 MB); raising it there bought nothing but memory (map-style decode
peaks of 1.0-1.2 GB against 0.9). The cost is that an actor's resident memory
stays near its high-water mark between batches (docs/design/embedded-runtime.md, "What an actor's
process does differently from a torch worker's"). It applies to raydl's actors
only, never to the training process; there, :func:`release_freed_memory` gives
back what the trainer's stand-ins freed, and :func:`release_freed_memory_now_and_then`
what its loader's threads freed. ``RAYDL_KEEP_FREED_MEMORY=0`` leaves glibc's
defaults in the actors; on other C libraries (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
import time
from typing import Any

from raydl._internal.runtime import env

#: ``mallopt`` parameters (glibc's ``malloc.h``).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Allocations up to this size come from the heap, not from their own ``mmap``.
MMAP_THRESHOLD = 64 << 20

#: Free memory at the top of the heap kept for later allocations, at first.
TRIM_THRESHOLD = 64 << 20

#: The most free memory :func:`keep_working_set` keeps.
MAX_TRIM_THRESHOLD = 1 << 30

#: :func:`keep_working_set` raises the threshold in steps of this many bytes.
_STEP = 16 << 20

#: The least seconds between two trims by :func:`release_freed_memory_now_and_then`.
TRAINER_TRIM_PERIOD_S = 1.0
_trimmed_at = 0.0  # time.monotonic() of its last trim


class _Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33+)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


#: :func:`keep_working_set` looks at most this often: ``mallinfo2`` walks the heaps'
#: free lists (130 us with 5,000 free chunks), more than a small batch takes to load.
_EVERY_S = 0.5

#: The trim threshold this process set (0: none, the thresholds are glibc's own).
_trim_threshold = 0
_looked_at = -_EVERY_S  # time.monotonic() of the last look


@functools.cache
def _glibc(name: str, argtypes: tuple[Any, ...], restype: Any = ctypes.c_int) -> Any:
    """glibc's function ``name`` (returning ``restype``), or ``None`` on another C library."""
    try:
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):  # not glibc
        return None
    function.argtypes, function.restype = list(argtypes), restype
    return function


def keep_freed_memory() -> bool:
    """Raise this process's ``malloc`` thresholds (glibc only; see the module's text).

    Returns:
        Whether both thresholds were set.
    """
    if not sys.platform.startswith("linux") or not env.keep_freed_memory():
        return False
    global _trim_threshold
    mallopt = _glibc("mallopt", (ctypes.c_int, ctypes.c_int))
    if mallopt is None:
        return False
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        _trim_threshold = TRIM_THRESHOLD
        arrow_from_heap()
        return True
    return False


#: Arrow's variable naming its default memory pool (``system``, ``jemalloc``, ``mimalloc``).
ARROW_POOL_VAR = "ARROW_DEFAULT_MEMORY_POOL"


def arrow_from_heap() -> str | None:
    """Have Arrow allocate from glibc's heap, under the thresholds set here (an actor).

    pyarrow's own allocator (mimalloc in its wheels) keeps what Arrow frees for
    Arrow alone, in a 1 GB reservation of its own, beside the heap that already keeps
    freed memory for the next batch: at the peak of the benchmark's small images
    each actor held 9 MB there (44 MB of private memory in all against 35 with
    the system pool; docs/design/embedded-runtime.md, "The floor"). A variable the process was
    given (``ARROW_DEFAULT_MEMORY_POOL``, the user's choice) is left alone.

    Returns:
        The pool asked for, or ``None`` when the variable was set already.
    """
    if ARROW_POOL_VAR in os.environ:
        return None
    os.environ[ARROW_POOL_VAR] = "system"  # read when Arrow makes its default pool
    pyarrow = sys.modules.get("pyarrow")  # imported (e.g. shared by the fork server)
    if pyarrow is not None:
        pyarrow.set_memory_pool(pyarrow.system_memory_pool())
    return "system"


def keep_working_set() -> int:
    """Raise the trim threshold to twice the memory in use now (an actor, a direct run's part made).

    Called while the reply is alive, so the freed memory its successor will need
    is kept. Looks at most every :data:`_EVERY_S` seconds (a working set is set by
    the first few replies); only raises, in steps of 16 MB, to at most
    :data:`MAX_TRIM_THRESHOLD`; nothing happens unless :func:`keep_freed_memory` set
    the thresholds.

    Returns:
        The trim threshold now (0: glibc's own).
    """
    global _trim_threshold, _looked_at
    if not _trim_threshold or _trim_threshold >= MAX_TRIM_THRESHOLD:
        return _trim_threshold
    now = time.monotonic()
    if now - _looked_at < _EVERY_S:
        return _trim_threshold
    _looked_at = now
    mallinfo2 = _glibc("mallinfo2", (), _Mallinfo2)
    if mallinfo2 is None:  # glibc before 2.33
        return _trim_threshold
    info = mallinfo2()
    in_use = info.uordblks + info.hblkhd  # the heaps' chunks in use, and mmap'd ones
    # Twice: the stage's temporaries, freed before the part is sent, are not in use now.
    wanted = min(MAX_TRIM_THRESHOLD, -(-2 * in_use // _STEP) * _STEP)
    mallopt = _glibc("mallopt", (ctypes.c_int, ctypes.c_int))
    if wanted > _trim_threshold and mallopt(_M_TRIM_THRESHOLD, wanted):
        _trim_threshold = wanted
    return _trim_threshold


def release_freed_memory() -> None:
    """Return the free pages of this process's heaps to the kernel (glibc's ``malloc_trim``).

    For the training process after each batch its stand-ins for a pool's workers
    loaded (``workers/emulated.py``): decoding there in the trainer's own heap, with
    glibc's defaults, left the benchmark's trainer at 660-830 MB PSS on full-size
    ``mapstyle_decode`` against 230 MB with it.
    """
    trim = _glibc("malloc_trim", (ctypes.c_size_t,))
    if trim is not None:
        trim(0)


def release_freed_memory_now_and_then() -> bool:
    """:func:`release_freed_memory`, at most once per :data:`TRAINER_TRIM_PERIOD_S`.

    For the training process, from its loader's producer threads (each item they hand
    over, ``stream/handoff.py``; any thread may call it). They build batches there: a
    local shuffle buffer's rows gathered, a batch's columns converted, sliced or
    concatenated, each freed by the training loop once used. glibc keeps such freed
    memory in each thread's arena, where it piles up between uses. Measured on the
    benchmark's small images (2 CPUs): the trainer's arenas held 39 MB at the peak
    of four epochs and 16 MB right after one trim; with a trim every second the
    peak of the process tree went 661/667 -> 638 MB PSS, every 0.5 s to 634/633, and
    each trim took 0.9 ms. The memory given back is faulted in again when used, by
    the loader or the training loop: at most what the last second freed. Never in a
    process that keeps its freed memory (:func:`keep_freed_memory`, an actor).

    Returns:
        Whether it trimmed now.
    """
    global _trimmed_at
    now = time.monotonic()
    if now - _trimmed_at < TRAINER_TRIM_PERIOD_S or _trim_threshold:
        return False
    _trimmed_at = now  # two threads at once: both trim, as harmless as one
    release_freed_memory()
    return True
