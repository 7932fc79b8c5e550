"""Iterate a Ray Data pipeline whose row 57 kills its worker process every time.

Run by ``test_worker_faults.py`` in a subprocess (with its own ``RAY_TMPDIR``).
Prints ``RESULT finished`` or ``RESULT error <exception classes> :: <message>``.
"""

from __future__ import annotations

import ray
from _faulty import crash_on_poison

import raydl


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
