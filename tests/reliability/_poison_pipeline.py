"""Iterate a Ray Data pipeline whose row 57 kills its worker process every time.

Run by ``test_worker_faults.py`` in a subprocess (with its own ``RAY_TMPDIR``).
Prints ``RESULT finished`` or ``RESULT error <exception classes> :: <message>``.
"""

from __future__ import annotations

import os

import numpy as np
import ray

import raydl


def crash_on_poison(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``map_batches`` function: the process dies on row 57, every time.

    Defined here, in ``__main__``, so that Ray ships it by value: each attempt's
    fresh worker then starts without importing torch (``_faulty`` imports it),
    which took 2-5 s per attempt on 2 CPUs.
    """
    if 57 in batch["id"]:
        os._exit(1)
    return batch


def main() -> None:
    raydl.init(num_cpus=2)
    print("STARTED", flush=True)
    ds = ray.data.range(200, override_num_blocks=10).map_batches(crash_on_poison, batch_size=10)
    loader = raydl.RayDataLoader(ds, batch_size=8)
    try:
        rows = sum(len(batch["id"]) for batch in loader)
    except Exception as err:
        kinds = " ".join(cls.__name__ for cls in type(err).__mro__)
        print(f"RESULT error {kinds} :: {err}".replace("\n", " "), flush=True)
    else:
        print(f"RESULT finished {rows} rows", flush=True)
    loader.close()


if __name__ == "__main__":
    main()
