"""raydl's actors keep freed memory (``workers/allocator.py``): no page faults per batch.

Measured in a fresh interpreter each, by the kernel's count of minor page faults
(``getrusage``): a round allocates, writes and frees eight 600 KB arrays (a decoded
224x224 float image and its temporaries are that size), 20 rounds. With glibc's
defaults the freed heap top is given back each round and faulted in again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="mallopt: glibc on Linux"
)

ROUNDS = 20
ARRAYS, ARRAY_BYTES = 8, 600 << 10
PAGES = ARRAYS * ARRAY_BYTES // 4096  # one round's

CODE = f"""
import resource
import numpy as np
from raydl._internal.workers import allocator
applied = allocator.keep_freed_memory()
def one_round():
    arrays = [np.ones({ARRAY_BYTES}, dtype=np.uint8) for _ in range({ARRAYS})]
    del arrays
one_round()  # the first round faults: the heap grows
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({ROUNDS}):
    one_round()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _python(code: str, *args: str, **env: str) -> str:
    """The standard output of ``code`` run by a fresh interpreter with ``args``; ``env``
    added to this process's environment (an empty value removes the variable)."""
    environ = {k: v for k, v in {**os.environ, **env}.items() if v}
    out = subprocess.run(
        [sys.executable, "-c", code, *args], env=environ, capture_output=True, text=True, timeout=50
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _faults(keep: str) -> tuple[bool, int]:
    applied, faults = _python(CODE, RAYDL_KEEP_FREED_MEMORY=keep).split()
    return applied == "True", int(faults)


@pytest.mark.timeout(120)
def test_freed_big_arrays_are_reused_without_page_faults() -> None:
    applied, kept = _faults("1")
    not_applied, default = _faults("0")
    assert applied and not not_applied
    assert default > ROUNDS * PAGES // 2  # glibc's defaults: most rounds fault their pages in
    assert kept < PAGES  # kept: all rounds together fault in less than one round's pages


BIG_ARRAYS = 100  # of 1 MiB each: a reply larger than the initial trim threshold (64 MB)
BIG_CODE = f"""
import resource, sys
import numpy as np
from raydl._internal.workers import allocator
allocator.keep_freed_memory()
look = sys.argv[1] == "look"
def one_round():
    arrays = [np.ones(1 << 20, dtype=np.uint8) for _ in range({BIG_ARRAYS})]
    if look:  # as an actor does once its reply is made
        allocator.keep_working_set()
    del arrays
one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    one_round()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, allocator.keep_working_set())
"""


@pytest.mark.timeout(120)
def test_a_reply_larger_than_the_trim_threshold_keeps_its_memory_for_the_next() -> None:
    """After each reply an actor keeps as much freed memory as it had in use (bounded)."""
    runs = {}
    for how in ("look", "do_not_look"):
        faults, threshold = _python(BIG_CODE, how).split()
        runs[how] = int(faults), int(threshold)
    pages = BIG_ARRAYS * (1 << 20) // 4096  # one round's
    assert runs["do_not_look"][0] > 4 * pages // 2, runs  # given back and faulted in each round
    assert runs["look"][0] < pages, runs
    assert runs["look"][1] >= BIG_ARRAYS << 20 and runs["do_not_look"][1] == 64 << 20, runs


ARROW = """
import json, os, sys
if sys.argv[1] == "imported":
    import pyarrow  # as a worker forked from the server has it
from raydl._internal.workers import allocator
applied = allocator.keep_freed_memory()
import pyarrow as pa
table = pa.table({"x": pa.array(range(1000))})
print(json.dumps([applied, pa.default_memory_pool().backend_name,
                  os.environ.get("ARROW_DEFAULT_MEMORY_POOL")]))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pyarrow_first", ["imported", "later"])
def test_arrow_allocates_from_the_kept_heap_unless_the_process_was_told_otherwise(
    pyarrow_first: str,
) -> None:
    def run(**env: str) -> list[object]:
        result: list[object] = json.loads(_python(ARROW, pyarrow_first, **env).splitlines()[-1])
        return result

    assert run(ARROW_DEFAULT_MEMORY_POOL="") == [True, "system", "system"]
    assert run(ARROW_DEFAULT_MEMORY_POOL="mimalloc") == [True, "mimalloc", "mimalloc"]
    assert run(ARROW_DEFAULT_MEMORY_POOL="", RAYDL_KEEP_FREED_MEMORY="0")[1] != "system"


TRAINER_TRIM = """
import ctypes, json, sys, threading
from raydl._internal.workers import allocator
if sys.argv[1] == "actor":
    allocator.keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def private_dirty_mb():
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(l.split()[1]) for l in f if l.startswith("Private_Dirty")) >> 10
def churn():  # a producer thread's batches, in its own arena, freed but for the last
    blocks = [libc.malloc(2000) for _ in range(40_000)]
    for block in blocks:
        ctypes.memset(block, 1, 2000)
    for block in blocks[:-1]:
        libc.free(block)
thread = threading.Thread(target=churn)
thread.start()
thread.join()
before = private_dirty_mb()
first, again = allocator.release_freed_memory_now_and_then(), \\
    allocator.release_freed_memory_now_and_then()
print(json.dumps([first, again, before, private_dirty_mb()]))
"""


@pytest.mark.timeout(60)
def test_the_trainer_gives_freed_memory_back_at_most_once_a_period_and_an_actor_never() -> None:
    """A thread's freed 80 MB stay in its arena (the last block pins its top) until a trim."""
    seen = {}
    for kind in ("trainer", "actor"):
        seen[kind] = json.loads(_python(TRAINER_TRIM, kind).splitlines()[-1])
    first, again, before, after = seen["trainer"]
    assert first and not again  # once per TRAINER_TRIM_PERIOD_S
    assert before > 60 and before - after > 50, seen  # the freed 80 MB went back
    first, again, before, after = seen["actor"]
    assert not first and not again and after > 60, seen  # an actor keeps its freed memory
